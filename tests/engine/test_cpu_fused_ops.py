"""The native fused CPU ops (add + RMSNorm, SiLU-and-mul) against float64 references, and the layers
that use them against their torch fallback, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_svc.attention import cpu_paged
from engine_svc.model.layers.activation import GatedActivation
from engine_svc.model.layers.norm import RMSNorm
from tests.engine.test_torch_attention import native_op_expected

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # float32: summation order only; bfloat16: the output is rounded once (one ulp, 2^-8 relative)
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}


def _norm_inputs(dtype: torch.dtype, rows: int = 37, dim: int = 200) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, dim, generator=gen) * 5).to(dtype)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


def _norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float64 (normalised, new residual); the new residual is rounded to the dtype, as the model keeps it."""
    new_residual = (x + residual).double()
    var = new_residual.pow(2).mean(-1, keepdim=True)
    return new_residual * torch.rsqrt(var + EPS) * weight.double(), new_residual


def _silu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def _silu_inputs(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(19, 2 * 96, generator=gen) * 4
    x[0, :96] = torch.linspace(-120, 120, 96)  # gates far into both tails of the exponential
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_add_rms_norm_matches_float64_in_place(dtype):
    native_op_expected()
    x, residual, weight = _norm_inputs(dtype)
    want, want_residual = _norm_reference(x, residual, weight)
    cpu_paged.load().add_rms_norm_(x, residual, weight, EPS)
    torch.testing.assert_close(residual.double(), want_residual, atol=0, rtol=0)
    torch.testing.assert_close(x.double(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_silu_and_mul_matches_float64(dtype):
    native_op_expected()
    x = _silu_inputs(dtype)
    out = cpu_paged.load().silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (19, 96)
    torch.testing.assert_close(out.double(), _silu_reference(x), **_tol(dtype))


def test_native_ops_refuse_what_they_cannot_read():
    native_op_expected()
    ops = cpu_paged.load()
    x, residual, weight = _norm_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="residual must match"):
        ops.add_rms_norm_(x, residual.bfloat16(), weight, EPS)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.add_rms_norm_(x, residual, weight[:-1], EPS)
    with pytest.raises(RuntimeError, match="contiguous 2-D"):
        ops.silu_and_mul(x.t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul(x.half())


def _without_native(monkeypatch) -> None:
    monkeypatch.setattr(cpu_paged, "load", lambda: None)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_with_residual_on_both_paths(dtype, native, monkeypatch):
    """The layer's residual form: native in place on CPU, torch ops without the op; both equal the
    float64 reference (the torch path's new residual and normalisation as well)."""
    if native:
        native_op_expected()
    else:
        _without_native(monkeypatch)
    x, residual, weight = _norm_inputs(dtype)
    want, want_residual = _norm_reference(x, residual, weight)
    norm = RMSNorm(x.shape[1], EPS, dtype)
    norm.weight.data.copy_(weight)
    out, new_residual = norm(x.clone() if not native else x, residual)
    assert (out is x and new_residual is residual) == native  # in place exactly when native
    torch.testing.assert_close(new_residual.double(), want_residual, atol=0, rtol=0)
    torch.testing.assert_close(out.double(), want, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_silu_takes_the_native_op_and_agrees_with_torch(dtype, monkeypatch):
    native_op_expected()
    x = _silu_inputs(dtype)
    calls = []
    real = cpu_paged.load()

    class Spy:
        def silu_and_mul(self, t: torch.Tensor) -> torch.Tensor:
            calls.append(t.shape)
            return real.silu_and_mul(t)

    monkeypatch.setattr(cpu_paged, "load", lambda: Spy())
    out = GatedActivation("silu")(x)
    assert calls == [x.shape]
    _without_native(monkeypatch)
    fallback = GatedActivation("silu")(x)
    torch.testing.assert_close(fallback.double(), _silu_reference(x), **_tol(dtype))
    torch.testing.assert_close(out.double(), fallback.double(), **_tol(dtype))
    # other activations and non-2-D inputs keep torch
    torch.testing.assert_close(GatedActivation("gelu")(x), F.gelu(x[:, :96]) * x[:, 96:])


def _rotary_reference(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin in float64, cos / sin recomputed from the cache's signed rows."""
    half = x.shape[-1] // 2
    cos, signed_sin = cache.double()[positions].unbind(1)
    sin = signed_sin[:, None, half:].repeat(1, 1, 2)
    x = x.double()
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_qkv_view_on_both_paths(dtype, native):
    from engine_svc.model.layers.rotary import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(64, 512, 10000.0, dtype=dtype)
    gen = torch.Generator().manual_seed(9)
    qkv = (torch.randn(7, 15, 64, generator=gen) * 2).to(dtype)
    positions = torch.tensor([0, 1, 5, 77, 300, 511, 2])
    want = _rotary_reference(qkv[:, :12], positions, rope.cos_sin_cache)
    v_before = qkv[:, 12:].clone()
    if native:
        native_op_expected()
        qk = qkv[:, :12]
        cpu_paged.load().rotary_(qk, positions, rope.cos_sin_cache)
        assert torch.equal(qkv[:, 12:], v_before)  # only the q/k heads of the view are touched
    else:
        qk = apply_rotary(qkv[:, :12], *rope.cos_sin(positions))
    torch.testing.assert_close(qk.double(), want, **_tol(dtype))
    if native:
        with pytest.raises(RuntimeError, match="position out of the cache"):
            cpu_paged.load().rotary_(qk, torch.tensor([0, 1, 2, 3, 4, 5, 512]), rope.cos_sin_cache)


class _Spy:
    """Delegates to the built native ops and records which were called."""

    def __init__(self, real: object) -> None:
        self.real, self.called = real, set()

    def __getattr__(self, name: str) -> object:
        self.called.add(name)
        return getattr(self.real, name)


def test_a_cpu_forward_runs_every_native_op_and_equals_transformers(make_model, monkeypatch):
    """A float32 qwen3 model (q/k norm, RoPE, GQA) through prefills and decodes: each layer's small ops
    and decode attention take the native ops, and the greedy tokens and logprobs equal transformers'."""
    from tests.engine.test_hf_exact import make_prompts, run_and_compare

    native_op_expected()
    spy = _Spy(cpu_paged.load())
    monkeypatch.setattr(cpu_paged, "load", lambda: spy)
    run_and_compare(make_model("qwen3"), make_prompts(13, 3, 500))
    assert spy.called == {"paged_decode", "add_rms_norm_", "silu_and_mul", "rotary_"}


def test_without_the_native_ops_a_cpu_forward_still_equals_transformers(make_model, monkeypatch):
    from tests.engine.test_hf_exact import make_prompts, run_and_compare

    _without_native(monkeypatch)
    run_and_compare(make_model("qwen3"), make_prompts(13, 3, 500))


def test_native_bfloat16_rounding_is_torchs_bit_for_bit_at_ties_overflow_and_nan():
    """The ops round float32 to bfloat16 in integer arithmetic (cpu_math.h `from_float` / `round_to`):
    ties go to even, a finite sum past bfloat16's largest rounds to inf, NaN stays NaN, as torch rounds."""
    native_op_expected()
    ulp = 2.0**-7  # bfloat16's spacing in [1, 2)
    bf16_max = torch.finfo(torch.bfloat16).max  # + half its ulp: a finite float32 tie that rounds to inf
    residual = torch.tensor([[1.0, 1.0, 1.0 + ulp, -1.0, bf16_max, float("inf"), 0.5, 1.0]]).bfloat16()
    x = torch.tensor([[ulp / 2, 3 * ulp / 2, ulp / 2, -ulp / 2, 2.0**119, float("-inf"), 2.0**-30,
                       ulp / 4]]).bfloat16()
    want = (x.float() + residual.float()).bfloat16()  # torch's float32 -> bfloat16 rounding
    weight = torch.ones(8, dtype=torch.bfloat16)
    cpu_paged.load().add_rms_norm_(x, residual, weight, EPS)
    finite = want.isfinite()
    assert torch.equal(residual[finite].view(torch.int16), want[finite].view(torch.int16))
    assert residual[0, 4].item() == float("inf") and residual[0, 5].isnan()
    assert residual[0, 0].item() == 1.0 and residual[0, 1].item() == 1.0 + 2 * ulp  # ties to even
