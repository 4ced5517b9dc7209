"""The body of one tensor-parallel worker process (started by MultiprocExecutor with spawn).

Startup: build the Worker (binds the device), join the TP group over torch.distributed (gloo on CPU,
nccl on CUDA) so the model's parallel layers shard at load time, attach to the command queue, then run
the busy loop until SHUTDOWN. Rank 0 answers through a pipe to the engine (see multiproc for why).

Invariants:
  * Every rank executes every command in the same order (they all read the same broadcast queue), so
    the collectives inside the forward pass line up.
  * Only one rank answers (`answer_rank`: TP rank 0 of the last pipeline stage, rank 0 without
    pipeline stages); every answer is for the command just read.
  * Any exception ends the process with exit code 1 after sending its traceback on the status pipe;
    the executor notices the death (process sentinel) and fails the engine. The process also exits
    (code 0) when its parent dies, so no worker outlives the engine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, cast

from engine_svc.config import EngineConfig
from engine_svc.executor.codec import (
    ACK,
    CacheSpec,
    Op,
    WorkerInfo,
    decode_command,
    encode_runner_output,
    encode_worker_info,
)
from engine_svc.executor.shm_queue import PeerDiedError, ReaderHandle, ShmBroadcastQueue
from engine_svc.sched.output import ModelRunnerOutput

FAULT_ENV = "TANDEM_FAULT_INJECT"
DEFAULT_WORKER_CLS = "engine_svc.worker.worker:Worker"


@dataclass
class WorkerArgs:
    """Everything a worker process gets from the executor (pickled by spawn)."""

    config: EngineConfig
    rank: int
    dist_init_method: str
    commands: ReaderHandle
    responses: Connection | None  # the answering rank only (answer_rank): send end of the answer pipe
    status: Connection  # send end: the traceback of a fatal error
    parent_pid: int
    worker_cls: str = DEFAULT_WORKER_CLS  # "module:Class" taking (config, rank)


class InjectedFault(RuntimeError):
    """Raised by the fault-injection hook (tests only)."""


def parse_fault(spec: str | None, rank: int) -> int | None:
    """`TANDEM_FAULT_INJECT="rank=1,step=3"`: the 1-based EXECUTE step at which `rank` raises, or None."""
    if not spec:
        return None
    fields = dict(part.split("=", 1) for part in spec.split(",") if part)
    if int(fields.get("rank", -1)) != rank:
        return None
    return int(fields["step"])


def answer_rank(config: EngineConfig) -> int:
    """The rank that answers the engine: TP rank 0 of the last pipeline stage (the one that samples)."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def worker_main(args: WorkerArgs) -> None:
    """Process entry point. Never returns normally into multiprocessing with an exception."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    try:
        code = _run(args)
    except PeerDiedError:
        code = 0  # the engine is gone: nothing left to report to
    except BaseException:
        text = f"TP worker rank {args.rank} failed:\n{traceback.format_exc()}"
        sys.stderr.write(text)
        with contextlib.suppress(OSError):
            args.status.send(text)
        code = 1
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: torch/gloo threads can hang at exit


def make_worker(worker_cls: str, config: EngineConfig, rank: int) -> Any:
    """An instance of `worker_cls` ("module:Class", taking (config, rank))."""
    module, _, name = worker_cls.partition(":")
    return getattr(importlib.import_module(module), name)(config, rank)


def join_groups(config: EngineConfig, rank: int, init_method: str) -> None:
    """Join the world of every rank (torch.distributed at `init_method`: gloo on CPU, nccl on CUDA) as
    global `rank`, in its TP group and pipeline stage."""
    from engine_svc.distributed.parallel_state import init_tp_group

    backend = "nccl" if config.device == "cuda" else "gloo"
    init_tp_group(rank, config.tensor_parallel_size, backend, init_method,
                  pipeline_stages=config.pipeline_parallel_size, layer_partition=config.pp_layer_partition)


def _run(args: WorkerArgs) -> int:
    from engine_svc.distributed.parallel_state import destroy_tp_group

    def parent_alive() -> bool:
        return os.getppid() == args.parent_pid

    worker = make_worker(args.worker_cls, args.config, args.rank)  # a CPU worker takes its share of the cores (worker/cpu_threads.py)
    join_groups(args.config, args.rank, args.dist_init_method)
    commands = ShmBroadcastQueue.attach_reader(args.commands)
    try:
        _busy_loop(worker, args, commands, args.responses, parent_alive)
    finally:
        close = getattr(worker, "shutdown", None)  # its background threads (the run-time LoRA reader)
        if close is not None:
            close()
        commands.close()
        destroy_tp_group()
    return 0


def _busy_loop(
    worker: Any,
    args: WorkerArgs,
    commands: ShmBroadcastQueue,
    responses: Connection | None,
    parent_alive: Any,
) -> None:
    run = CommandRunner(worker, args.rank, answers=responses is not None)
    while True:
        op, body = cast(tuple[Op, Any], commands.dequeue(is_alive=parent_alive, decode=decode_command))
        if op is Op.SHUTDOWN:
            return
        answer = run(op, body)
        if responses is not None:
            responses.send_bytes(answer)


class CommandRunner:
    """Runs one rank's commands on its worker and encodes the answer (see codec): every executor's rank
    body (this module's busy loop, the Ray actor) goes through it, so they behave alike.

    Invariant: called with every command, in broadcast order (the collectives inside line up); a rank
    that does not answer (`answers` False) still runs everything and returns b"". `TANDEM_FAULT_INJECT`
    makes the matching rank raise InjectedFault at its n-th EXECUTE."""

    def __init__(self, worker: Any, rank: int, answers: bool) -> None:
        self.worker, self.rank, self.answers = worker, rank, answers
        self.fault_step = parse_fault(os.environ.get(FAULT_ENV), rank)
        self.steps = 0

    def __call__(self, op: Op, body: Any) -> bytes:
        worker = self.worker
        if op is Op.EXECUTE:
            self.steps += 1
            if self.steps == self.fault_step:
                raise InjectedFault(f"{FAULT_ENV}: rank {self.rank} fails at step {self.steps}")
            out = worker.execute_model(body)
            if not self.answers:
                return b""
            if not isinstance(out, ModelRunnerOutput):
                out = out.get()  # async scheduling: a PendingOutput, the sampled ids still on their way
            return encode_runner_output(out)
        if op is Op.LOAD_MODEL:
            worker.load_model()
            num_blocks = _min_over_ranks(worker.determine_num_blocks(), worker)
            return encode_worker_info(WorkerInfo(num_blocks, int(worker.model.vocab_size), worker.kv_block_bytes))
        if op is Op.INIT_CACHE:
            spec = cast(CacheSpec, body)
            worker.initialize_cache(spec.num_blocks, spec.max_model_len)
            return ACK
        if op in (Op.KV_DESCRIBE, Op.KV_READ):  # P/D disaggregation: collectives over every rank
            from engine_svc.kv_transfer.shards import describe_worker, read_worker_blocks

            if op is Op.KV_DESCRIBE:
                return describe_worker(worker)
            return read_worker_blocks(worker, cast(list[int], body), answer_rank(worker.config))
        raise ValueError(f"{op.name} is not run by a worker")


def _min_over_ranks(value: int, worker: Any) -> int:
    """The minimum of `value` over all ranks, every stage's included (every rank must size its cache alike)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=getattr(worker, "device", "cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
