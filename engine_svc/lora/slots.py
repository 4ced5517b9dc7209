"""The device side of multi-LoRA: fixed adapter slots per linear layer, and the batched delta.

Each LoRA-capable linear layer owns `LoRASlots` with S = --max-loras slots, R = --max-lora-rank and P
sub-projections of its output (q, k, v of the fused qkv layer; gate, up; or the whole output), W = P*R:
- `a [S, W, in]`: an adapter's q_proj A in rank rows 0..r of the first rank block, its k_proj in the
  second, ...;
- `b [S, R, out]`: B^T with the adapter's scaling folded in, sub-projection p's columns at
  `offsets[p] .. offsets[p+1]` (`parts[p]`, its [S, R, out_p] view), fed by rank block p of `a`.
A smaller rank or an untargeted projection is zero padding, which adds exact zeros. Shapes never change:
swapping an adapter in is a copy into its slot's storage (addresses never change).

The step's token -> slot selection (`StepLoRA`, set once per step for all layers) is applied one of four
ways, chosen per device when the step object is made (kernels) or per step (native, the torch layouts):
- kernels (CUDA with Triton): kernels/lora_shrink.py then kernels/lora_expand.py, one launch each for
  every slot and sub-projection, reading the token mapping (kernels/lora_mapping.py) from one fixed
  device buffer rewritten in place each step; they always launch (a step without adapter tokens has zero
  counts), so the launches are the same for every step of a batch size and a CUDA graph can capture them;
- native (CPU, the op of engine_svc/lora/cpu_native.py built, at most NATIVE_MAX_TOKENS tokens): the
  kernels' mapping (kernels/lora_mapping.py) as CPU tensors, and one op call per layer that adds every
  adapter token's delta in place (each slot's A and B read once for all its tokens);
- torch, grouped (a decode batch whose adapter tokens split evenly enough over two or more slots): the
  adapter tokens gathered into an [n, L] grid slot by slot, xa = bmm(grid, a[:n]^T), then per
  sub-projection bmm(xa's rank block p, parts[p][:n]) scattered back into p's columns with index_add_;
- torch, one-hot (one slot, or an uneven mix such as a long prefill beside decodes): xa = x @ a[:n]^T for
  every slot in use, the other slots' columns zeroed by the one-hot (skipped when every token is on the
  one slot), then per sub-projection out[:, cols of p] += xa's rank blocks p @ parts[p][:n] (strided
  views, no copies for one slot).
A base-model token has no grid place, an all-zero one-hot row and no mapping entry, so its output is
exactly the base output. Under tensor parallelism the slots hold this rank's shards (column layers: B's
output columns; row layers: A's input columns), and a row layer adds its delta before the all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_svc.lora.cpu_native import NATIVE_MAX_TOKENS
from kernels._triton import HAS_TRITON
from kernels.lora_mapping import LoRAMapping, build_mapping, mapping_size, split_mapping

if TYPE_CHECKING:
    from engine_svc.worker.staging import StepStaging, Twin


def kernels_wanted(device: torch.device) -> bool:
    """The Triton shrink/expand serve a device's LoRA steps: on CUDA when Triton is installed."""
    return device.type == "cuda" and HAS_TRITON


