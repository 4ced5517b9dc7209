"""TP or PP > 1: one worker process per rank, fed through a shared-memory broadcast queue.

    engine process                                  worker processes (spawn), rank 0 .. N-1
    MultiprocExecutor --commands (shm, N readers)--> busy loop: decode -> Worker -> (answer rank) answer
                      <--------answers (pipe)-------- the answer rank only

N = tensor_parallel_size x pipeline_parallel_size; the answer rank is TP rank 0 of the last stage
(worker_proc.answer_rank). With P stages every rank still reads every step, in order; stage s works on
step n while stage s+1 works on step n-1 (activations go stage to stage over torch.distributed), so the
executor asks the engine core for P batches in flight (`max_concurrent_batches`).

Answers take a pipe rather than a second shm queue: the engine then blocks in
`multiprocessing.connection.wait` on the pipe and every worker's sentinel, so it wakes the moment the
answer arrives or any worker dies, and burns no CPU polling during the forward pass (bench/shm_queue.py
measures both: equal back to back, the pipe ahead once a forward pass separates the two messages).

`__init__` only spawns the workers (they import torch and rendezvous meanwhile), so the engine server
can create the executor before starting gRPC (gRPC core is not fork-safe; spawn is safe either way).
`initialize()` then has them load the model and size the KV cache.

Steps in flight (the engine core's batch queue): `submit` enqueues a step and returns an `AnswerFuture`
at once; answers come back in command order, so a future's `result()` reads the answers still owed to
the futures before it, then its own. Meanwhile the engine process schedules the next step while the
workers compute this one.

Failure model: a worker that dies (killed, or exited after an exception, see worker_proc) makes the
next or current `execute_model` / `initialize` / `check_health` raise `WorkerDiedError` within about
`liveness_interval` seconds; the executor shuts itself down first, so no worker processes or /dev/shm
segments outlive the failure. `shutdown()` is idempotent and also runs at interpreter exit, when the
executor is garbage-collected, and on SIGTERM (a handler installed when created on the main thread,
which chains to the previous handler or re-raises the default action).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn, cast

from engine_svc.config import ConfigError, EngineConfig
from engine_svc.executor.base import StepFuture, WorkerInfoExecutor
from engine_svc.executor.codec import (
    CacheSpec,
    Op,
    WorkerInfo,
    decode_runner_output,
    decode_worker_info,
    encode_command,
)
from engine_svc.executor.nodes import (
    AnswerLink,
    LinkClosed,
    RemoteNode,
    accept_nodes,
    dist_init_method,
    local_ranks,
)
from engine_svc.executor.shm_queue import PeerDiedError, ShmBroadcastQueue
from engine_svc.executor.worker_proc import DEFAULT_WORKER_CLS, WorkerArgs, answer_rank, worker_main
from engine_svc.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)

COMMAND_CHUNKS, COMMAND_CHUNK_BYTES = 4, 4 << 20  # bigger SchedulerOutputs go through the overflow pipes
_JOIN_TIMEOUT_S = 3.0

_live_executors: weakref.WeakSet[MultiprocExecutor] = weakref.WeakSet()
_sigterm_installed = False


class WorkerDiedError(RuntimeError):
    """A TP worker process died or failed; the executor is shut down and cannot be used again."""


class AnswerFuture:
    """The answer rank's answer to one command (EXECUTE: a `ModelRunnerOutput`), read from the answer pipe
    when asked for, by whichever thread asks first (answers come in command order)."""

    def __init__(self, executor: MultiprocExecutor, decode: Callable[[bytes], Any] = decode_runner_output) -> None:
        self._executor = executor
        self._decode = decode
        self._output: Any = None

    def result(self) -> Any:
        while self._output is None:
            self._executor._read_answer(self)
        return self._output

    def done(self) -> bool:
        return self._output is not None or self._executor._answer_waiting(self)

    def _set(self, output: Any) -> None:
        self._output = output


class MultiprocExecutor(WorkerInfoExecutor):
    def __init__(
        self, config: EngineConfig, worker_cls: str = DEFAULT_WORKER_CLS, liveness_interval: float = 0.05
    ) -> None:
        super().__init__(config)
        self.world_size = config.world_size
        self.ranks = local_ranks(config)  # the ranks on this node (all of them on one node)
        self._store: Any = None  # the rendezvous store the workers join (one node)
        self._nodes: list[RemoteNode] = []  # node 0 of several: the headless nodes' links
        _check_devices(config)
        self._info: WorkerInfo | None = None
        self._failure: str | None = None
        self._fail_lock = threading.Lock()
        self._commands = ShmBroadcastQueue.create(
            len(self.ranks), COMMAND_CHUNKS, COMMAND_CHUNK_BYTES, liveness_interval=liveness_interval
        )
        self._procs: list[BaseProcess] = []
        self._owed: deque[AnswerFuture] = deque()  # commands sent, answers not read yet, in order
        # Commands may come from the engine core's thread and, for P/D pulls (`read_kv_blocks`), from the
        # server's: sending a command and queueing its future, and reading an answer, happen under it.
        self._answer_lock = threading.RLock()
        self._conns: list[Connection] = []  # answer pipe, then each rank's status pipe
        self._failing: list[bool] = []  # non-empty once failing: headless nodes then get no SHUTDOWN
        self._finalizer = weakref.finalize(self, _teardown, self._procs, self._conns, self._commands, self._nodes,
                                           self._failing)
        self._spawn(worker_cls)
        _live_executors.add(self)
        _install_sigterm_cleanup()
        if config.nnodes > 1 and config.node_rank == 0:
            self._join_nodes()

    def _join_nodes(self) -> None:
        """Wait for every headless node (nodes.accept_nodes); read the answers from the node holding the
        answer rank if it is not here. A node that never joins fails start-up, naming its ranks."""
        try:
            self._nodes.extend(accept_nodes(self.config))
        except RuntimeError as exc:
            self._failing.append(True)
            self.shutdown()
            raise WorkerDiedError(str(exc)) from None
        answering = answer_rank(self.config)
        if answering not in self.ranks:
            node = next(n for n in self._nodes if answering in n.ranks)
            self._answers = AnswerLink(node)  # type: ignore[assignment]

    def _spawn(self, worker_cls: str) -> None:
        ctx = mp.get_context("spawn")
        multinode = self.config.nnodes > 1
        if multinode:
            init_method = dist_init_method(self.config)
        else:  # served from here from before the spawn: no window in which another socket takes the port
            from engine_svc.distributed.parallel_state import serve_store

            self._store, init_method = serve_store()
        answering = answer_rank(self.config)
        answer_send: Connection | None = None
        self._answers: Connection | None = None  # None: the answer rank is on another node
        if answering in self.ranks:
            self._answers, answer_send = ctx.Pipe(duplex=False)
            self._conns.append(self._answers)
        self._status: list[Connection] = []
        for index, rank in enumerate(self.ranks):
            status_recv, status_send = ctx.Pipe(duplex=False)
            args = WorkerArgs(
                config=self.config,
                rank=rank,
                dist_init_method=init_method,
                commands=self._commands.reader_handle(index),
                responses=answer_send if rank == answering else None,
                status=status_send,
                parent_pid=os.getpid(),
                worker_cls=worker_cls,
            )
            proc = ctx.Process(target=worker_main, args=(args,), name=f"tandem-tp-worker-{rank}", daemon=True)
            proc.start()
            status_send.close()
            self._procs.append(proc)
            self._status.append(status_recv)
        self._conns.extend(self._status)
        if answer_send is not None:
            answer_send.close()
        self._commands.release_peer_ends()

    # ---- the Executor interface --------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        self._call(encode_command(Op.LOAD_MODEL))
        self._info = self._call_and_wait(decode_worker_info)  # type: ignore[assignment]
        assert self._info is not None
        return self._info.num_blocks

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """One broadcast carries both values to every rank (the shm queue is the collective)."""
        self._call(encode_command(Op.INIT_CACHE, CacheSpec(num_blocks, max_model_len)))
        self._call_and_wait(None)

    def submit(self, scheduler_output: SchedulerOutput) -> StepFuture:
        return self._submit(encode_command(Op.EXECUTE, scheduler_output), decode_runner_output)

    def describe_kv(self) -> bytes:
        """P/D: every rank's K/V shard (engine_svc/kv_transfer/shards.py), encoded; each rank keeps its own."""
        return cast(bytes, self._submit(encode_command(Op.KV_DESCRIBE), bytes).result())

    def read_kv_blocks(self, block_ids: list[int]) -> bytes:
        """P/D: the wire bytes of `block_ids`, gathered from every rank after the steps submitted before.
        Safe to call from any thread (the engine core keeps stepping meanwhile)."""
        return cast(bytes, self._submit(encode_command(Op.KV_READ, block_ids), bytes).result())

    def _submit(self, command: bytearray, decode: Callable[[bytes], Any]) -> AnswerFuture:
        future = AnswerFuture(self, decode)
        with self._answer_lock:
            self._call(command)
            self._owed.append(future)
        return future

    def _read_answer(self, waiting: AnswerFuture) -> None:
        """Read the oldest answer still owed into its future (unless `waiting`'s came meanwhile)."""
        with self._answer_lock:
            if waiting._output is not None:
                return
            head = self._owed[0]
            head._set(self._call_and_wait(head._decode))
            self._owed.popleft()

    def _answer_waiting(self, future: AnswerFuture) -> bool:
        """Whether `future` is next in line and its answer can be read without blocking (False while
        another thread reads an answer)."""
        if not self._answer_lock.acquire(blocking=False):
            return False
        try:
            return (bool(self._owed) and self._owed[0] is future and self._answers is not None
                    and self._answers.poll())
        finally:
            self._answer_lock.release()

    def check_health(self) -> None:
        """Raise WorkerDiedError if a worker is dead (cheap: one waitpid per worker) or after shutdown."""
        if not self._finalizer.alive:
            raise WorkerDiedError(self._failure or "the TP executor is shut down")
        if not self._all_alive():
            self._fail()

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    @property
    def shm_names(self) -> list[str]:
        """Names of this executor's /dev/shm segments (for diagnostics and leak checks)."""
        return [self._commands.spec.shm_name]

    # ---- plumbing ----------------------------------------------------------------------------------
    def _all_alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _call(self, message: bytes | bytearray) -> None:
        self.check_health()
        try:
            for node in self._nodes:  # other nodes first: their relay re-broadcasts while ours read
                node.send_command(message)
            self._commands.enqueue(message, is_alive=self._all_alive)
        except (PeerDiedError, BrokenPipeError, LinkClosed):
            self._fail()

    def _call_and_wait(self, decode: Callable[[bytes], Any] | None) -> object:
        """Block until the answer rank answers (returned, decoded) or any worker or node dies
        (WorkerDiedError). A headless node's link only carries answers when it holds the answer rank;
        anything else on it (a failure report, the link closing) fails the engine."""
        assert self._answers is not None, "a headless node's executor relays; it is never asked to answer"
        others = [n for n in self._nodes if not (isinstance(self._answers, AnswerLink) and self._answers.node is n)]
        ready = wait([self._answers, *(p.sentinel for p in self._procs), *others])
        for node in others:
            if node in ready:
                with contextlib.suppress(LinkClosed):
                    node.read()
                node.failure = node.failure or f"node {node.node_rank} sent an unexpected frame"
                self._fail()
        if self._answers in ready:
            try:
                data = self._answers.recv_bytes()
            except (EOFError, OSError):
                self._fail()
            return decode(data) if decode is not None else data
        self._fail()

    def _fail(self) -> NoReturn:
        """Find out which workers died and why, shut everything down, raise WorkerDiedError.

        Thread-safe: the busy loop and a health check may both notice the death; one reports it."""
        with self._fail_lock:
            if self._failure is None and self._finalizer.alive:
                dead = self._collect_deaths()
                self._failing.append(True)
                self.shutdown()
                reasons = []
                for index in sorted(dead, key=lambda r: dead[r][0]):  # in the order they died
                    proc, message = self._procs[index], dead[index][1]
                    reasons.append(
                        f"rank {self.ranks[index]} (pid {proc.pid}) exited with code {proc.exitcode}"
                        + (f": {message}" if message else "")
                    )
                reasons += [n.failure for n in self._nodes if n.failure]
                self._failure = "TP worker died: " + ("; ".join(reasons) or "unknown")
                logger.error("%s", self._failure)
        raise WorkerDiedError(self._failure or "the TP executor is shut down")

    def _collect_deaths(
        self, first_wait_s: float = 1.0, grace_s: float = 0.2
    ) -> dict[int, tuple[float, str]]:
        """local index -> (when its death was seen, its traceback or ""), for this node's ranks whose status pipe reports
        a failure or closes (the process is gone) within `first_wait_s`, plus `grace_s` after the first
        (a peer failing in a collective a moment later is reported too, after the root cause)."""
        pending = {conn: rank for rank, conn in enumerate(self._status)}
        dead: dict[int, tuple[float, str]] = {}
        deadline = time.monotonic() + first_wait_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for ready in wait(list(pending), timeout=left):
                conn = cast(Connection, ready)
                rank = pending.pop(conn)
                try:
                    message = str(conn.recv())
                except (EOFError, OSError):
                    message = ""
                dead[rank] = (time.monotonic(), message)
            if dead:
                deadline = min(deadline, min(t for t, _ in dead.values()) + grace_s)
        return dead


