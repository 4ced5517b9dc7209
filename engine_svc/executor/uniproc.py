"""TP = 1: the worker lives in the engine process.

Without async scheduling each step runs inline, on the caller's thread (a future that is already done).
With it (`max_concurrent_batches` 2) the steps run on one worker thread, in the order submitted, so the
engine thread schedules step N+1 and handles step N's output while the worker computes: a torch op
releases the GIL, and on CUDA the worker returns as soon as the step is queued (its output is a
`PendingOutput`, waited for by `StepFuture.result()`). Everything the worker owns (model, batch, KV
cache, CUDA graphs) is touched by that one thread after start-up; `lend_core` reaches it with the step.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine_svc.executor.base import DoneFuture, Executor, StepFuture
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput
from engine_svc.worker.sampled_feed import PendingOutput, as_runner_output
from engine_svc.worker.worker import Worker


class ThreadStepFuture:
    """A step submitted to the worker thread; done once its output is on the host."""

    def __init__(self, future: Future[ModelRunnerOutput | PendingOutput]) -> None:
        self._future = future

    def result(self) -> ModelRunnerOutput:
        return as_runner_output(self._future.result())

    def done(self) -> bool:
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return True
        out = self._future.result()
        return not isinstance(out, PendingOutput) or out.ready()


class UniprocExecutor(Executor):
    _thread: ThreadPoolExecutor | None = None
    _lend = False

    def determine_num_blocks(self) -> int:
        self.worker = Worker(self.config, rank=0)
        self.worker.load_model()
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_cache(num_blocks, max_model_len)
        if self.max_concurrent_batches > 1:
            # The initializer gets the device, not this executor: the pool's thread keeps its initializer
            # for life, and a reference to the executor there would keep an engine that was dropped without
            # shutdown() alive (its worker, model and KV cache) as long as the process.
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-worker",
                                              initializer=_init_thread, initargs=(self.worker.device,))

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        if self._thread is None:
            return DoneFuture(as_runner_output(self.worker.execute_model(scheduler_output)))
        return ThreadStepFuture(self._thread.submit(self._run, scheduler_output, self._lend))

    def _run(self, scheduler_output: SchedulerOutput, lend: bool) -> ModelRunnerOutput | PendingOutput:
        if self.worker.device.type == "cpu":
            self.worker.lend_core(lend)  # on the thread that runs the model: its OpenMP team
        return self.worker.execute_model(scheduler_output)

    def lend_core(self, lend: bool) -> None:
        if self._thread is not None:
            self._lend = lend  # applied by the worker thread before its next step
        elif self.worker.device.type == "cpu":
            self.worker.lend_core(lend)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if getattr(self, "worker", None) is not None:
            self.worker.shutdown()
        self.worker = None  # type: ignore[assignment]

    @property
    def vocab_size(self) -> int:
        return int(self.worker.model.vocab_size)  # type: ignore[union-attr]

    @property
    def kv_block_bytes(self) -> int:
        return self.worker.kv_block_bytes


def _init_thread(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
