"""rms_norm / fused_add_rms_norm: Triton kernels vs torch references vs the model's torch RMSNorm."""

from __future__ import annotations

import pytest
import torch

from engine_svc.attention import cpu_paged
from engine_svc.model.layers.norm import RMSNorm
from engine_svc.model.layers.norm import rms_norm as model_rms_norm
from kernels import rms_norm_ref
from kernels._triton import HAS_TRITON
from kernels.rms_norm import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

EPS = 1e-6
# The interpreter rounds float32 -> bfloat16 toward zero (GPUs round to nearest): allow an ulp or so.
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _inputs(rows: int, hidden: int, dtype: torch.dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype).to(device)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 100, 1024])
def test_rms_norm_matches_reference(dtype, hidden, device):
    x, _, weight = _inputs(5, hidden, dtype, device, seed=hidden)
    got = rms_norm(x, weight, EPS)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_ref.rms_norm(x, weight, EPS), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 100])
def test_fused_add_rms_norm_matches_reference_in_place(dtype, hidden, device):
    x, residual, weight = _inputs(7, hidden, dtype, device, seed=3)
    x_ref, residual_ref = x.clone(), residual.clone()
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    assert fused_add_rms_norm(x, residual, weight, EPS) is None
    rms_norm_ref.fused_add_rms_norm(x_ref, residual_ref, weight, EPS)
    assert (x.data_ptr(), residual.data_ptr()) == (x_ptr, residual_ptr)
    torch.testing.assert_close(residual, residual_ref, **TOL[dtype])
    torch.testing.assert_close(x, x_ref, **TOL[dtype])


def test_strided_rows(device):
    """Rows of a wider buffer (row stride != hidden), e.g. a slice of a fused output."""
    x, residual, weight = _inputs(6, 96, torch.float32, device, seed=5)
    wide = torch.zeros(6, 160, device=device)
    wide[:, 32:128] = x
    view = wide[:, 32:128]
    torch.testing.assert_close(rms_norm(view, weight, EPS), rms_norm_ref.rms_norm(x, weight, EPS), **TOL[torch.float32])
    residual_ref, x_ref = residual.clone(), x.clone()
    fused_add_rms_norm(view, residual, weight, EPS)
    rms_norm_ref.fused_add_rms_norm(x_ref, residual_ref, weight, EPS)
    torch.testing.assert_close(view, x_ref, **TOL[torch.float32])
    assert not wide[:, :32].any() and not wide[:, 128:].any()  # nothing outside the view


def test_empty_batch(device):
    x, residual, weight = _inputs(0, 64, torch.float32, device, seed=0)
    assert rms_norm(x, weight, EPS).shape == (0, 64)
    fused_add_rms_norm(x, residual, weight, EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_the_model_torch_path(dtype, monkeypatch):
    """The reference computes what the model's torch RMSNorm computes (both forms; the torch ops, not the
    native CPU op, which tests/engine/test_cpu_fused_ops.py holds to a float64 reference)."""
    monkeypatch.setattr(cpu_paged, "load", lambda: None)
    x, residual, weight = _inputs(4, 64, dtype, "cpu", seed=9)
    norm = RMSNorm(64, EPS, dtype)
    norm.weight.data.copy_(weight)
    torch.testing.assert_close(rms_norm_ref.rms_norm(x, weight, EPS), model_rms_norm(x, weight, EPS))
    want_out, want_residual = norm(x, residual)
    x_ref, residual_ref = x.clone(), residual.clone()
    rms_norm_ref.fused_add_rms_norm(x_ref, residual_ref, weight, EPS)
    torch.testing.assert_close(residual_ref, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(x_ref, want_out)


def test_fused_rms_norm_layer_uses_the_kernel(device):
    """RMSNorm(fused=True) gives the torch layer's results, through the kernels."""
    from kernels import rms_norm as kernel_module

    x, residual, weight = _inputs(3, 64, torch.float32, device, seed=1)
    plain, fused = RMSNorm(64, EPS, torch.float32), RMSNorm(64, EPS, torch.float32, fused=True)
    for layer in (plain, fused):
        layer.to(device).weight.data.copy_(weight)
    before = kernel_module._kernel.launches
    torch.testing.assert_close(fused(x.clone()), plain(x), **TOL[torch.float32])
    got_out, got_res = fused(x.clone(), residual.clone())
    want_out, want_res = plain(x, residual)
    torch.testing.assert_close(got_out, want_out, **TOL[torch.float32])
    torch.testing.assert_close(got_res, want_res, **TOL[torch.float32])
    assert kernel_module._kernel.launches == before + 2
