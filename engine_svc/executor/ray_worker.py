"""The body of one rank as a Ray actor (made remote by ray_executor.RayExecutor, one per placement bundle).

It runs the same worker class and the same command code as a multiproc worker process
(worker_proc.make_worker, join_groups, CommandRunner): the engine broadcasts each encoded command by
calling `run` on every actor with one object-store reference, and Ray runs one caller's calls on an actor
in the order submitted, so every rank executes every command in the same order and the collectives
inside line up. Only the answer rank (worker_proc.answer_rank) returns the encoded answer; the others
return b"". Any exception propagates to the caller as a task error; the executor then fails the engine.
"""

from __future__ import annotations

import socket
from typing import Any

from engine_svc.config import EngineConfig
from engine_svc.executor.codec import Op, decode_command
from engine_svc.executor.worker_proc import CommandRunner, answer_rank, join_groups, make_worker
from engine_svc.worker.worker import Worker

RAY_CUDA_WORKER_CLS = "engine_svc.executor.ray_worker:RayCudaWorker"


class RayCudaWorker(Worker):
    """The engine's Worker where Ray decides the GPU: an actor with `num_gpus=1` sees exactly its own
    device (Ray sets CUDA_VISIBLE_DEVICES), so it is device 0 whatever the rank."""

    def _init_device(self) -> Any:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but this Ray actor sees no GPU; give the Ray nodes "
                               "GPUs or use --device cpu")
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)


class RankActor:
    """One rank: builds its worker on `start`, then runs commands until the executor kills it."""

    def __init__(self, config: EngineConfig, rank: int, worker_cls: str) -> None:
        self.config, self.rank, self.worker_cls = config, rank, worker_cls
        self._run: CommandRunner | None = None

    def address(self) -> tuple[str, int, int]:
        """(this node's IP, this process's pid, a TCP port free on this node now): rank 0's IP and port
        become the torch.distributed rendezvous."""
        import os

        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), os.getpid(), port  # type: ignore[no-untyped-call]

    def start(self, init_method: str) -> None:
        """Build the worker (binds the device), then join every rank's group at `init_method` (blocks until
        all ranks have joined: the executor calls it on every actor at once)."""
        worker = make_worker(self.worker_cls, self.config, self.rank)
        join_groups(self.config, self.rank, init_method)
        self._run = CommandRunner(worker, self.rank, answers=self.rank == answer_rank(self.config))

    def run(self, command: bytes) -> bytes:
        """Run one encoded command (codec.encode_command); the answer rank's encoded answer, else b""."""
        assert self._run is not None, "start() first"
        op, body = decode_command(command)
        if op is Op.SHUTDOWN:
            return b""
        return self._run(op, body)

    def ping(self) -> int:
        return self.rank
