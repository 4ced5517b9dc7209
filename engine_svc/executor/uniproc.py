"""TP = 1: the worker lives in the engine process and is called directly."""

from __future__ import annotations

from engine_svc.executor.base import Executor
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput
from engine_svc.worker.worker import Worker


class UniprocExecutor(Executor):
    def determine_num_blocks(self) -> int:
        self.worker = Worker(self.config, rank=0)
        self.worker.load_model()
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_cache(num_blocks, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def lend_core(self, lend: bool) -> None:
        if self.worker.device.type == "cpu":
            self.worker.lend_core(lend)

    def shutdown(self) -> None:
        self.worker = None  # type: ignore[assignment]

    @property
    def vocab_size(self) -> int:
        return int(self.worker.model.vocab_size)  # type: ignore[union-attr]

    @property
    def kv_block_bytes(self) -> int:
        return self.worker.kv_block_bytes
