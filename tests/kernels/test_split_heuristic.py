"""choose_num_splits: the flash-decoding split policy, a pure function checked on CPU."""

from __future__ import annotations

import pytest

from kernels.paged_attention import (
    ENOUGH_WAVES,
    MAX_SPLITS,
    MIN_CONTEXT_TO_SPLIT,
    MIN_KEYS_PER_SPLIT,
    PREFERRED_KEYS_PER_SPLIT,
    choose_num_splits,
    min_tiles_per_split,
)

H100_SMS, A100_SMS, L4_SMS = 132, 108, 58
TARGET = 4  # TARGET_PROGRAMS_PER_SM


@pytest.mark.parametrize("sms", [H100_SMS, A100_SMS, L4_SMS])
@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("context", [4096, 16384])
@pytest.mark.parametrize("kv_heads", [8, 4])
def test_small_batches_at_long_context_fill_every_sm(sms, batch, context, kv_heads):
    """The issue's cases (batch 1 / 4 / 16 at 4k and 16k): at least one full wave of programs."""
    splits = choose_num_splits(sms, batch, kv_heads, context, tile=16)
    assert batch * kv_heads * splits >= sms, (batch, kv_heads, splits)


def test_h100_qwen3_shapes():
    """GQA 16/8 on an H100: the figures bench/kernel_attention.py will measure."""
    got = {(b, c): choose_num_splits(H100_SMS, b, 8, c, 16) for b in (1, 4, 16, 64, 256) for c in (1024, 4096, 16384)}
    assert got[(1, 4096)] == 32 and got[(1, 16384)] == 64  # 256 / 512 programs
    assert got[(4, 4096)] == 18 and got[(16, 4096)] == 6  # 576 / 768 programs
    assert got[(64, 4096)] == got[(256, 16384)] == 1  # >= 2 waves already
    assert got[(1, 1024)] == 16  # 8 splits of 128 keys leave SMs idle: 16 of 64 keys fill one wave
    # batch 4 / 16 reach the target of 4 programs per SM; batch 1 is capped by keys per split / MAX_SPLITS
    assert all(got[(b, c)] * b * 8 >= TARGET * H100_SMS for b in (4, 16) for c in (4096, 16384))


@pytest.mark.parametrize("context", [1, 16, 100, MIN_CONTEXT_TO_SPLIT - 1])
def test_short_contexts_are_never_split(context):
    assert choose_num_splits(H100_SMS, 1, 1, context, 16) == 1


@pytest.mark.parametrize("batch", [33, 64, 256])
def test_grids_with_enough_waves_are_not_split(batch):
    assert batch * 8 >= ENOUGH_WAVES * H100_SMS
    assert choose_num_splits(H100_SMS, batch, 8, 32768, 16) == 1


@pytest.mark.parametrize("sms", [H100_SMS, L4_SMS])
@pytest.mark.parametrize("tile", [16, 32, 64])
@pytest.mark.parametrize("context", [512, 777, 2048, 5000, 40960])
@pytest.mark.parametrize("batch", [1, 2, 3, 8, 20])
def test_splits_are_worth_it_and_never_empty(sms, tile, context, batch):
    splits = choose_num_splits(sms, batch, 4, context, tile)
    assert 1 <= splits <= MAX_SPLITS
    tiles = -(-context // tile)
    per_split = max(-(-tiles // splits), min_tiles_per_split(tile))  # the kernel's share per split
    assert (splits - 1) * per_split < tiles  # the last split has work
    if splits > 1:
        assert per_split >= min_tiles_per_split(tile)  # each split reads >= MIN_KEYS_PER_SPLIT keys
        assert per_split * tile >= MIN_KEYS_PER_SPLIT
        # shorter than preferred only by rounding (<= one extra split), or to reach one full wave
        preferred_most = tiles // min_tiles_per_split(tile, PREFERRED_KEYS_PER_SPLIT)
        assert splits <= preferred_most + 1 or batch * 4 * preferred_most < sms


def test_more_requests_never_mean_more_splits():
    for context in (1024, 4096, 16384):
        counts = [choose_num_splits(H100_SMS, b, 8, context, 16) for b in range(1, 80)]
        assert counts == sorted(counts, reverse=True)


def test_min_tiles_per_split():
    assert min_tiles_per_split(16) == 4 and min_tiles_per_split(64) == 1  # MIN_KEYS_PER_SPLIT 64
    assert min_tiles_per_split(16, PREFERRED_KEYS_PER_SPLIT) == 8 and min_tiles_per_split(256, 128) == 1
    assert min_tiles_per_split(16, min_keys=1) == 1
