"""rotary_qkv_: Triton kernel vs torch reference vs the model's torch path (QKNorm + apply_rotary +
the backend's KV write), in place on the fused qkv projection output."""

from __future__ import annotations

import pytest
import torch

from engine_svc.model.layers.norm import QKNorm
from engine_svc.model.layers.rotary import RotaryEmbedding, apply_rotary
from kernels import rope
from kernels._triton import HAS_TRITON
from kernels.kv_write_ref import kv_write as kv_write_ref
from kernels.rope_ref import rotary_qkv_ as rotary_ref

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

EPS = 1e-6
TOL = {torch.float32: dict(atol=3e-6, rtol=3e-6), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
MAX_POS = 300


def _case(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device, seed: int, norm: bool = True):
    gen = torch.Generator().manual_seed(seed)
    total = heads + 2 * kv_heads
    # A fused projection output [T, (H + 2Hkv) * D] viewed per head, as the model does.
    qkv = (2 * torch.randn(tokens, total * head_dim, generator=gen)).to(dtype).to(device).view(tokens, total, head_dim)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen).to(device)
    cache = RotaryEmbedding(head_dim, MAX_POS, 10000.0, None, dtype).cos_sin_cache.to(device)
    weight = (1 + 0.3 * torch.randn(heads + kv_heads, head_dim, generator=gen)).to(dtype).to(device) if norm else None
    return qkv, positions, cache, weight


def _kv_case(tokens: int, kv_heads: int, head_dim: int, dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed + 100)
    kv_cache = torch.randn(2, 6, 4, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(24, generator=gen)[:tokens]
    slots[1::3] = -1  # padding rows write nothing
    return kv_cache, slots.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (6, 1, 40), (2, 2, 128), (3, 1, 80)])
@pytest.mark.parametrize("norm", [True, False])
def test_kernel_matches_reference_with_cache_write(dtype, heads, kv_heads, head_dim, norm, device):
    qkv, positions, cache, weight = _case(7, heads, kv_heads, head_dim, dtype, device, seed=head_dim, norm=norm)
    kv_cache, slots = _kv_case(7, kv_heads, head_dim, dtype, device, seed=head_dim)
    got_qkv, got_kv = qkv.clone(), kv_cache.clone()
    want_qkv, want_kv = qkv.clone(), kv_cache.clone()
    rope.rotary_qkv_(got_qkv, positions, cache, heads, kv_heads, qk_norm_weight=weight, eps=EPS,
                     kv_cache=got_kv, slot_mapping=slots)
    rotary_ref(want_qkv, positions, cache, heads, kv_heads, qk_norm_weight=weight, eps=EPS,
               kv_cache=want_kv, slot_mapping=slots)
    torch.testing.assert_close(got_qkv, want_qkv, **TOL[dtype])
    torch.testing.assert_close(got_kv, want_kv, **TOL[dtype])
    assert torch.equal(got_qkv[:, heads + kv_heads :], qkv[:, heads + kv_heads :])  # v untouched
    padded = slots < 0
    assert padded.any()


def test_padding_slots_leave_the_cache_alone(device):
    qkv, positions, cache, weight = _case(6, 4, 2, 32, torch.float32, device, seed=1)
    kv_cache = torch.zeros(2, 3, 4, 2, 32, device=device)
    slots = torch.tensor([-1, 5, -1, -1, 0, -1], device=device)
    rope.rotary_qkv_(qkv, positions, cache, 4, 2, qk_norm_weight=weight, kv_cache=kv_cache, slot_mapping=slots)
    written = kv_cache.abs().sum(dim=(0, 3, 4)).flatten().nonzero().flatten().tolist()
    assert written == [0, 5]
    assert torch.equal(kv_cache[0].view(-1, 2, 32)[5], qkv[1, 4:6])  # rotated key of token 1
    assert torch.equal(kv_cache[1].view(-1, 2, 32)[0], qkv[4, 6:8])  # value of token 4


def test_without_cache_only_q_and_k_change(device):
    qkv, positions, cache, _ = _case(5, 4, 2, 64, torch.float32, device, seed=2, norm=False)
    got, want = qkv.clone(), qkv.clone()
    rope.rotary_qkv_(got, positions, cache, 4, 2)
    rotary_ref(want, positions, cache, 4, 2)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert torch.equal(got[:, 6:], qkv[:, 6:])


def test_position_zero_is_identity_without_norm(device):
    qkv, _, cache, _ = _case(3, 2, 1, 32, torch.float32, device, seed=3, norm=False)
    got = qkv.clone()
    rope.rotary_qkv_(got, torch.zeros(3, dtype=torch.int64, device=device), cache, 2, 1)
    torch.testing.assert_close(got, qkv, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_reference_matches_the_model_torch_path(dtype, norm):
    """The reference computes what the model's torch ops compute: QKNorm, apply_rotary, the KV write."""
    heads, kv_heads, head_dim = 4, 2, 32
    qkv, positions, _, weight = _case(9, heads, kv_heads, head_dim, dtype, "cpu", seed=4, norm=norm)
    rotary = RotaryEmbedding(head_dim, MAX_POS, 10000.0, None, dtype)
    kv_cache, slots = _kv_case(9, kv_heads, head_dim, dtype, "cpu", seed=4)

    qk = qkv[:, : heads + kv_heads]
    if norm:
        qk_norm = QKNorm(heads, kv_heads, head_dim, EPS, dtype)
        qk_norm.weight.data.copy_(weight)
        qk = qk_norm(qk)
    cos, sin = rotary.cos_sin(positions)
    want_qk = apply_rotary(qk, cos, sin)
    want_kv = kv_cache.clone()
    kv_write_ref(want_qk[:, heads:], qkv[:, heads + kv_heads :], want_kv, slots)

    got = qkv.clone()
    rotary_ref(got, positions, rotary.cos_sin_cache, heads, kv_heads, qk_norm_weight=weight, eps=EPS,
               kv_cache=kv_cache, slot_mapping=slots)
    # bf16: the model path rounds after each op, the reference once.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=2e-2)
    torch.testing.assert_close(got[:, : heads + kv_heads], want_qk, **tol)
    torch.testing.assert_close(kv_cache, want_kv, **tol)


def test_out_of_range_positions_are_a_clear_error_on_the_torch_path():
    rotary = RotaryEmbedding(16, 8, 10000.0, None, torch.float32)
    with pytest.raises(ValueError, match=r"position 8 is outside the rotary cache.*0\.\.7"):
        rotary.cos_sin(torch.tensor([3, 8]))