class StepLoRA:
    """This step's token -> slot selection, shared by every layer's slots (set once per step by `plan`).

    `num_slots` = 1 + the highest slot any token of the step uses (0: no token has an adapter). With
    `kernels`, `mapping` views one fixed device buffer (capacity tokens, `slots` slots) that `plan`
    rewrites in place; with `native` (the built CPU op) and a step of at most NATIVE_MAX_TOKENS tokens,
    `native_mapping` is that mapping for the slots in use, as CPU tensors; otherwise one of the torch layouts:
    - grouped (`group_rows` set): row s*L + k of the [n, L] grid is the k-th token on slot s
      (`group_gather[i]` = token index of grid position i, unused positions gather token 0;
      `group_pos` = the grid positions of the adapter tokens, None when the grid has no unused position,
      `group_rows` = their token indices, in the same order);
    - one-hot (`onehot[t, s]` = 1 iff token t uses slot s; `onehot_needed` False when every token is on
      slot 0, where the product is skipped)."""

    GROUPED_MAX_PADDING = 2  # grouped while n * L <= this many times the adapter tokens

    def __init__(self, *, kernels: bool = False, slots: int = 0, capacity: int = 0,
                 device: torch.device | None = None, native: ModuleType | None = None) -> None:
        self.kernels = kernels
        self.native = None if kernels else native
        self.native_mapping: LoRAMapping | None = None
        self.num_slots = 0
        self.onehot: torch.Tensor | None = None
        self.onehot_needed = True
        self.group_len = 0
        self.group_gather: torch.Tensor | None = None
        self.group_pos: torch.Tensor | None = None
        self.group_rows: torch.Tensor | None = None
        self.slots, self.capacity = slots, capacity
        if kernels:
            if slots < 1 or capacity < 1:
                raise ValueError("StepLoRA(kernels=True) needs slots >= 1 and capacity >= 1")
            size = mapping_size(capacity, slots)
            self._host = np.zeros(size, dtype=np.int32)
            self._twin: Twin | None = None
            self.mapping_buffer = torch.zeros(size, dtype=torch.int32, device=device)
            self.mapping = split_mapping(self.mapping_buffer, capacity, slots)

    def set(self, onehot: torch.Tensor | None) -> None:
        """The one-hot layout (None: no adapter this step)."""
        self.onehot, self.group_rows, self.onehot_needed = onehot, None, True
        self.native_mapping = None
        self.num_slots = 0 if onehot is None else onehot.shape[1]
        if onehot is None and self.kernels:
            self._write_mapping(np.full(0, -1, dtype=np.int64))

    def plan(self, token_slots: np.ndarray, dtype: torch.dtype, device: torch.device) -> None:
        """The step's layout from each token's slot (-1: the base model)."""
        if self.kernels:
            self.num_slots = int(token_slots.max(initial=-1)) + 1
            self._write_mapping(token_slots)
            return
        adapter_tokens = np.flatnonzero(token_slots >= 0)
        if not len(adapter_tokens):
            self.set(None)
            return
        slots = token_slots[adapter_tokens]
        n = int(slots.max()) + 1
        if self.native is not None and len(token_slots) <= NATIVE_MAX_TOKENS:
            self.set(None)
            capacity = len(token_slots)
            mapping = torch.from_numpy(build_mapping(token_slots, n, capacity))
            self.native_mapping, self.num_slots = split_mapping(mapping, capacity, n), n
            return
        counts = np.bincount(slots, minlength=n)
        length = int(counts.max())
        if n == 1 or n * length > self.GROUPED_MAX_PADDING * len(adapter_tokens):
            onehot = torch.from_numpy(token_slots[:, None] == np.arange(n)[None, :])
            self.set(onehot.to(device=device, dtype=dtype, non_blocking=True))
            self.onehot_needed = n > 1 or len(adapter_tokens) < len(token_slots)
            return
        order = adapter_tokens[np.argsort(slots, kind="stable")]
        sorted_slots = token_slots[order]
        starts = np.cumsum(counts) - counts
        pos = sorted_slots * length + (np.arange(len(order)) - starts[sorted_slots])
        gather = np.zeros(n * length, dtype=np.int64)
        gather[pos] = order
        self.onehot, self.num_slots, self.group_len = None, n, length
        self.group_gather = torch.from_numpy(gather).to(device, non_blocking=True)
        self.group_rows = torch.from_numpy(order).to(device, non_blocking=True)
        full = len(order) == n * length
        self.group_pos = None if full else torch.from_numpy(pos).to(device, non_blocking=True)
        if full:
            self.group_rows = self.group_gather

    def use_staging(self, staging: StepStaging) -> None:
        """Send the mapping through a pair of the worker's step staging (engine_svc/worker/staging.py:
        pinned host array, asynchronous copy, reuse guarded by its step events) instead of a synchronous
        copy. Call once, before any CUDA graph is captured: the device buffer is replaced here, never later."""
        self._twin = staging.twin((len(self._host),), torch.int32)
        self.mapping_buffer = self._twin.device
        self.mapping = split_mapping(self.mapping_buffer, self.capacity, self.slots)

    def _write_mapping(self, token_slots: np.ndarray) -> None:
        """The kernels' mapping into the fixed device buffer, in place: through the staging pair when bound
        (within the runner's begin_step / end_step), else a synchronous copy (the host array is reused)."""
        if self._twin is not None:
            build_mapping(token_slots, self.slots, self.capacity, out=self._twin.host)
            self._twin.upload()
            return
        build_mapping(token_slots, self.slots, self.capacity, out=self._host)
        self.mapping_buffer.copy_(torch.from_numpy(self._host))


