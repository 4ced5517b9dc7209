"""Adapters of one worker: attached slots, host copies, and which adapter sits in which device slot.

`LoRAManager(model, max_loras, max_lora_rank)` gives each decoder layer's qkv_proj, o_proj and (dense MLP
layers) gate_up_proj and down_proj a `LoRASlots` (their `lora` hook, linear.py). `add(id, adapter)` lays
a validated PEFT adapter out for this TP rank, in the slots' layout, on the host. `prepare(token_ids)`,
once per step before the forward, puts every adapter the step uses into a device slot (the least
recently used slot whose adapter the step does not use is taken; at most max_loras adapters per step,
which the scheduler guarantees) and sets the step's token -> slot selection. Every rank makes the same
choices from the same inputs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine_svc.lora.cpu_native import native_for
from engine_svc.lora.peft_dir import PeftAdapter, module_shapes
from engine_svc.lora.slots import LoRASlots, StepLoRA, kernels_wanted
from engine_svc.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _TPLinear,
)

# fused layer attribute path -> the PEFT modules in it and each one's shard id for the layer's weight_loader
_TARGETS: dict[tuple[str, str], tuple[tuple[str, Any], ...]] = {
    ("self_attn", "qkv_proj"): (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    ("self_attn", "o_proj"): (("o_proj", None),),
    ("mlp", "gate_up_proj"): (("gate_proj", 0), ("up_proj", 1)),
    ("mlp", "down_proj"): (("down_proj", None),),
}


@dataclass
class _Target:
    layer: int
    linear: _TPLinear
    modules: tuple[tuple[str, Any], ...]
    slots: LoRASlots


HostLayout = list[tuple[torch.Tensor, torch.Tensor] | None]  # per target: (a [W, in], b [W, out]) or None


class LoRAManager:
    def __init__(self, model: torch.nn.Module, *, max_loras: int, max_lora_rank: int,
                 device: torch.device, dtype: torch.dtype, max_num_tokens: int = 0,
                 kernels: bool | None = None, native: bool | None = None) -> None:
        """`max_num_tokens`: the most tokens one step holds (the kernels' mapping capacity); `kernels`:
        the Triton shrink/expand (default: on CUDA when Triton is installed, `kernels_wanted`); `native`:
        the native CPU op for short steps where the kernels do not serve (default: on CPU when it is built,
        `cpu_native.native_for`; False: the torch layouts only)."""
        self.max_loras, self.rank = max_loras, max_lora_rank
        self.device, self.dtype = device, dtype
        use_kernels = kernels_wanted(device) if kernels is None else kernels
        self.step = (StepLoRA(kernels=True, slots=max_loras, capacity=max_num_tokens, device=device)
                     if use_kernels else StepLoRA(native=None if native is False else native_for(device, dtype)))
        self.targets = self._attach(model)
        self.num_layers = len(model.model.layers)  # type: ignore[union-attr, arg-type]
        present = {m for t in self.targets for m, _ in t.modules}
        self.shapes = {m: s for m, s in module_shapes(model.config).items()
                       if m in present}
        self.host: dict[int, HostLayout] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # resident adapter id -> slot, LRU first
        self._slot_table = np.full(1, -1, dtype=np.int64)  # adapter id -> its slot (-1: none / base)

    def _attach(self, model: torch.nn.Module) -> list[_Target]:
        targets = []
        for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
            for (block_name, linear_name), modules in _TARGETS.items():
                linear = getattr(getattr(layer, block_name), linear_name, None)
                if not isinstance(linear, _TPLinear):
                    continue  # e.g. a mixture-of-experts feed-forward block: no dense MLP to adapt
                slots = LoRASlots(self.step, self.max_loras, self.rank, linear.in_features, _sub_sizes(linear),
                                  self.dtype, self.device)
                linear.lora = slots
                targets.append(_Target(i, linear, modules, slots))
        return targets

    @property
    def graph_safe(self) -> bool:
        """Whether a CUDA graph may capture the LoRA layers: with the kernels every step launches the same
        work, reading the token mapping and the slot weights from buffers whose addresses never change."""
        return self.step.kernels

    # ---- host side ----------------------------------------------------------------------------------
    def add(self, lora_id: int, adapter: PeftAdapter) -> None:
        """Keep `adapter` (validated against this model) on the host under `lora_id` (>= 1)."""
        self.install(lora_id, self.lay_out(adapter))

    def lay_out(self, adapter: PeftAdapter, pause: Callable[[], None] | None = None) -> HostLayout:
        """This rank's layout of `adapter` for every target (what `install` keeps), calling `pause` after
        each target. Touches no state of the manager: the run-time reader (engine_svc/lora/reader.py)
        calls it on its own thread."""
        layout = []
        for target in self.targets:
            layout.append(self._lay_out(target, adapter))
            if pause is not None:
                pause()
        return layout

    def install(self, lora_id: int, layout: HostLayout) -> None:
        """Keep a `lay_out` result under `lora_id` (>= 1); on the step's thread, between two steps. On CUDA
        a layout made on another stream (the reader's) is marked as used by this one, so its memory is not
        handed back to that stream while a copy into a slot may still read it."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            for pair in layout:
                for t in pair or ():
                    t.record_stream(stream)
        self.host[lora_id] = layout
        if lora_id >= len(self._slot_table):
            table = np.full(lora_id + 1, -1, dtype=np.int64)
            table[: len(self._slot_table)] = self._slot_table
            self._slot_table = table

    def remove(self, lora_id: int) -> None:
        """Forget adapter `lora_id` (no request uses it any more): its host copy, and its device slot,
        which becomes free."""
        self.host.pop(lora_id, None)
        if self.slot_of.pop(lora_id, None) is not None:
            self._slot_table[lora_id] = -1

    def read(self, lora_id: int, name: str, path: str) -> None:
        """Read, validate and add the adapter at `path` under `lora_id`, on the calling thread (at start:
        --lora-modules; a run-time load is read off the step loop, engine_svc/lora/reader.py). Raises
        LoRAAdapterError."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # hundreds of tiny host tensors: a thread team would only wait at barriers
        try:
            self.add(lora_id, self.load(name, path))
        finally:
            torch.set_num_threads(threads)

    def load(self, name: str, path: str, pause: Callable[[], None] | None = None) -> PeftAdapter:
        """The adapter at `path` read and validated against this model (no state touched: any thread).
        Raises LoRAAdapterError."""
        from engine_svc.lora.peft_dir import load_peft_adapter

        return load_peft_adapter(name, path, max_rank=self.rank, num_layers=self.num_layers, shapes=self.shapes,
                                 pause=pause)

    def _lay_out(self, target: _Target, adapter: PeftAdapter) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's (a [W, in], b [W, out]) of the adapter for one fused layer, or None if untouched."""
        linear, rank, width = target.linear, self.rank, target.slots.width
        if not any((target.layer, m) in adapter.weights for m, _ in target.modules):
            return None
        a = torch.zeros(width, linear.in_features, dtype=torch.float32)
        b_t = torch.zeros(linear.out_features, width, dtype=torch.float32)  # B's layout, for the loaders
        row = isinstance(linear, RowParallelLinear)
        for j, (module, shard_id) in enumerate(target.modules):
            pair = adapter.weights.get((target.layer, module))
            if pair is None:
                continue
            lo, hi = j * rank, j * rank + adapter.rank
            full_a, full_b = pair
            if row:  # input columns are sharded: A's columns; B (output) is whole
                linear.weight_loader(a[lo:hi], full_a)
                b_t[:, lo:hi] = full_b
            else:  # output rows are sharded: B's rows, through the layer's own loader; A is whole
                a[lo:hi] = full_a
                linear.weight_loader(b_t[:, lo:hi], full_b, shard_id)
        return (a.to(device=self.device, dtype=self.dtype),
                b_t.t().contiguous().to(device=self.device, dtype=self.dtype))

    # ---- per step -----------------------------------------------------------------------------------
    def prepare(self, token_lora_ids: np.ndarray) -> None:
        """Before a step's forward: its adapters in device slots and its token -> slot selection.

        `token_lora_ids[t]` is token t's adapter id (0: the base model)."""
        ids = np.unique(token_lora_ids)
        ids = ids[ids > 0].tolist()
        if not ids:
            self.step.set(None)
            return
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step uses {len(ids)} LoRA adapters, more than --max-loras {self.max_loras}")
        for lora_id in ids:
            self._make_resident(lora_id, ids)
        self.step.plan(self._slot_table[token_lora_ids], self.dtype, self.device)

    def _make_resident(self, lora_id: int, needed: Sequence[int]) -> None:
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return
        layout = self.host.get(lora_id)
        if layout is None:
            raise RuntimeError(f"LoRA adapter id {lora_id} is not loaded in this worker")
        used = set(self.slot_of.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
            self._slot_table[victim] = -1
        for target, weights in zip(self.targets, layout, strict=True):
            target.slots.load(slot, *(weights or (None, None)))
        self.slot_of[lora_id] = slot
        self._slot_table[lora_id] = slot


def _sub_sizes(linear: _TPLinear) -> list[int]:
    """This rank's output width of each sub-projection of a fused layer (q, k, v; gate, up; or the whole)."""
    if isinstance(linear, QKVParallelLinear):
        return [linear.q_size, linear.kv_size, linear.kv_size]
    if isinstance(linear, MergedColumnParallelLinear):
        return list(linear.shard_sizes)
    return [linear.out_features]


def load_adapters(manager: LoRAManager, lora_modules: Sequence[tuple[str, str]]) -> None:
    """Read, validate and add every `(name, path)` of --lora-modules (ids 1, 2, ... in order)."""
    for i, (name, path) in enumerate(lora_modules):
        manager.read(i + 1, name, path)
