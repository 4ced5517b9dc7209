"""A worker's side of adapters loaded and unloaded at run time (engine_svc/lora/registry.py).

`RuntimeLoads(manager)`: `step(loads, drops, idle)` runs on the step's thread at the start of every step
that carries loads or drops, or while a read is pending. Drops first (a drop of an id still being read
cancels that read), then each load goes to the background reader (engine_svc/lora/reader.py); finished
reads are installed into the manager's host copies; then the ranks agree which pending ids every rank
has finished (one small all-reduce over all ranks, only at steps while a read is pending). The answer,
`LoRANews(ready, failed)`, travels in the step's output to the scheduler, which schedules no request of
an id before it is ready (engine_svc/sched/scheduler.py) and ends those of a failed one.

Invariants:
- Every rank sees the same loads and drops at the same steps (the SchedulerOutputs), so `pending` is the
  same list on every rank and the agreement's collective runs at the same steps everywhere.
- An announced id is reported exactly once, ready (every rank holds it) or failed (every rank's read
  ended, one failed), unless a drop cancels it first; then never.
- The step waits for a read only when it runs nothing (`idle`, a step polled for the news), and then at
  most IDLE_WAIT_S: a step that runs requests never waits for a read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine_svc.lora.manager import LoRAManager
from engine_svc.lora.reader import AdapterReader
from engine_svc.sched.output import LoRALoad

IDLE_WAIT_S = 0.025  # a step with nothing to run waits this long at most for a read to finish
_PENDING, _READY, _FAILED = 0, 1, 2


@dataclass
class LoRANews:
    ready: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)


class RuntimeLoads:
    def __init__(self, manager: LoRAManager) -> None:
        self.manager = manager
        self.reader = AdapterReader(manager)
        self.pending: list[int] = []  # announced, not yet agreed on, in announcement order
        self._failed: dict[int, str] = {}  # pending ids whose read failed on this rank

    def step(self, loads: Sequence[LoRALoad], drops: Sequence[int], idle: bool) -> LoRANews:
        """Apply a step's drops and loads and report the ids every rank has now finished (see the module
        docstring)."""
        for lora_id in drops:
            if lora_id in self.pending:
                self.pending.remove(lora_id)
                self._failed.pop(lora_id, None)
                self.reader.cancel(lora_id)
            self.manager.remove(lora_id)
        for load in loads:
            self.pending.append(load.lora_id)
            self.reader.submit(load)
        if not self.pending:
            return LoRANews()
        if idle and self.reading:
            self.reader.wait(IDLE_WAIT_S)
        for result in self.reader.take():
            if result.lora_id not in self.pending:
                continue
            if result.layout is None:
                self._failed[result.lora_id] = result.error
            else:
                self.manager.install(result.lora_id, result.layout)
        states = [_FAILED if i in self._failed else _READY if i in self.manager.host else _PENDING
                  for i in self.pending]
        news = LoRANews()
        for lora_id, state in zip(list(self.pending), agree(states), strict=True):
            if state == _PENDING:
                continue
            self.pending.remove(lora_id)
            if state == _READY:
                news.ready.append(lora_id)
            else:
                news.failed[lora_id] = self._failed.pop(lora_id, "") or "the read failed on another rank"
        return news

    @property
    def reading(self) -> bool:
        """Whether this rank's reader still has a pending id to finish (as of the last `step`)."""
        return not all(i in self._failed or i in self.manager.host for i in self.pending)

    def close(self) -> None:
        self.reader.close()


def agree(states: list[int]) -> list[int]:
    """Per id, over every rank: PENDING while any rank still reads it, else FAILED if any rank failed,
    else READY. One all-reduce (max) over all ranks; the local states when there is one rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return states
    n = len(states)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor([int(s == _PENDING) for s in states] + [int(s == _FAILED) for s in states],
                         dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.tolist()
    return [_PENDING if values[i] else _FAILED if values[n + i] else _READY for i in range(n)]