def _check_devices(config: EngineConfig) -> None:
    if config.device != "cuda":
        return
    import torch

    available = torch.cuda.device_count()
    world = config.world_size // config.nnodes  # the ranks on this node
    if available < world:
        raise ConfigError(
            f"--tensor-parallel-size {config.tensor_parallel_size} x --pipeline-parallel-size "
            f"{config.pipeline_parallel_size} needs {world} GPUs, but only {available} are visible; "
            "lower them or use --device cpu"
        )


def _teardown(procs: list[BaseProcess], conns: list[Connection], commands: ShmBroadcastQueue,
              nodes: list[RemoteNode], failing: list[bool]) -> None:
    """Stop the workers (politely, then SIGTERM, then SIGKILL) and unlink the shared memory; tell
    headless nodes to shut down (unless the executor is failing: then their links just close, and they
    exit non-zero) and close their links.

    Holds no reference to the executor so it can run as its weakref finalizer.
    """
    for node in nodes:
        if not failing:
            with contextlib.suppress(LinkClosed):
                node.send_command(encode_command(Op.SHUTDOWN))
        node.close()
    if procs and all(p.is_alive() for p in procs):
        try:
            commands.enqueue(
                encode_command(Op.SHUTDOWN), timeout=0.5, is_alive=lambda: all(p.is_alive() for p in procs)
            )
            for proc in procs:
                proc.join(_JOIN_TIMEOUT_S)
        except (TimeoutError, PeerDiedError, OSError, ValueError, TypeError):
            pass  # a worker is stuck or the queue is already closed: stop them below
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(_JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    commands.close()


def _shutdown_live_executors() -> None:
    for executor in list(_live_executors):
        executor.shutdown()


def _install_sigterm_cleanup() -> None:
    """On SIGTERM, shut every live executor down, then behave as the previous handler would."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        _shutdown_live_executors()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    _sigterm_installed = True
