"""Adapters loaded at run time, read on one background thread of a worker, off the step loop.

`AdapterReader(manager)` reads each submitted `LoRALoad`, in order, on its own thread: the PEFT files,
their validation and this rank's layout (`LoRAManager.load`, `lay_out`); `take()`, called by the step's
thread between two steps, hands over what finished. The reader never touches the manager's state: the
step's thread installs what it takes (engine_svc/lora/runtime_loads.py).

What it costs the step beside it is kept small:
- its thread runs torch ops with one intra-op thread (under OpenMP the count is per OS thread: the step's
  team keeps its size; hundreds of tiny tensors gain nothing from a team);
- between two tensors it validates and two targets it lays out it lets the GIL go (`time.sleep(0)`), so
  the step's thread, which takes the GIL back after every torch op, waits for a few small ops at most;
- on CUDA it copies on its own stream and waits for that stream before handing the layout over, so the
  step's stream reads finished tensors when it copies them into a slot.

Invariants: every submitted id gets exactly one result (the layout, or the error that stopped its read),
unless `cancel` came first: then none. `close()` ends the thread (a read in progress is abandoned).
Test hook: with `TANDEM_TEST_LORA_READ_GATE` set to a path, each read starts only once that file exists
(a read made slow on purpose, tests/engine/test_lora_runtime_async.py); `{rank}` in it is replaced by
the worker's global rank.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_svc.sched.output import LoRALoad

if TYPE_CHECKING:
    from engine_svc.lora.manager import HostLayout, LoRAManager

GATE_ENV = "TANDEM_TEST_LORA_READ_GATE"


@dataclass(frozen=True)
class ReadResult:
    lora_id: int
    layout: HostLayout | None  # None: the read failed
    error: str = ""


class AdapterReader:
    def __init__(self, manager: LoRAManager) -> None:
        self._manager = manager
        self._todo: queue.SimpleQueue[LoRALoad | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._done: list[ReadResult] = []
        self._cancelled: set[int] = set()
        self._finished = threading.Event()  # set while `_done` holds a result
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None  # started by the first submit

    def submit(self, load: LoRALoad) -> None:
        """Read `load` after the reads submitted before it."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="tandem-lora-reader", daemon=True)
            self._thread.start()
        self._todo.put(load)

    def cancel(self, lora_id: int) -> None:
        """Forget `lora_id`: its read is skipped if not started, its result dropped if it comes."""
        with self._lock:
            self._cancelled.add(lora_id)
            self._done = [r for r in self._done if r.lora_id != lora_id]

    def wait(self, timeout: float) -> bool:
        """Block until a result is ready to take, or `timeout` seconds; whether one is."""
        return self._finished.wait(timeout)

    def take(self) -> list[ReadResult]:
        """The results finished since the last call, in submission order."""
        with self._lock:
            done, self._done = self._done, []
            self._finished.clear()
        return done

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    # ---- the reader's thread --------------------------------------------------------------------------
    def _main(self) -> None:
        torch.set_num_threads(1)  # this thread's OpenMP team only (per thread); the step's keeps its size
        device = self._manager.device
        stream = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        while True:
            load = self._todo.get()
            if load is None or self._closed.is_set():
                return
            with self._lock:
                if load.lora_id in self._cancelled:
                    continue
            if not _gate_open(self._closed):
                return
            result = self._read(load, stream)
            with self._lock:
                if load.lora_id not in self._cancelled:
                    self._done.append(result)
                    self._finished.set()

    def _read(self, load: LoRALoad, stream: torch.cuda.Stream | None) -> ReadResult:
        try:
            adapter = self._manager.load(load.name, load.path, pause=_yield_gil)
            if stream is None:
                return ReadResult(load.lora_id, self._manager.lay_out(adapter, pause=_yield_gil))
            with torch.cuda.stream(stream):
                layout = self._manager.lay_out(adapter, pause=_yield_gil)
            stream.synchronize()
            return ReadResult(load.lora_id, layout)
        except Exception as exc:  # a file changed since it was validated, memory, ...: a failed read
            return ReadResult(load.lora_id, None, str(exc) or type(exc).__name__)


def _yield_gil() -> None:
    time.sleep(0)


def _gate_open(closed: threading.Event) -> bool:
    """The test hook (module docstring): wait for the gate file; False if the reader closed meanwhile."""
    gate = os.environ.get(GATE_ENV, "")
    if "{rank}" in gate:
        import torch.distributed as dist

        gate = gate.replace("{rank}", str(dist.get_rank() if dist.is_initialized() else 0))
    while gate and not os.path.exists(gate):
        if closed.wait(0.005):
            return False
    return True
