"""The CPU fast path of a MoE layer's experts: GEMMs over only the experts chosen this step.

`CpuExperts(x, weights, ids, ...)` (kernels/fused_moe_ref.py's numerics and keyword arguments):
1. the T*K (token, choice) slots are sorted by expert (one argsort; slots routed to -1, experts another
   rank holds, sort first and are dropped), and the counts per expert read once on the host;
2. for each expert that received a slot, and only those, its rows go through gate/up, the gated
   activation and down as three ops on contiguous slices of the sorted rows - with the weights prepacked
   for oneDNN (`prepack`, as the dense linears are) where the dtype allows, else plain linears;
3. each result times its routing weight is added into a float32 [T, H] (`index_add_`, expert by expert
   in ascending order, as transformers adds them), then rounded once to the activation dtype.

An expert nobody chose costs nothing: a decode step of batch B runs at most B*K experts, not all E.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_svc.attention import cpu_paged
from engine_svc.model.layers.cpu_gemm import pack_weight, packed_linear
from kernels.fused_moe_ref import gated_activation


def _act(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        native = cpu_paged.for_tensor(h)
        if native is not None and h.is_contiguous():
            out: torch.Tensor = native.silu_and_mul(h)
            return out
    return gated_activation(h, activation, alpha, limit)


class CpuExperts:
    """One layer's experts laid out for the CPU: per expert its [2I, H] and [H, I] weights, plain or
    packed for oneDNN (`packed=True`)."""

    def __init__(self, w13: list[torch.Tensor], w2: list[torch.Tensor], packed: bool) -> None:
        self.w13, self.w2, self.packed = w13, w2, packed

    @classmethod
    def from_stacked(cls, w13: torch.Tensor, w2: torch.Tensor, pack: bool = False) -> CpuExperts:
        """From stacked [E, 2I, H] / [E, H, I] weights (views of them unless `pack`)."""
        if pack:
            return cls([pack_weight(w) for w in w13], [pack_weight(w) for w in w2], True)
        return cls(list(w13.unbind(0)), list(w2.unbind(0)), False)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def __call__(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        *,
        activation: str = "silu",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
    ) -> torch.Tensor:
        top_k = ids.shape[1]
        key = ids.reshape(-1) + 1  # -1 (not held here) -> bucket 0, expert e -> e + 1
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=len(self.w13) + 1).tolist()
        tokens = order // top_k
        rows = x[tokens]
        slot_weights = weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(x.shape, dtype=torch.float32)
        start = counts[0]
        for expert, count in enumerate(counts[1:]):
            if not count:
                continue
            end = start + count
            h = self._linear(rows[start:end], self.w13[expert], None if w13_bias is None else w13_bias[expert])
            a = _act(h, activation, swiglu_alpha, swiglu_limit)
            y = self._linear(a, self.w2[expert], None if w2_bias is None else w2_bias[expert])
            out.index_add_(0, tokens[start:end], y.float() * slot_weights[start:end])
            start = end
        return out.to(x.dtype)
