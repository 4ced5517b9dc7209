"""EngineCore: token ids in, token ids out, one scheduler step at a time.

`step()` is schedule -> execute -> update. It returns one `EngineCoreOutputs` per call carrying every
request that produced something (tokens, a finish, an error), and the scheduler's stats. The core is
single-threaded: the gRPC server drives it from its own busy-loop thread; the offline `LLM` calls it
directly.

Invariants: every request passed to `add_request` ends exactly once in some step's outputs (finished,
aborted, or rejected with an error), and its KV blocks are back in the pool when it does.
With `kv_events` on, `kv_events` is the log the prefix cache records its changes in (engine_svc/kv/events.py);
whoever drives the core must `take()` it regularly (the server's busy loop does, once per iteration).
`max_model_len` is what the engine serves and advertises: the configured value, lowered at start to what
the KV cache holds (`num_blocks * block_size`) so that any request within it fits alone in the cache. The
executor computes it (`effective_max_model_len`) and hands it to every worker before they size anything,
so workers, their persistent batch and the CUDA-graph heuristics use the same value.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from engine_svc.config import EngineConfig
from engine_svc.executor import make_executor
from engine_svc.executor.base import Executor
from engine_svc.kv.events import KVEventLog
from engine_svc.request import Request, RequestStatus
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput
from engine_svc.sched.scheduler import Scheduler
from engine_svc.structured.compiler import GrammarCompilers
from shared_runtime.contract import (
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)

logger = logging.getLogger(__name__)

_NOTHING_RAN = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, kv_events: bool = False,
                 compile_processes: bool = False) -> None:
        """`compile_processes`: compile structured-output constraints in processes the engine can pause and
        kill (engine_svc/structured/compile_farm.py): what a server of many clients needs; the offline
        API compiles on threads."""
        self.config = config
        self.kv_events: KVEventLog | None = KVEventLog() if kv_events else None
        self.executor = executor or make_executor(config)
        self.num_blocks = self.executor.initialize()
        self.vocab_size = self.executor.vocab_size
        self.max_model_len = max_model_len = self.executor.max_model_len  # what the workers were sized for
        self.config = config = dataclasses.replace(config, max_model_len=max_model_len)
        # Structured outputs: constraints compile off the busy loop (a serving engine prewarms the vocabulary).
        self._compiled = threading.Event()
        self.grammars = GrammarCompilers(config.model, self.vocab_size, on_done=self._compiled.set,
                                         processes=compile_processes)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=int(config.max_num_batched_tokens or max_model_len),
            long_prefill_token_threshold=int(config.long_prefill_token_threshold or 0),
            max_model_len=max_model_len,
            block_size=config.block_size,
            num_blocks=self.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.scheduling_policy,
            vocab_size=self.vocab_size,
            kv_events=self.kv_events,
            grammars=self.grammars,
        )
        self._log_capacity()

    def _log_capacity(self) -> None:
        cfg = self.config
        tokens = self.num_blocks * cfg.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); max concurrency at max_model_len=%d: %.2fx",
            self.num_blocks, cfg.block_size, tokens,
            self.num_blocks * self.executor.kv_block_bytes / 2**20,
            cfg.max_model_len, tokens / max(1, int(cfg.max_model_len or 1)),
        )

    # ---- inputs ------------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request; one the engine can never serve is rejected with an error output next step."""
        self.scheduler.add_request(Request(req, self.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        runner_output = self._execute(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs.timestamp = time.time()
        return outputs

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if so.is_empty and not so.finished_req_ids and not so.preempted_req_ids:
            return _NOTHING_RAN
        self.executor.lend_core(self.grammars.num_waiting() > 0)
        return self.executor.execute_model(so)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Whether a step would do anything now (requests waiting only for a grammar compile give it
        nothing to do; `grammars.on_done` tells when that changes)."""
        return self.scheduler.has_work()

    def wait_for_work(self, timeout: float) -> None:
        """Block until a grammar compile finishes (or `timeout`): for callers that step the core
        directly (the offline API). The busy loop points `grammars.on_done` at its inbox instead."""
        self._compiled.wait(timeout)
        self._compiled.clear()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.executor.shutdown()
