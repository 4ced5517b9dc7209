"""Torch reference for the LoRA kernels (kernels/lora_shrink.py, kernels/lora_expand.py), token by slot.

Layouts (engine_svc/lora/slots.py keeps its slots this way):
- `a` [S, W, in]: slot s's A matrices stacked, W = P * R (sub-projection p's rank rows at p*R .. p*R + R);
- `b` [S, R, out]: slot s's B^T, the columns of sub-projection p at offsets[p] .. offsets[p + 1]
  (q | k | v of a fused qkv layer, gate | up, or the whole output); the adapter's scaling folded in;
- `token_slots` [T]: each token's slot, -1 for the base model (no delta).

shrink: xa[t] = x[t] @ a[s]^T in float32 (zero for base tokens), [T, W].
expand: out[t, offsets[p]:offsets[p+1]] += xa[t, p*R:(p+1)*R] @ b[s, :, offsets[p]:offsets[p+1]], summed in
float32 and rounded once to out's dtype, in place; base tokens' rows untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def lora_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """[T, W] float32: each adapter token's x times its slot's A^T; zero rows for base tokens."""
    xa = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for s in torch.unique(token_slots).tolist():
        if s >= 0:
            rows = torch.nonzero(token_slots == s).flatten()
            xa[rows] = x[rows].float() @ a[s].float().t()
    return xa


def lora_expand(xa: torch.Tensor, b: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor,
                offsets: Sequence[int]) -> torch.Tensor:
    """`out` plus each adapter token's xa times its slot's B in every sub-projection's columns, in place."""
    rank = b.shape[1]
    for s in torch.unique(token_slots).tolist():
        if s < 0:
            continue
        rows = torch.nonzero(token_slots == s).flatten()
        for p in range(len(offsets) - 1):
            lo, hi = offsets[p], offsets[p + 1]
            delta = xa[rows, p * rank : (p + 1) * rank].float() @ b[s, :, lo:hi].float()
            out[rows, lo:hi] = (out[rows, lo:hi].float() + delta).to(out.dtype)
    return out
