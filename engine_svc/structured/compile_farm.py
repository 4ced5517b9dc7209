"""Grammar compiles in processes of their own, which the engine can pause and kill.

A compile cannot be cancelled inside xgrammar, its cost is not linear in the constraint (a small schema
can take minutes and gigabytes), and a thread running one holds its slot until it ends: two slow
constraints used to make every other client's constraint wait past its deadline. Here each compile runs
in a worker process (compile_worker.py) and the farm schedules them (all decisions on one supervisor
thread, every `TICK_S` or when something changes):

- Deadline: a compile still queued, running or paused at its deadline fails ("did not compile within
  ...") and its process is killed; so does one whose every waiter left (its future cancelled).
- Memory: a running process whose resident memory exceeds `memory_bytes` is killed and its compile fails.
- Fairness (least attained service): at most `workers` compiles run at once. When a compile is queued and
  every running one has run longer than `patience_s`, the one that has run longest is paused (SIGSTOP)
  and the queued one starts in another process: a fresh or cheap compile never waits behind long ones.
  Paused compiles resume, least run first, when a running slot is free and nothing is queued. At most
  `max_paused` are paused; past that, queued compiles wait their turn (until their deadline).

So at most `workers + max_paused` processes exist, each under `memory_bytes`, and at most `workers` of
them use a CPU. Processes start when a compile needs one (one at a time: a start imports xgrammar and
torch, seconds of CPU) and up to `workers` idle ones are kept for the next compiles; a long compile is
paused only once a process is ready for the fresh one. A compiled
grammar comes back serialized and is rebuilt in the engine on the process's reader thread (xgrammar
releases the GIL for most of that), never on the busy loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from engine_svc.structured.compile_worker import (
    COMPILE,
    ERROR,
    GRAMMAR,
    READY,
    SETUP,
    read_frame,
    write_frame,
)
from engine_svc.structured.constraint import Key

logger = logging.getLogger(__name__)

TICK_S = 0.05
DEFAULT_MEMORY_BYTES = 3 * 2**30  # resident memory of one compile process (its idle size is ~0.4 GiB)


class CompileFailed(ValueError):
    """A compile the farm ended (deadline, memory) or that did not compile; the message is the reason."""


@dataclasses.dataclass(eq=False)
class _Job:
    key: Key
    future: Future[Any]
    deadline: float
    submitted: float
    attained: float = 0.0  # seconds it has run (not counting pauses)
    running_since: float | None = None  # set while running
    worker: _Worker | None = None  # set while running or paused

    def run_time(self, now: float) -> float:
        return self.attained + (now - self.running_since if self.running_since is not None else 0.0)


class _Worker:
    """One compile process and the thread that talks to it."""

    def __init__(self, farm: CompileFarm) -> None:
        self.farm = farm
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-m", "engine_svc.structured.compile_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.ready = False
        self.job: _Job | None = None  # assigned by the supervisor, under the farm's lock
        self.paused = False
        self._assigned = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"grammar-compile-{self.proc.pid}", daemon=True)
        self._thread.start()

    def assign(self, job: _Job) -> None:
        self.job = job
        self._assigned.set()

    def resident_bytes(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/statm", "rb") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def _run(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        inp, out = self.proc.stdout, self.proc.stdin
        try:
            write_frame(out, SETUP, json.dumps({"tokenizer_info": self.farm.tokenizer_info()}).encode())
            frame = read_frame(inp)
            if frame is None or frame[0] != READY:
                raise CompileFailed("the grammar compile process did not start")
            self.farm._ready(self)
            while True:
                self._assigned.wait()
                self._assigned.clear()
                job = self.job
                assert job is not None
                write_frame(out, COMPILE, json.dumps(list(job.key)).encode())
                frame = read_frame(inp)
                if frame is None:
                    raise CompileFailed("the grammar compile process ended")
                tag, payload = frame
                if tag == GRAMMAR:
                    self.farm._finished(self, job, grammar=self.farm.load(payload.decode()))
                elif tag == ERROR:
                    self.farm._finished(self, job, error=payload.decode())
                else:
                    raise CompileFailed(f"unexpected frame {tag!r} from the grammar compile process")
        except (OSError, ValueError) as exc:  # a killed process: the supervisor already failed its job
            self.farm._lost(self, str(exc))
        finally:
            self.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):  # a write still buffered to a dead process
                    pipe.close()


class CompileFarm:
    """Compiles `Key`s in worker processes; `submit` returns a Future the farm completes (never started:
    cancelling it at any time stops the compile)."""

    def __init__(self, tokenizer_info: Callable[[], str], load: Callable[[str], Any], *, workers: int = 2,
                 max_paused: int = 2, patience_s: float = 1.0, memory_bytes: int = DEFAULT_MEMORY_BYTES) -> None:
        """`tokenizer_info()`: xgrammar's serialized vocabulary (called on a worker's thread, once per
        process); `load(text)`: a serialized compiled grammar -> the engine's object."""
        self.tokenizer_info = tokenizer_info
        self.load = load
        self.workers, self.max_paused, self.patience_s = workers, max_paused, patience_s
        self.memory_bytes = memory_bytes
        self.spawned = 0  # processes started, ever
        self.killed = 0  # processes killed for a deadline, a cancel or memory
        self._lock = threading.Condition()
        self._queue: list[_Job] = []  # FIFO
        self._running: list[_Job] = []
        self._paused: list[_Job] = []
        self._idle: list[_Worker] = []  # ready, holding no job
        self._starting: list[_Worker] = []  # not ready yet
        self._min_alive = 0  # processes kept started whether compiles need them or not (`warm`)
        self._closed = False
        self._supervisor = threading.Thread(target=self._supervise, name="grammar-compile-farm", daemon=True)
        self._supervisor.start()

    def submit(self, key: Key, deadline: float) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            self._queue.append(_Job(key, future, deadline, time.monotonic()))
            self._lock.notify()
        future.add_done_callback(lambda _: self._poke())
        return future

    def warm(self, processes: int) -> None:
        """Start processes (one at a time) until `processes` exist, so that the next compiles need not wait
        for a start (at most `workers + max_paused`)."""
        with self._lock:
            self._min_alive = min(processes, self.workers + self.max_paused)
            self._lock.notify()

    def counts(self) -> dict[str, int]:
        """Compiles queued / running / paused, and processes alive (for tests and metrics)."""
        with self._lock:
            alive = len(self._idle) + len(self._starting) + len(self._running) + len(self._paused)
            return {"queued": len(self._queue), "running": len(self._running), "paused": len(self._paused),
                    "processes": alive}

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            jobs = self._queue + self._running + self._paused
            workers = self._idle + self._starting + [j.worker for j in self._running + self._paused if j.worker]
            self._queue, self._running, self._paused, self._idle, self._starting = [], [], [], [], []
            self._lock.notify()
        for job in jobs:
            _fail(job, "the engine is shutting down")
        for worker in workers:
            worker.kill()

    # ---- called by the workers' threads -------------------------------------------------------------
    def _ready(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._starting:
                self._starting.remove(worker)
                if self._closed:
                    worker.kill()
                else:
                    self._idle.append(worker)
            self._lock.notify()

    def _finished(self, worker: _Worker, job: _Job, grammar: Any = None, error: str | None = None) -> None:
        with self._lock:
            if job in self._running:
                self._running.remove(job)
                worker.job = None
                self._idle.append(worker)
            self._lock.notify()
        if error is not None:
            _fail(job, error)
        elif not job.future.done():
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                job.future.set_result(grammar)

    def _lost(self, worker: _Worker, why: str) -> None:
        """A process ended on its own (killed processes end here too: their jobs were settled already). One
        that never became ready fails the queued compiles, which would otherwise start process after
        process until their deadline."""
        with self._lock:
            failed = []
            if worker in self._starting:
                self._starting.remove(worker)
                failed, self._queue = self._queue, []
            if worker in self._idle:
                self._idle.remove(worker)
            job = worker.job
            if job is not None:
                for pool in (self._running, self._paused):
                    if job in pool:
                        pool.remove(job)
                failed.append(job)
            self._lock.notify()
        for lost in failed:
            _fail(lost, f"the grammar compile process failed ({why})")
        if failed:
            logger.warning("a grammar compile process ended: %s", why)

    # ---- the supervisor ---------------------------------------------------------------------------------
    def _poke(self) -> None:
        with self._lock:
            self._lock.notify()

    def _supervise(self) -> None:
        """Futures are completed outside the lock: their callbacks take the compilers' lock, which is held
        while a future is cancelled (whose callback takes this one)."""
        while True:
            with self._lock:
                self._lock.wait(TICK_S)
                if self._closed:
                    return
                now = time.monotonic()
                ended = self._end_overdue(now)
                self._schedule(now)
            for job, why in ended:
                _fail(job, why)

    def _end_overdue(self, now: float) -> list[tuple[_Job, str]]:
        """Stop what is past its deadline, cancelled, or (running) over the memory bound; returns the
        jobs to fail, and why."""
        ended: list[tuple[_Job, str]] = []
        for pool in (self._queue, self._running, self._paused):
            for job in list(pool):
                if job.future.cancelled():
                    why = None
                elif now >= job.deadline:
                    why = f"the constraint did not compile within {job.deadline - job.submitted:.3g} s"
                elif pool is self._running and job.worker is not None and \
                        job.worker.resident_bytes() > self.memory_bytes:
                    why = f"compiling the constraint needed more than {self.memory_bytes // 2**20} MiB"
                else:
                    continue
                pool.remove(job)
                if job.worker is not None:
                    job.worker.job = None
                    job.worker.kill()
                    self.killed += 1
                if why is not None:
                    ended.append((job, why))
        return ended

    def _schedule(self, now: float) -> None:
        while self._queue:
            if len(self._running) < self.workers:
                if not self._idle:
                    self._start_process()  # the job waits queued until it is ready
                    break
                self._start(self._queue.pop(0), self._idle.pop(), now)
                continue
            longest = max(self._running, key=lambda j: j.run_time(now))
            if longest.run_time(now) <= self.patience_s or len(self._paused) >= self.max_paused:
                break
            if not self._idle:
                self._start_process()  # pause the long one once a process is ready for the fresh one
                break
            self._pause(longest, now)
            self._start(self._queue.pop(0), self._idle.pop(), now)
        while not self._queue and self._paused and len(self._running) < self.workers:
            self._resume(min(self._paused, key=lambda j: j.attained), now)
        while len(self._idle) > max(self.workers, self._min_alive):
            self._idle.pop().kill()
        if len(self._running) + len(self._paused) + len(self._idle) + len(self._starting) < self._min_alive:
            self._start_process()

    def _start_process(self) -> None:
        """One more process, unless one is starting (starts compete for the CPUs; a compile that needs a
        process takes the first one ready) or `workers + max_paused` exist."""
        alive = len(self._running) + len(self._paused) + len(self._idle) + len(self._starting)
        if not self._starting and alive < self.workers + self.max_paused:
            self.spawned += 1
            self._starting.append(_Worker(self))

    def _start(self, job: _Job, worker: _Worker, now: float) -> None:
        job.worker, job.running_since = worker, now
        self._running.append(job)
        worker.assign(job)

    def _pause(self, job: _Job, now: float) -> None:
        assert job.worker is not None and job.running_since is not None
        job.worker.signal(signal.SIGSTOP)
        job.attained += now - job.running_since
        job.running_since = None
        self._running.remove(job)
        self._paused.append(job)

    def _resume(self, job: _Job, now: float) -> None:
        assert job.worker is not None
        job.worker.signal(signal.SIGCONT)
        job.running_since = now
        self._paused.remove(job)
        self._running.append(job)


def _fail(job: _Job, why: str) -> None:
    if not job.future.done():
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            job.future.set_exception(CompileFailed(why))
