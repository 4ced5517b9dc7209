"""kv_write: Triton kernel vs torch reference, and the reference vs the layout contract."""

from __future__ import annotations

import pytest
import torch

from kernels._triton import HAS_TRITON
from kernels.kv_write import kv_write
from kernels.kv_write_ref import kv_write as kv_write_ref

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _case(
    num_tokens: int, num_blocks: int, block_size: int, heads: int, head_dim: int, dtype, device, seed: int
):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    return (t.to(device) for t in (key, value, cache, slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("block_size", "heads", "head_dim"), [(4, 1, 40), (16, 3, 64), (8, 2, 72)])
def test_kernel_matches_reference(dtype, block_size, heads, head_dim, device):
    key, value, cache, slots = _case(11, 6, block_size, heads, head_dim, dtype, device, seed=block_size)
    expected = cache.clone()
    kv_write_ref(key, value, expected, slots)
    kv_write(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_reference_follows_slot_layout_and_skips_padding(device):
    key, value, cache, slots = _case(9, 5, 4, 2, 16, torch.float32, device, seed=7)
    before = cache.clone()
    kv_write_ref(key, value, cache, slots)
    written = torch.zeros(2, 5, 4, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(cache[0, s // 4, s % 4], key[t])
        assert torch.equal(cache[1, s // 4, s % 4], value[t])
        written[:, s // 4, s % 4] = True
    assert torch.equal(cache[~written.to(device)], before[~written.to(device)])  # nothing else touched


def test_strided_inputs_from_fused_qkv(device):
    """key/value as column slices of one [T, 3*H*D] projection output (non-contiguous rows)."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 6, 2, 32
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=gen).to(device)
    key = qkv[:, heads * head_dim : 2 * heads * head_dim].view(tokens, heads, head_dim)
    value = qkv[:, 2 * heads * head_dim :].view(tokens, heads, head_dim)
    slots = torch.tensor([5, 0, 9, -1, 2, 14], device=device)
    cache = torch.zeros(2, 4, 4, heads, head_dim, device=device)
    expected = cache.clone()
    kv_write_ref(key.contiguous(), value.contiguous(), expected, slots)
    kv_write(key, value, cache, slots)
    assert torch.equal(cache, expected)
