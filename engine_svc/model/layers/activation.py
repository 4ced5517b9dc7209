"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedActivation(nn.Module):
    """x [..., 2 * I] = [gate | up] -> act(gate) * up, shape [..., I]."""

    def __init__(self, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in _GATES:
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: {', '.join(_GATES)})")
        self.act = _GATES[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return self.act(x[..., :half]) * x[..., half:]
