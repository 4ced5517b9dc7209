"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.attention import cpu_paged
from kernels import activation as triton_activation  # importing kernels never imports triton

_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """x [..., 2 * I] = [gate | up] -> act(gate) * up, shape [..., I].

    `fused=True` (set by the model when it runs the Triton attention backend) computes SiLU-and-mul in
    one Triton kernel (`kernels/activation.py`) for 2-D inputs; other activations keep the torch path.
    On CPU, SiLU-and-mul of 2-D float32 / bfloat16 inputs runs the native op
    (engine_svc/attention/csrc/cpu_fused_ops.cpp) when it is built; torch is the fallback and reference.
    """

    def __init__(self, hidden_act: str = "silu", fused: bool = False) -> None:
        super().__init__()
        if hidden_act not in _GATES:
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: {', '.join(_GATES)})")
        self.act = _GATES[hidden_act]
        self.fused = fused and hidden_act == "silu"
        self.silu = hidden_act == "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dim() == 2:
            return triton_activation.silu_and_mul(x)
        if self.silu and x.dim() == 2 and x.is_contiguous():
            native = cpu_paged.for_tensor(x)
            if native is not None:
                out: torch.Tensor = native.silu_and_mul(x)
                return out
        half = x.shape[-1] // 2
        return self.act(x[..., :half]) * x[..., half:]