class LoRASlots:
    """One linear layer's adapter slots; called as `slots(x, out)` after the base matmul."""

    def __init__(self, step: StepLoRA, num_slots: int, rank: int, in_features: int, sub_sizes: Sequence[int],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.step = step
        self.rank = rank
        self.width = rank * len(sub_sizes)
        self.sub_sizes = list(sub_sizes)
        self.offsets = [0, *np.cumsum(self.sub_sizes).tolist()]
        out_features = self.offsets[-1]
        self.a = torch.zeros(num_slots, self.width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, rank, out_features, dtype=dtype, device=device)
        self.parts = [self.b[:, :, lo:hi] for lo, hi in zip(self.offsets, self.offsets[1:])]
        if step.kernels:
            self.offsets_device = torch.tensor(self.offsets, dtype=torch.int32, device=device)
            self.max_width = max(self.sub_sizes)

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's (a [P*R, in], b [P*R, out]: block p = rows p*R.., its sub-projection's columns)
        into `slot` by copying into the slot's storage; None for both = the adapter does not touch this layer
        (the slot is zeroed)."""
        if a is None or b is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
            return
        self.a[slot].copy_(a)
        rank = self.rank
        for p, (part, lo, hi) in enumerate(zip(self.parts, self.offsets, self.offsets[1:])):
            part[slot].copy_(b[p * rank : (p + 1) * rank, lo:hi])

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (this layer's base output for x) plus each token's adapter delta, in place."""
        step = self.step
        if step.kernels:
            return self._kernels(x, out, step)
        n = step.num_slots
        if n == 0:
            return out
        if step.native_mapping is not None:
            return self._native(x, out, step)
        if step.group_rows is not None:
            return self._grouped(x, out, step)
        onehot = step.onehot
        assert onehot is not None
        tokens = x.shape[0]
        xa = torch.matmul(x, self.a[:n].reshape(n * self.width, -1).t())
        if step.onehot_needed:
            xa.view(tokens, n, self.width).mul_(onehot.view(tokens, n, 1))
        rank, blocks = self.rank, xa.view(tokens, n, len(self.parts), self.rank)
        for p, (part, lo, hi) in enumerate(zip(self.parts, self.offsets, self.offsets[1:])):
            xa_p = xa[:, p * rank : (p + 1) * rank] if n == 1 else blocks[:, :, p].reshape(tokens, n * rank)
            target = out if len(self.parts) == 1 else out[:, lo:hi]
            target.addmm_(xa_p, part[:n].reshape(n * rank, hi - lo))
        return out

    def _native(self, x: torch.Tensor, out: torch.Tensor, step: StepLoRA) -> torch.Tensor:
        op, m = step.native, step.native_mapping
        assert op is not None and m is not None
        if x.stride(-1) != 1:  # the op reads rows with unit column stride
            x = x.contiguous()
        target = out if out.stride(-1) == 1 else out.contiguous()
        op.lora_add_(x, target, self.a, self.b, self.offsets, m.sorted_tokens, m.counts, m.starts)
        if target is not out:
            out.copy_(target)
        return out

    def _grouped(self, x: torch.Tensor, out: torch.Tensor, step: StepLoRA) -> torch.Tensor:
        n, length = step.num_slots, step.group_len
        assert step.group_gather is not None and step.group_rows is not None
        grid = x.index_select(0, step.group_gather).view(n, length, -1)
        xa = torch.bmm(grid, self.a[:n].transpose(1, 2))  # [n, L, W]
        rank = self.rank
        for p, (part, lo, hi) in enumerate(zip(self.parts, self.offsets, self.offsets[1:])):
            delta = torch.bmm(xa[:, :, p * rank : (p + 1) * rank], part[:n]).view(n * length, hi - lo)
            if step.group_pos is not None:
                delta = delta.index_select(0, step.group_pos)
            target = out if len(self.parts) == 1 else out[:, lo:hi]
            target.index_add_(0, step.group_rows, delta)
        return out

    def _kernels(self, x: torch.Tensor, out: torch.Tensor, step: StepLoRA) -> torch.Tensor:
        from kernels.lora_expand import lora_expand
        from kernels.lora_shrink import lora_shrink

        if x.stride(-1) != 1:  # the kernels read rows with unit column stride
            x = x.contiguous()
        xa = torch.empty(x.shape[0], self.width, dtype=torch.float32, device=x.device)
        lora_shrink(x, self.a, xa, step.mapping)
        return lora_expand(xa, self.b, out, step.mapping, self.offsets_device, self.max_width)


def lora_delta_reference(x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor) -> torch.Tensor:
    """The delta token by token (tests): row t = (x[t] @ a[s]^T) @ b[s] for s = token_slots[t] >= 0, else 0,
    with `b [S, P*R, out]` an adapter's whole (block) B^T, as `LoRASlots.load` takes it."""
    out = torch.zeros(x.shape[0], b.shape[2], dtype=x.dtype, device=x.device)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] = (x[t] @ a[s].t()) @ b[s]
    return out
