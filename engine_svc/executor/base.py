"""Executors run SchedulerOutputs on the workers and return rank 0's ModelRunnerOutput.

`uniproc` runs one worker in the engine process (TP = 1); `multiproc` spawns one worker process per
rank; `ray_executor` places one Ray actor per rank. The engine core depends only on this interface.

`execute_model(so, non_block=True)` returns a `StepFuture` at once: the engine core's batch queue
(engine_svc/core.py) keeps up to `max_concurrent_batches` of them in flight, and takes their results in
the order submitted. Every executor runs the steps in that order. Depth 1 (`max_concurrent_batches` 1,
without async scheduling) is the plain synchronous step: the uniproc executor then runs it inline.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Literal, Protocol, overload

from engine_svc.config import EngineConfig
from engine_svc.executor.codec import WorkerInfo
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def effective_max_model_len(config: EngineConfig, num_blocks: int) -> int:
    """The configured max_model_len, lowered (with a warning) to the tokens the KV cache can hold.

    As vLLM does: a context the cache cannot hold would be cut short silently (finish reason LENGTH
    below max_tokens); lowering it up front lets the frontend's length check reject such requests.
    """
    configured = int(config.max_model_len or 0)
    # with hybrid KV groups a request's every block of positions takes one block per group
    capacity = num_blocks // len(config.kv_group_windows or (None,)) * config.block_size
    if capacity >= configured:
        return configured
    logger.warning(
        "the KV cache holds %d tokens (%d blocks x %d), fewer than max_model_len=%d: serving with "
        "max_model_len=%d. Give the cache more memory (--kv-cache-memory-bytes, --gpu-memory-utilization, "
        "--num-gpu-blocks-override) or pass --max-model-len %d to silence this.",
        capacity, num_blocks, config.block_size, configured, capacity, capacity,
    )
    return capacity


class StepFuture(Protocol):
    """One submitted step: `result()` blocks until its output is on the host; `done()` never blocks."""

    def result(self) -> ModelRunnerOutput: ...

    def done(self) -> bool: ...


class DoneFuture:
    """A step that already ran (inline)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output

    def done(self) -> bool:
        return True


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.max_model_len = int(config.max_model_len or 0)  # the served value once initialize() ran

    def initialize(self) -> int:
        """Load the model on every worker and size the KV cache (the minimum over ranks); then hand every
        worker the block count and the served max_model_len (`effective_max_model_len`) in one message,
        before any of them sizes its persistent batch, staging buffers or CUDA graphs. Returns the number
        of blocks; `max_model_len` is the served value afterwards."""
        num_blocks = self.determine_num_blocks()
        self.max_model_len = effective_max_model_len(self.config, num_blocks)
        self.initialize_cache(num_blocks, self.max_model_len)
        return num_blocks

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """Load the model on every worker and measure how many KV blocks fit: the minimum over ranks."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Every worker allocates `num_blocks` KV blocks and sizes its batch for `max_model_len`."""

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps the engine core may keep in flight: with P pipeline stages P (each stage works on
        a different one), else 2 under async scheduling (step N+1 is scheduled while step N runs), else 1."""
        return max(self.config.pipeline_parallel_size, 2 if self.config.resolved_async_scheduling else 1)

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: Literal[False] = False) -> ModelRunnerOutput: ...

    @overload
    def execute_model(self, scheduler_output: SchedulerOutput, non_block: Literal[True]) -> StepFuture: ...

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | StepFuture:
        """Run one step on the workers: its output, or with `non_block` a future of it (returned at once)."""
        future = self.submit(scheduler_output)
        return future if non_block else future.result()

    @abstractmethod
    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Start a step after every step submitted before it; its future."""

    @abstractmethod
    def shutdown(self) -> None: ...

    def lend_core(self, lend: bool) -> None:  # noqa: B027 - a no-op is the right default
        """While `lend` holds, leave one CPU core to work running beside the step in this process (grammar
        compiles). Only an in-process CPU model competes for those cores; other executors ignore it."""

    def check_health(self) -> None:  # noqa: B027 - a no-op is the right default
        """Raise if a worker is dead. Uniproc workers die with the engine, so nothing to do by default."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def kv_block_bytes(self) -> int: ...


class WorkerInfoExecutor(Executor):
    """An executor whose workers live in other processes: `vocab_size` and `kv_block_bytes` are what the
    answer rank reported when the model loaded (`_info`, set by `determine_num_blocks`)."""

    _info: WorkerInfo | None = None

    @property
    def vocab_size(self) -> int:
        assert self._info is not None, "initialize() first"
        return self._info.vocab_size

    @property
    def kv_block_bytes(self) -> int:
        assert self._info is not None, "initialize() first"
        return self._info.kv_block_bytes
