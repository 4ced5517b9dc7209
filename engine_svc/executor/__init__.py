"""Executors run each step's SchedulerOutput on the workers (base.py): `uniproc` in the engine process
(TP = PP = 1), `multiproc` one worker process per rank (TP x PP of them). `make_executor` picks one for a config."""

from engine_svc.config import EngineConfig
from engine_svc.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        from engine_svc.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    from engine_svc.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
