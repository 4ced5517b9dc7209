"""Executors run each step's SchedulerOutput on the workers (base.py): `uniproc` in the engine process
(TP = PP = 1), `multiproc` one worker process per rank (TP x PP of them), `ray_executor` one Ray actor per
rank. `make_executor` picks one for a config (--distributed-executor-backend, EngineConfig.executor_backend)."""

from engine_svc.config import EngineConfig
from engine_svc.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    backend = config.executor_backend
    if backend == "uni":
        from engine_svc.executor.uniproc import UniprocExecutor

        return UniprocExecutor(config)
    if backend == "ray":
        from engine_svc.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from engine_svc.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
