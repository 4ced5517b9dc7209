"""The device side of multi-LoRA: fixed adapter slots per linear layer, and the batched delta.

Each LoRA-capable linear layer owns `LoRASlots`: `a [S, W, in]` and `b [S, W, out]` (B transposed, the
adapter's scaling folded in), S = --max-loras slots, W = sub-projections x --max-lora-rank (q, k and v
share the fused qkv layer: an adapter's q_proj A/B sit in rank rows 0..r of the first rank block, its
k_proj in the second, ...; a smaller rank or an untargeted projection is zero padding, which adds exact
zeros). Shapes never change, so swapping an adapter in is a copy into its slot.

The delta for a step whose tokens use slots < n (`StepLoRA`, set once per step for all layers):
    shrink: xa = x @ a[:n].view(n*W, in)^T            [T, n*W]
    select: xa *= onehot(token slot)                  (a token keeps only its own slot's rank columns)
    expand: out += xa @ b[:n].view(n*W, out)
A base-model token has an all-zero one-hot row, so its output is exactly the base output. Under tensor
parallelism the slots hold this rank's shards (column layers: B's output rows; row layers: A's input
columns), and a row layer adds its delta before the all-reduce, which sums the partial products.
"""

from __future__ import annotations

import torch


class StepLoRA:
    """This step's token -> slot selection, shared by every layer's slots.

    `num_slots` = 1 + the highest slot any token of the step uses (0: no token has an adapter, the layers
    add nothing); `onehot[t, s]` = 1 iff token t uses slot s (s < num_slots), in the model's dtype."""

    def __init__(self) -> None:
        self.num_slots = 0
        self.onehot: torch.Tensor | None = None

    def set(self, onehot: torch.Tensor | None) -> None:
        self.onehot = onehot
        self.num_slots = 0 if onehot is None else onehot.shape[1]


class LoRASlots:
    """One linear layer's adapter slots; called as `slots(x, out)` after the base matmul."""

    def __init__(self, step: StepLoRA, num_slots: int, width: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.step = step
        self.width = width
        self.a = torch.zeros(num_slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, width, out_features, dtype=dtype, device=device)

    def load(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put an adapter's (a [W, in], b [W, out]) into `slot`; None for both = the adapter does not
        touch this layer (the slot is zeroed)."""
        if a is None or b is None:
            self.a[slot].zero_()
            self.b[slot].zero_()
        else:
            self.a[slot].copy_(a)
            self.b[slot].copy_(b)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (this layer's base output for x) plus each token's adapter delta, in place."""
        n, onehot = self.step.num_slots, self.step.onehot
        if n == 0 or onehot is None:
            return out
        tokens, width = x.shape[0], self.width
        xa = torch.matmul(x, self.a[:n].reshape(n * width, -1).t())
        xa = (xa.view(tokens, n, width) * onehot.unsqueeze(2)).view(tokens, n * width)
        return out.addmm_(xa, self.b[:n].reshape(n * width, -1))


def lora_delta_reference(x: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor,
                         b: torch.Tensor) -> torch.Tensor:
    """The delta token by token (tests): row t = (x[t] @ a[s]^T) @ b[s] for s = token_slots[t] >= 0, else 0."""
    out = torch.zeros(x.shape[0], b.shape[2], dtype=x.dtype, device=x.device)
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] = (x[t] @ a[s].t()) @ b[s]
    return out
