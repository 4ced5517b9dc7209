"""silu_and_mul: Triton kernel vs torch reference vs the model's GatedActivation."""

from __future__ import annotations

import pytest
import torch

from engine_svc.attention import cpu_paged
from engine_svc.model.layers.activation import GatedActivation
from kernels import activation
from kernels._triton import HAS_TRITON
from kernels.activation_ref import silu_and_mul as silu_and_mul_ref

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [128, 200, 3000])  # 3000: several column blocks, a ragged last one
def test_kernel_matches_reference(dtype, width, device):
    gen = torch.Generator().manual_seed(width)
    x = (4 * torch.randn(5, 2 * width, generator=gen)).to(dtype).to(device)
    got = activation.silu_and_mul(x)
    assert got.shape == (5, width) and got.dtype == dtype
    torch.testing.assert_close(got, silu_and_mul_ref(x), **TOL[dtype])


def test_reference_is_the_model_torch_path(monkeypatch):
    """The model's torch ops, not the native CPU op (tests/engine/test_cpu_fused_ops.py holds that one to a
    float64 reference)."""
    monkeypatch.setattr(cpu_paged, "load", lambda: None)
    x = torch.randn(3, 64)
    torch.testing.assert_close(silu_and_mul_ref(x), GatedActivation("silu")(x), atol=0, rtol=0)


def test_fused_layer_uses_the_kernel_for_silu_only(device):
    x = torch.randn(4, 96, device=device)
    before = activation._kernel.launches
    torch.testing.assert_close(GatedActivation("silu", fused=True)(x), silu_and_mul_ref(x), **TOL[torch.float32])
    assert activation._kernel.launches == before + 1
    gelu = GatedActivation("gelu_pytorch_tanh", fused=True)  # no kernel for it: the torch path
    torch.testing.assert_close(gelu(x), GatedActivation("gelu_pytorch_tanh")(x), atol=0, rtol=0)
    assert activation._kernel.launches == before + 1


def test_empty_batch(device):
    assert activation.silu_and_mul(torch.empty(0, 64, device=device)).shape == (0, 32)
