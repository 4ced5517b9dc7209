"""The CPU fast path of a MoE layer's experts: only the experts chosen this step are computed.

`CpuExperts(x, weights, ids, ...)` (kernels/fused_moe_ref.py's numerics and keyword arguments) runs
either:

- the native op (csrc/cpu_moe.cpp, built once like engine_svc/attention/cpu_paged.py's ops) for steps of
  at most `NATIVE_MAX_TOKENS` tokens (decode): it buckets the T*K (token, choice) slots by expert (slots
  routed to -1, experts another rank holds, are left out), then makes one parallel pass over each chosen
  expert's gate/up rows with the activation fused and one over its down rows, each weight row read once
  for all the slots routed to it, and sums each token's rows - all in C++, one call from Python; or
- the torch path: the slots sorted by expert (one argsort, the counts read once on the host), then per
  chosen expert three torch ops on its contiguous slice of the sorted rows (gate/up, the gated
  activation, down) and an `index_add_` of the weighted result into a float32 [T, H] (a long prefill,
  where each expert's rows make a real GEMM; also where the native op is not built, with the weights
  packed for oneDNN by `prepack`).

Either way an expert nobody chose costs nothing: a decode step of batch B reads at most B*K experts.
`TANDEM_CPU_MOE=0` turns the native op off (A/B and the torch reference path).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from engine_svc.attention import cpu_paged
from engine_svc.model.layers.cpu_gemm import pack_weight, packed_linear
from kernels.fused_moe_ref import gated_activation

NATIVE_ENV = "TANDEM_CPU_MOE"
NATIVE_MAX_TOKENS = 64  # tokens per step up to which the native op runs (its dot products beat GEMM calls)
_CSRC = Path(__file__).with_name("csrc")
_NATIVE_ACTIVATIONS = {"silu": 0, "swigluoai": 1}


@functools.cache
def native() -> ModuleType | None:
    """The built native MoE op, or None (switched off, or no compiler: the torch path runs)."""
    if os.environ.get(NATIVE_ENV, "1") == "0" or not cpu_paged.enabled():
        return None
    return cpu_paged.build("tandem_cpu_moe", _CSRC, ("cpu_moe.cpp",), (cpu_paged.MATH_HEADER,), "MoE experts")


def _act(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu":
        op = cpu_paged.for_tensor(h)
        if op is not None and h.is_contiguous():
            out: torch.Tensor = op.silu_and_mul(h)
            return out
    return gated_activation(h, activation, alpha, limit)


class CpuExperts:
    """One layer's experts laid out for the CPU: stacked [E, 2I, H] / [E, H, I] weights (what the native op
    and the torch path read), or, where the native op cannot run, per-expert weights packed for oneDNN."""

    def __init__(self, w13: torch.Tensor | list[torch.Tensor], w2: torch.Tensor | list[torch.Tensor]) -> None:
        self.w13, self.w2 = w13, w2
        self.num_experts = len(w13)
        self.packed = isinstance(w13, list)

    @classmethod
    def from_stacked(cls, w13: torch.Tensor, w2: torch.Tensor, pack: bool = False) -> CpuExperts:
        """Views of the stacked weights, or (`pack`) each expert's weights packed for oneDNN."""
        if pack:
            return cls([pack_weight(w) for w in w13], [pack_weight(w) for w in w2])
        return cls(w13.contiguous(), w2.contiguous())

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _native(self, x: torch.Tensor, activation: str) -> ModuleType | None:
        if self.packed or x.shape[0] > NATIVE_MAX_TOKENS or activation not in _NATIVE_ACTIVATIONS:
            return None
        if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
            return None
        return native()

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
        op = self._native(x, activation)
        if op is not None:
            out: torch.Tensor = op.moe_experts(
                x, ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous(), self.w13, self.w2,
                w13_bias, w2_bias, _NATIVE_ACTIVATIONS[activation], swiglu_alpha, swiglu_limit)
            return out
        top_k = ids.shape[1]
        key = ids.reshape(-1) + 1  # -1 (not held here) -> bucket 0, expert e -> e + 1
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=self.num_experts + 1).tolist()
        return self._torch(x, order, counts, weights.reshape(-1).to(torch.float32), top_k, activation, w13_bias,
                           w2_bias, swiglu_alpha, swiglu_limit)

    def _torch(self, x: torch.Tensor, order: torch.Tensor, counts: list[int], slot_weights: torch.Tensor,
               top_k: int, activation: str, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
               alpha: float, limit: float) -> torch.Tensor:
        tokens = order // top_k
        rows = x[tokens]
        sorted_weights = slot_weights[order].unsqueeze(1)
        out = torch.zeros(x.shape, dtype=torch.float32)
        start = counts[0]
        for expert, count in enumerate(counts[1:]):
            if not count:
                continue
            end = start + count
            h = self._linear(rows[start:end], self.w13[expert], None if w13_bias is None else w13_bias[expert])
            y = self._linear(_act(h, activation, alpha, limit), self.w2[expert],
                             None if w2_bias is None else w2_bias[expert])
            out.index_add_(0, tokens[start:end], y.float() * sorted_weights[start:end])
            start = end
        return out.to(x.dtype)


if __name__ == "__main__":  # `python -m engine_svc.model.layers.moe_cpu`: build (or find) the cached op
    import logging
    import sys

    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if native() is not None else 1)
