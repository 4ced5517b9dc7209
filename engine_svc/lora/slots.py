"""The device side of multi-LoRA: fixed adapter slots per linear layer, and the batched delta.

Each LoRA-capable linear layer owns `LoRASlots`: `a [S, P*R, in]` and, per sub-projection p of its output
(q, k, v of the fused qkv layer; gate, up; or the whole output), `b[p] [S, R, out_p]` (B transposed, the
adapter's scaling folded in), S = --max-loras slots, R = --max-lora-rank, P = sub-projections. An
adapter's q_proj A sits in rank rows 0..r of the first rank block of `a`, its k_proj in the second, ...;
a smaller rank or an untargeted projection is zero padding, which adds exact zeros. Shapes never change,
so swapping an adapter in is a copy into its slot.

The delta for a step whose tokens use slots < n (`StepLoRA`, set once per step for all layers), one-hot:
    shrink: xa = x @ a[:n].view(n*P*R, in)^T                    [T, n, P, R]
    select: xa *= onehot(token slot)                            (a token keeps only its own slot's ranks)
    expand: out[:, cols of p] += xa[:, :, p].view(T, n*R) @ b[p][:n].view(n*R, out_p)   for each p
or grouped (the adapter tokens gathered into an [n, L] grid, slot by slot):
    xa = bmm(grid [n, L, in], a[:n]^T);  out[rows, cols of p] += bmm(xa[..., p], b[p][:n]) scattered back
A base-model token has an all-zero one-hot row (and no grid place), so its output is exactly the base
output. Under tensor
parallelism the slots hold this rank's shards (column layers: B's output rows; row layers: A's input
columns), and a row layer adds its delta before the all-reduce, which sums the partial products.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class StepLoRA:
    """This step's token -> slot selection, shared by every layer's slots (set once per step by `plan`).

    `num_slots` = 1 + the highest slot any token of the step uses (0: no token has an adapter, the layers
    add nothing). Two layouts of the same selection:
    - grouped (`group_rows` set), when the adapter tokens split evenly enough over two or more slots (a
      decode batch): row s*L + k of the [n, L] grid is the k-th token on slot s (`group_rows[i]` = token index
      for grid position `group_pos[i]`; unused positions gather token 0 and are never scattered back);
      each token is multiplied by its own slot's A and B only (batched matmuls over the grid);
    - one-hot (`onehot[t, s]` = 1 iff token t uses slot s), otherwise (e.g. a long prefill on one adapter
      beside decodes on others) and for one slot (where it is two plain GEMMs): every token meets every
      slot in use, the other slots' columns zeroed."""

    GROUPED_MAX_PADDING = 2  # grouped while n * L <= this many times the adapter tokens

    def __init__(self) -> None:
        self.num_slots = 0
        self.onehot: torch.Tensor | None = None
        self.group_len = 0
        self.group_gather: torch.Tensor | None = None  # [n * L] token index per grid position
        self.group_pos: torch.Tensor | None = None  # [Ta] grid position of each adapter token ...
        self.group_rows: torch.Tensor | None = None  # [Ta] ... and its token index

    def set(self, onehot: torch.Tensor | None) -> None:
        """The one-hot layout (None: no adapter this step)."""
        self.onehot, self.group_rows = onehot, None
        self.num_slots = 0 if onehot is None else onehot.shape[1]

    def plan(self, token_slots: np.ndarray, dtype: torch.dtype, device: torch.device) -> None:
        """The step's layout from each token's slot (-1: the base model)."""
        adapter_tokens = np.flatnonzero(token_slots >= 0)
        if not len(adapter_tokens):
            self.set(None)
            return
        slots = token_slots[adapter_tokens]
        n = int(slots.max()) + 1
        counts = np.bincount(slots, minlength=n)
        length = int(counts.max())
        if n == 1 or n * length > self.GROUPED_MAX_PADDING * len(adapter_tokens):
            onehot = torch.from_numpy(token_slots[:, None] == np.arange(n)[None, :])
            self.set(onehot.to(device=device, dtype=dtype, non_blocking=True))
            return
        order = adapter_tokens[np.argsort(slots, kind="stable")]
        sorted_slots = token_slots[order]
        starts = np.cumsum(counts) - counts
        pos = sorted_slots * length + (np.arange(len(order)) - starts[sorted_slots])
        gather = np.zeros(n * length, dtype=np.int64)
        gather[pos] = order
        self.onehot, self.num_slots, self.group_len = None, n, length
        self.group_gather = torch.from_numpy(gather).to(device, non_blocking=True)
        self.group_pos = torch.from_numpy(pos).to(device, non_blocking=True)
        self.group_rows = torch.from_numpy(order).to(device, non_blocking=True)


