"""Executors run SchedulerOutputs on the workers and return rank 0's ModelRunnerOutput.

`uniproc` runs one worker in the engine process (TP = 1); `multiproc` (tensor parallelism) spawns one
worker process per rank. The engine core depends only on this interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine_svc.config import EngineConfig
from engine_svc.sched.output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def initialize(self) -> int:
        """Load the model on every worker, size and allocate the KV cache; return the number of blocks
        (the minimum over ranks)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def check_health(self) -> None:  # noqa: B027 - a no-op is the right default
        """Raise if a worker is dead. Uniproc workers die with the engine, so nothing to do by default."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def kv_block_bytes(self) -> int: ...


def make_executor(config: EngineConfig) -> Executor:
    if config.tensor_parallel_size == 1:
        from engine_svc.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    from engine_svc.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
