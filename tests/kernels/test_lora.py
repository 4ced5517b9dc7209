"""LoRA shrink/expand: the Triton kernels vs the torch reference (kernels/lora_ref.py) for mixed batches of
several slots and base-model tokens, a slot with no token, every token on one slot, adapters of a rank below
the slots' rank (zero padding), sub-projections of unequal widths, float32 and bfloat16; and the mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import lora_expand, lora_shrink
from kernels._triton import HAS_TRITON
from kernels.lora_mapping import build_mapping, split_mapping
from kernels.lora_ref import lora_expand as ref_expand
from kernels.lora_ref import lora_shrink as ref_shrink

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _slots(num_slots: int, rank: int, in_features: int, widths: list[int], dtype, device, seed: int,
           ranks: list[int] | None = None):
    """Random slot weights; slot s holds an adapter of rank ranks[s] (<= rank), the rest zero padding."""
    gen = torch.Generator().manual_seed(seed)
    parts = len(widths)
    a = torch.randn(num_slots, parts * rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(num_slots, rank, sum(widths), generator=gen) / rank**0.5
    for s, r in enumerate(ranks or []):
        for p in range(parts):
            a[s, p * rank + r : (p + 1) * rank] = 0
        b[s, r:] = 0
    return a.to(dtype).to(device), b.to(dtype).to(device), gen


def _mapping(token_slots: list[int], num_slots: int, device, capacity: int | None = None):
    capacity = capacity or len(token_slots)
    buf = build_mapping(np.array(token_slots, dtype=np.int64), num_slots, capacity)
    return split_mapping(torch.from_numpy(buf).to(device), capacity, num_slots)


def _check(token_slots: list[int], num_slots: int, rank: int, widths: list[int], dtype, device, seed: int,
           ranks: list[int] | None = None) -> None:
    a, b, gen = _slots(num_slots, rank, 40, widths, dtype, device, seed, ranks)
    tokens = len(token_slots)
    x = torch.randn(tokens, 40, generator=gen).to(dtype).to(device)
    base = torch.randn(tokens, sum(widths), generator=gen).to(dtype).to(device)
    slots_t = torch.tensor(token_slots, device=device)
    mapping = _mapping(token_slots, num_slots, device)
    offsets = torch.tensor(np.cumsum([0, *widths]), dtype=torch.int32, device=device)

    shrink_before, expand_before = lora_shrink._kernel.launches, lora_expand._kernel.launches
    xa = torch.full((tokens, len(widths) * rank), float("nan"), device=device)
    lora_shrink.lora_shrink(x, a, xa, mapping)
    want_xa = ref_shrink(x, a, slots_t)
    adapter_rows = slots_t >= 0
    torch.testing.assert_close(xa[adapter_rows], want_xa[adapter_rows], **TOL[torch.float32])

    xa[~adapter_rows] = float("nan")  # base rows of xa are never read
    got = lora_expand.lora_expand(xa, b, base.clone(), mapping, offsets, max(widths))
    want = ref_expand(want_xa, b, base.clone(), slots_t, list(np.cumsum([0, *widths])))
    assert lora_shrink._kernel.launches == shrink_before + 1  # one launch for every slot and part
    assert lora_expand._kernel.launches == expand_before + 1
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(got[~adapter_rows], base[~adapter_rows])  # base tokens: exactly the base output
    if adapter_rows.any():
        assert not torch.allclose(got[adapter_rows], base[adapter_rows])  # a real delta was added


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_slots_and_base_tokens_with_unequal_parts(dtype, device) -> None:
    # slot 2 of 4 receives no token; q | k | v of widths 24, 8, 8; rank 8 slots holding ranks 8, 3, 8, 5
    _check([0, -1, 3, 1, 0, -1, 3, 3, 1, 0, 0, 3, 0, 1, 0, -1, 0, 0, 3],
           4, 8, [24, 8, 8], dtype, device, seed=1, ranks=[8, 3, 8, 5])


def test_every_token_on_one_slot_spans_several_blocks(device) -> None:
    _check([1] * 37, 3, 8, [20, 36], torch.float32, device, seed=2)  # 37 tokens: three BLOCK_M blocks


def test_one_part_all_base_and_a_single_token(device) -> None:
    _check([-1, -1, -1], 2, 16, [72], torch.float32, device, seed=3)  # no adapter token: nothing written
    _check([1], 2, 16, [72], torch.bfloat16, device, seed=4)  # wider than one BLOCK_N tile


def test_a_rank_below_the_slot_rank_adds_exactly_the_smaller_adapter(device) -> None:
    """Zero padding adds exact zeros: a rank-3 adapter in rank-8 slots gives its rank-3 product."""
    a, b, gen = _slots(1, 8, 40, [16], torch.float32, device, seed=5, ranks=[3])
    x = torch.randn(5, 40, generator=gen).to(device)
    mapping = _mapping([0] * 5, 1, device)
    xa = torch.zeros(5, 8, device=device)
    lora_shrink.lora_shrink(x, a, xa, mapping)
    assert torch.equal(xa[:, 3:], torch.zeros(5, 5, device=device))
    out = lora_expand.lora_expand(xa, b, torch.zeros(5, 16, device=device), mapping,
                                  torch.tensor([0, 16], dtype=torch.int32, device=device), 16)
    torch.testing.assert_close(out, x @ a[0, :3].t() @ b[0, :3], **TOL[torch.float32])


def test_mapping_layout() -> None:
    buf = build_mapping(np.array([2, -1, 0, 2, 0, -1]), 4, capacity=8)
    assert buf.tolist() == [2, 4, 0, 3, 0, 0, 0, 0,  # tokens by slot: slot 0 (2, 4), slot 2 (0, 3)
                            2, 0, 2, 0,  # counts
                            0, 2, 2, 4]  # starts
    with pytest.raises(ValueError, match="capacity"):
        build_mapping(np.zeros(9, dtype=np.int64), 4, capacity=8)
    with pytest.raises(ValueError, match="slots must lie"):
        build_mapping(np.array([4]), 4, capacity=8)
