"""The adapters an engine serves, by name, as they change at run time (vLLM's load / unload).

`LoRARegistry` owns the scheduler's name -> id map (it edits it in place) and tells the workers what
changed through the steps themselves: `attach(so)` puts the loads not sent yet and the drops due on the
SchedulerOutput about to be submitted, so every rank sees them in step order. A worker reads a load in
the background (engine_svc/lora/runtime_loads.py); until every rank holds it, its id is in the
scheduler's `lora_not_ready` (added here, taken out by the step outputs that say it is ready), and its
requests wait there without holding up others. A read that fails (`failed(id)`) takes the name away as
an unload does; the scheduler ends the requests that named it.

Invariants:
- Ids: 1..n for --lora-modules in order, then n+1, n+2, ... for each later load; never reused. A request
  keeps the id it was admitted under (Request.lora_id), so it always runs under the weights it was
  admitted with.
- Every served name has a content fingerprint (engine_svc/lora/fingerprint.py) in the scheduler's
  `lora_fingerprints` (edited in place beside the ids), which keys its requests' prefix-cache blocks: KV
  is shared only between adapters with the same files, never with other weights under the same name.
- `remove(name)` (unload; also what `add(..., replace=True)` does to the old id) takes the name away at
  once: a new request naming it is refused. Requests admitted before keep going and end normally; the
  workers drop the old id's host copy only once no request the scheduler holds uses it.
- At most `max_cpu_loras` ids are held on the host, those retired but still in use included: a load
  past that is refused (`LoRARegistryError`, kind "capacity") and changes nothing.
- Every method runs on the thread that drives the engine core (the busy loop).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine_svc.lora.fingerprint import adapter_fingerprint
from engine_svc.sched.output import LoRALoad, SchedulerOutput


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    lora_id: int
    path: str
    fingerprint: str = ""


class LoRARegistryError(ValueError):
    """A load or unload the registry refuses; `kind` is "exists", "not_found" or "capacity"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class LoRARegistry:
    def __init__(self, lora_ids: dict[str, int], modules: Iterable[tuple[str, str]], max_cpu_loras: int,
                 ids_in_use: Callable[[], set[int]], fingerprints: dict[str, str] | None = None,
                 not_ready: set[int] | None = None) -> None:
        """`lora_ids`: the scheduler's name -> id map, already holding `modules` (--lora-modules, ids
        1, 2, ...); `ids_in_use()`: the adapter ids of the requests the scheduler holds now;
        `fingerprints`: the scheduler's name -> fingerprint map, filled here for `modules` (read at start);
        `not_ready`: the scheduler's ids not every worker holds yet (edited in place)."""
        self._ids = lora_ids
        self._paths = {name: path for name, path in modules}
        self._fingerprints = fingerprints if fingerprints is not None else {}
        for name, path in self._paths.items():
            self._fingerprints[name] = adapter_fingerprint(path)
        self.max_cpu_loras = max_cpu_loras
        self._ids_in_use = ids_in_use
        self._not_ready = not_ready if not_ready is not None else set()
        self.on_change: Callable[[], None] | None = None  # called when a failed read takes a name away
        self._next_id = max(lora_ids.values(), default=0) + 1
        self._held: set[int] = set(lora_ids.values())  # on the workers' host now or after the next step
        self._retired: set[int] = set()  # held, no longer named, maybe still used by a request
        self._loads: list[LoRALoad] = []  # not sent to the workers yet
        self._drops: list[int] = []  # not sent to the workers yet

    def served(self) -> list[ServedAdapter]:
        """The adapters a request may name now, in id order (a snapshot: other threads may call it)."""
        ids, paths, prints = list(self._ids.items()), dict(self._paths), dict(self._fingerprints)
        return [ServedAdapter(name, i, paths.get(name, ""), prints.get(name, ""))
                for name, i in sorted(ids, key=lambda item: item[1])]

    def add(self, name: str, path: str, *, replace: bool = False, fingerprint: str | None = None) -> ServedAdapter:
        """Serve the (already validated) adapter at `path` as `name`, under a new id. With `replace` an
        adapter of that name is swapped for it (vLLM's load_inplace): requests admitted before keep the old
        weights. `fingerprint`: its `adapter_fingerprint`, computed by the caller off the step loop (read
        here when not given). Raises LoRARegistryError."""
        if name in self._ids and not replace:
            raise LoRARegistryError("exists", f"The lora adapter '{name}' has already been loaded. If you want "
                                              "to load the adapter in place, set 'load_inplace' to True.")
        self._release_unused()
        old = self._ids.get(name)  # replaced: its place is free unless a request still uses it
        freed = old is not None and old not in self._ids_in_use()
        if len(self._held) - freed >= self.max_cpu_loras:
            in_use = len(self._retired)
            raise LoRARegistryError("capacity", f"cannot load LoRA adapter '{name}': the engine holds "
                                    f"--max-cpu-loras ({self.max_cpu_loras}) adapters already"
                                    + (f" ({in_use} unloaded but still used by requests in flight)" if in_use
                                       else "") + "; unload one first, or start the engine with a larger "
                                    "--max-cpu-loras")
        if old is not None:
            self._retire(name)
            self._release_unused()
        lora_id = self._next_id
        self._next_id += 1
        self._ids[name] = lora_id
        self._paths[name] = path
        self._fingerprints[name] = fingerprint if fingerprint is not None else adapter_fingerprint(path)
        self._held.add(lora_id)
        self._not_ready.add(lora_id)
        self._loads.append(LoRALoad(lora_id, name, path))
        return ServedAdapter(name, lora_id, path, self._fingerprints[name])

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving `name` (see the module docstring for the requests that use it). Raises
        LoRARegistryError ("not_found")."""
        if name not in self._ids:
            raise LoRARegistryError("not_found", f"The lora adapter '{name}' cannot be found.")
        served = ServedAdapter(name, self._ids[name], self._paths[name], self._fingerprints.get(name, ""))
        self._retire(name)
        self._release_unused()
        return served

    def failed(self, lora_id: int) -> None:
        """The workers could not read `lora_id`: its name (if it still names it) is no longer served; the
        workers forget whatever they hold of it once no request uses it (the scheduler ends those)."""
        self._not_ready.discard(lora_id)
        names = [name for name, i in self._ids.items() if i == lora_id]
        for name in names:
            self._retire(name)
        self._release_unused()
        if names and self.on_change is not None:
            self.on_change()

    def attach(self, so: SchedulerOutput) -> None:
        """Put the pending loads and the drops now due on `so`, which is about to be submitted."""
        self._release_unused()
        if self._loads:
            so.lora_loads, self._loads = self._loads, []
        if self._drops:
            so.lora_drops, self._drops = self._drops, []

    def _retire(self, name: str) -> None:
        self._retired.add(self._ids.pop(name))
        del self._paths[name]
        self._fingerprints.pop(name, None)

    def _release_unused(self) -> None:
        """Retired ids no request uses any more leave the host (a load never sent is simply not sent)."""
        if not self._retired:
            return
        unused = self._retired - self._ids_in_use()
        for lora_id in unused:
            self._retired.discard(lora_id)
            self._held.discard(lora_id)
            self._not_ready.discard(lora_id)
            pending = [load for load in self._loads if load.lora_id != lora_id]
            if len(pending) == len(self._loads):
                self._drops.append(lora_id)
            self._loads = pending