class LoRASlots:
    """One linear layer's adapter slots; called as `slots(x, out)` after the base matmul."""

    def __init__(self, step: StepLoRA, num_slots: int, rank: int, in_features: int, sub_sizes: Sequence[int],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.step = step
        self.rank = rank
        self.width = rank * len(sub_sizes)
        self.sub_sizes = list(sub_sizes)
        self.a = torch.zeros(num_slots, self.width, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(num_slots, rank, size, dtype=dtype, device=device) for size in sub_sizes]

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's (a [P*R, in], b [P*R, out]: block p = rows p*R.., its sub-projection's columns)
        into `slot`; None for both = the adapter does not touch this layer (the slot is zeroed)."""
        if a is None or b is None:
            self.a[slot].zero_()
            for part in self.b:
                part[slot].zero_()
            return
        self.a[slot].copy_(a)
        col, rank = 0, self.rank
        for p, (part, size) in enumerate(zip(self.b, self.sub_sizes)):
            part[slot].copy_(b[p * rank : (p + 1) * rank, col : col + size])
            col += size

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (this layer's base output for x) plus each token's adapter delta, in place."""
        step = self.step
        n = step.num_slots
        if n == 0:
            return out
        if step.group_rows is not None:
            return self._grouped(x, out, step)
        onehot = step.onehot
        assert onehot is not None
        tokens, rank, parts = x.shape[0], self.rank, len(self.b)
        xa = torch.matmul(x, self.a[:n].reshape(n * self.width, -1).t()).view(tokens, n, parts, rank)
        xa = xa * onehot.view(tokens, n, 1, 1)
        if parts == 1:
            return out.addmm_(xa.view(tokens, n * rank), self.b[0][:n].reshape(n * rank, -1))
        col = 0
        for p, (part, size) in enumerate(zip(self.b, self.sub_sizes)):
            out[:, col : col + size].addmm_(xa[:, :, p].reshape(tokens, n * rank), part[:n].reshape(n * rank, size))
            col += size
        return out

    def _grouped(self, x: torch.Tensor, out: torch.Tensor, step: StepLoRA) -> torch.Tensor:
        n, length, rank = step.num_slots, step.group_len, self.rank
        assert step.group_gather is not None and step.group_pos is not None and step.group_rows is not None
        grid = x.index_select(0, step.group_gather).view(n, length, -1)
        xa = torch.bmm(grid, self.a[:n].transpose(1, 2))  # [n, L, P * R]
        col = 0
        for p, (part, size) in enumerate(zip(self.b, self.sub_sizes)):
            delta = torch.bmm(xa[:, :, p * rank : (p + 1) * rank], part[:n]).view(n * length, size)
            target = out if len(self.b) == 1 else out[:, col : col + size]
            target.index_add_(0, step.group_rows, delta.index_select(0, step.group_pos))
            col += size
        return out


def lora_delta_reference(x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor) -> torch.Tensor:
    """The delta token by token (tests): row t = (x[t] @ a[s]^T) @ b[s] for s = token_slots[t] >= 0, else 0,
    with `b [S, P*R, out]` an adapter's whole (block) B^T, as `LoRASlots.load` takes it."""
    out = torch.zeros(x.shape[0], b.shape[2], dtype=x.dtype, device=x.device)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] = (x[t] @ a[s].t()) @ b[s]
    return out
