"""How many distinct LoRA adapters one step may hold (--max-loras), applied when admitting requests.

The running requests' adapters are in the step already (admission never let them exceed the budget, and
preemption only removes). A waiting request whose adapter is running, or that fits in a free adapter
place, is admitted; one that does not fit waits at its place in line. Once one has waited in a step,
every later adapter request waits too (base-model requests still go): the running adapters then drain,
and the adapter first in line gets the next free place, so no adapter starves behind a busy one.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine_svc.request import Request


class LoRABudget:
    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self.active: set[int] = set()
        self._blocked = False

    def begin_step(self, running: Iterable[Request]) -> None:
        """Start admitting for a step whose running requests are `running`."""
        self.active = {r.lora_id for r in running if r.lora_id}
        self._blocked = False

    def admits(self, request: Request) -> bool:
        """Whether `request` may join this step (call `admitted` when it does)."""
        lora_id = request.lora_id
        if not lora_id:
            return True
        if not self._blocked and (lora_id in self.active or len(self.active) < self.max_loras):
            return True
        self._blocked = True
        return False

    def admitted(self, request: Request) -> None:
        if request.lora_id:
            self.active.add(request.lora_id)


def adapter_counts(requests: Iterable[Request]) -> dict[str, int]:
    """Requests per LoRA adapter name (base-model requests left out): vLLM's running_lora_adapters /
    waiting_lora_adapters of its SchedulerStats."""
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_name:
            counts[request.lora_name] = counts.get(request.lora_name, 0) + 1
    return counts
