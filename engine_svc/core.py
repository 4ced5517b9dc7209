"""EngineCore: token ids in, token ids out, one scheduler step at a time.

`step()` is schedule -> execute -> update, on a queue of batches in flight (vLLM's
`step_with_batch_queue`): it schedules a batch and submits it to the executor without waiting
(`execute_model(..., non_block=True)`), and while fewer than `max_concurrent_batches` are in flight and
the oldest has not finished, returns at once; otherwise it waits for the oldest, updates the scheduler
with its output and returns that. At depth 1 (the default) every call schedules, runs and updates one
step, as a plain synchronous step does. At depth 2 (async scheduling, `--async-scheduling`) step N+1 is
scheduled, with output placeholders for the tokens step N is still sampling (engine_svc/sched/
scheduler.py), while step N runs, and step N's output is handled while step N+1 runs. A batch with
nothing to run is not queued, unless it carries requests the workers must drop.

It returns one `EngineCoreOutputs` per call carrying every request that produced something (tokens, a
finish, an error) in the batch it updated (none when it updated none), and the scheduler's stats. The
core is single-threaded: the gRPC server drives it from its own busy-loop thread; the offline `LLM` calls
it directly. `has_unfinished_requests()` stays true while a batch is in flight, so a caller that steps
until it turns false also drains the queue.

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
from collections import deque

from engine_svc.config import EngineConfig
from engine_svc.executor import make_executor
from engine_svc.executor.base import Executor, StepFuture
from engine_svc.kv.events import KVEventLog
from engine_svc.kv_transfer.connector import KVConnector
from engine_svc.kv_transfer.setup import make_connector
from engine_svc.lora.modules import lora_ids, resolved_max_cpu_loras
from engine_svc.lora.registry import LoRARegistry
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
        # P/D disaggregation: K/V blocks kept for, and pulled from, other engines (engine_svc/kv_transfer/).
        self.kv_connector: KVConnector | None = (
            make_connector(config, self.executor) if config.kv_transfer_config else None)
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
            async_scheduling=config.resolved_async_scheduling,
            speculative=config.speculative,
            lora_ids=lora_ids(config.lora_modules) if config.enable_lora else None,
            max_loras=config.max_loras,
            kv_connector=self.kv_connector,
            sliding_window=None if self.kv_connector is not None else config.kv_sliding_window,
            kv_group_windows=config.kv_group_windows,
        )
        # LoRA adapters by name, loaded and unloaded at run time too (None without --enable-lora).
        self.loras: LoRARegistry | None = None
        if config.enable_lora:
            assert self.scheduler.lora_ids is not None
            self.loras = LoRARegistry(
                self.scheduler.lora_ids, config.lora_modules,
                resolved_max_cpu_loras(config.max_loras, config.max_cpu_loras, len(config.lora_modules)),
                lambda: {r.lora_id for r in self.scheduler.requests.values() if r.lora_id},
                self.scheduler.lora_fingerprints, self.scheduler.lora_not_ready)
        # Batches in flight, newest first: (future of its output, what was scheduled).
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self._batch_queue: deque[tuple[StepFuture, SchedulerOutput]] = deque()
        self._log_capacity()

    def _log_capacity(self) -> None:
        cfg = self.config
        tokens = self.num_blocks // len(cfg.kv_group_windows or (None,)) * cfg.block_size  # per KV group
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
        """One turn of the batch queue (see the module docstring)."""
        queue = self._batch_queue
        so = self.scheduler.schedule()
        if not so.is_empty or so.finished_req_ids or so.preempted_req_ids or self._lora_poll():
            if self.loras is not None:
                self.loras.attach(so)  # adapters loaded or dropped since the last step, before they are used
            self.executor.lend_core(self.grammars.num_waiting() > 0)
            queue.appendleft((self.executor.execute_model(so, non_block=True), so))
            if not so.is_empty and len(queue) < self.max_concurrent_batches and not queue[-1][0].done():
                return EngineCoreOutputs(scheduler_stats=self.scheduler.get_stats(with_step=False),
                                         timestamp=time.time())
        elif not queue:
            return self._update(so, _NOTHING_RAN)  # nothing ran: abort and rejection outputs only
        future, oldest = queue.pop()
        return self._update(oldest, future.result())

    def _lora_poll(self) -> bool:
        """Whether to submit a step even with nothing to run: requests wait for an adapter the workers are
        still reading, and only a step brings the news that they finished (engine_svc/lora/runtime_loads.py;
        such a step waits a little for the read, so this is no busy spin)."""
        return bool(self.scheduler.lora_not_ready) and len(self.scheduler.waiting) > 0

    def _lora_news(self, runner_output: ModelRunnerOutput) -> None:
        """Adapters every worker now holds (their requests may run from the next schedule on), or could not
        read (their requests end with an error, the name is no longer served)."""
        self.scheduler.lora_not_ready.difference_update(runner_output.lora_ready)
        for lora_id, why in runner_output.lora_failed.items():
            logger.warning("LoRA adapter id %d: the workers could not read it: %s", lora_id, why)
            self.scheduler.fail_lora(lora_id, why)
            if self.loras is not None:
                self.loras.failed(lora_id)

    def _update(self, so: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        if runner_output.lora_ready or runner_output.lora_failed:
            self._lora_news(runner_output)
        outputs = self.scheduler.update_from_output(so, runner_output)
        outputs.timestamp = time.time()
        return outputs

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the queue keeps in flight (the executor's; pipeline stages would raise it)."""
        return self._max_concurrent_batches

    @max_concurrent_batches.setter
    def max_concurrent_batches(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"max_concurrent_batches must be >= 1, got {depth}")
        self._max_concurrent_batches = depth
        self.scheduler.steps_in_flight = depth > 1  # the scheduler's bookkeeping of samples in flight

    @property
    def num_batches_in_flight(self) -> int:
        return len(self._batch_queue)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._batch_queue)

    def has_work(self) -> bool:
        """Whether a step would do anything now (requests waiting only for a grammar compile give it
        nothing to do; `grammars.on_done` tells when that changes; a batch in flight is work)."""
        return self.scheduler.has_work() or bool(self._batch_queue)

    def wait_for_work(self, timeout: float) -> None:
        """Block until a grammar compile finishes (or `timeout`): for callers that step the core
        directly (the offline API). The busy loop points `grammars.on_done` at its inbox instead."""
        self._compiled.wait(timeout)
        self._compiled.clear()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.grammars.shutdown()
        self.executor.shutdown()
