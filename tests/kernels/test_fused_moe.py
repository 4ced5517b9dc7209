"""fused_moe: the Triton grouped-GEMM experts vs the torch reference (kernels/fused_moe_ref.py), for random
routings, experts that receive no token, one expert that receives every token, choices held by another
rank (-1), biases with gpt-oss's clamped SwiGLU, and the block alignment's invariants."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe
from kernels._triton import HAS_TRITON
from kernels.fused_moe_ref import fused_experts as reference

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=6e-2, rtol=5e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}


def _experts(num_experts: int, hidden: int, size: int, dtype: torch.dtype, device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * size, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, size, generator=gen) / size**0.5
    return w13.to(dtype).to(device), w2.to(dtype).to(device), gen


def _route(gen: torch.Generator, tokens: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(torch.randn(tokens, num_experts, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights.to(device), ids.to(device)


def _check(x, w13, w2, weights, ids, **kwargs) -> torch.Tensor:
    before = fused_moe._kernel.launches
    got = fused_moe.fused_experts(x, w13, w2, weights, ids, **kwargs)
    assert fused_moe._kernel.launches == before + (2 if ids.numel() else 0)  # one grouped GEMM each way
    want = reference(x, w13, w2, weights, ids, **kwargs)
    assert got.shape == want.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, want, **TOL[x.dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "size"), [
    (1, 8, 2, 64, 32),  # a decode: 6 of 8 experts get nothing
    (7, 6, 2, 48, 40),  # dims that are no power of two
    (40, 4, 2, 32, 24),  # 20 slots per expert on average: several BLOCK_M blocks per expert
])
def test_random_routings_match_the_reference(dtype, tokens, num_experts, top_k, hidden, size, device) -> None:
    w13, w2, gen = _experts(num_experts, hidden, size, dtype, device, seed=tokens)
    weights, ids = _route(gen, tokens, num_experts, top_k, device)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    _check(x, w13, w2, weights, ids)


def test_one_expert_takes_every_token_and_the_others_none(device) -> None:
    w13, w2, gen = _experts(8, 32, 16, torch.float32, device, seed=1)
    ids = torch.full((37, 1), 5, device=device)  # 37 slots on expert 5: three blocks of 16, one ragged
    weights = torch.rand(37, 1, generator=gen).to(device)
    x = torch.randn(37, 32, generator=gen).to(device)
    _check(x, w13, w2, weights, ids)
    ids2 = torch.stack([torch.full((37,), 2), torch.randint(0, 8, (37,), generator=gen)], dim=1).to(device)
    ids2[:, 1] = torch.where(ids2[:, 1] == 2, 3, ids2[:, 1])  # every token has expert 2 plus another
    _check(x, w13, w2, torch.rand(37, 2, generator=gen).to(device), ids2)


def test_choices_held_elsewhere_contribute_nothing(device) -> None:
    w13, w2, gen = _experts(4, 32, 16, torch.float32, device, seed=2)
    weights, ids = _route(gen, 9, 4, 2, device)
    ids[0, 0] = -1
    ids[4] = -1  # nothing for token 4 on this rank
    x = torch.randn(9, 32, generator=gen).to(device)
    got = _check(x, w13, w2, weights, ids)
    assert torch.equal(got[4], torch.zeros(32, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_and_clamped_swiglu_match_the_reference(dtype, device) -> None:
    w13, w2, gen = _experts(4, 32, 16, dtype, device, seed=3)
    b13 = torch.randn(4, 32, generator=gen).to(dtype).to(device)
    b2 = torch.randn(4, 32, generator=gen).to(dtype).to(device)
    weights, ids = _route(gen, 11, 4, 2, device)
    x = (3 * torch.randn(11, 32, generator=gen)).to(dtype).to(device)
    _check(x, w13, w2, weights, ids, activation="swigluoai", w13_bias=b13, w2_bias=b2, swiglu_limit=1.5)


def test_empty_batch(device) -> None:
    w13, w2, _ = _experts(4, 32, 16, torch.float32, device, seed=4)
    ids = torch.empty(0, 2, dtype=torch.int64, device=device)
    out = fused_moe.fused_experts(torch.empty(0, 32, device=device), w13, w2, torch.empty(0, 2, device=device), ids)
    assert out.shape == (0, 32)


def test_alignment_sorts_pads_and_drops() -> None:
    ids = torch.tensor([[2, 0], [2, -1], [0, 2], [3, 2]])  # expert 1 none, expert 2 four slots
    sorted_ids, block_expert, num_padded = fused_moe.moe_align_block_size(ids, 4, num_experts=4)
    slots = ids.numel()
    assert sorted_ids.numel() == 8 + 4 * 3  # the worst case: every expert's last block padded, rounded up
    assert int(num_padded) == 12  # expert 0: 2 -> 4, expert 2: 4, expert 3: 1 -> 4
    blocks = sorted_ids[:12].view(3, 4).tolist()
    assert blocks[0] == [1, 4, slots, slots]  # expert 0's slots in order, then padding
    assert blocks[1] == [0, 2, 5, 7]  # expert 2
    assert blocks[2] == [6, slots, slots, slots]  # expert 3
    assert block_expert[:3].tolist() == [0, 2, 3] and (block_expert[3:] == -1).all()
    assert (sorted_ids[12:] == slots).all()
    valid = sorted(s for s in sorted_ids.tolist() if s < slots)
    assert valid == [i for i, e in enumerate(ids.flatten().tolist()) if e >= 0]  # each kept slot once, -1 dropped
