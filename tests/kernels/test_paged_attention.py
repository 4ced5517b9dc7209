"""unified_paged_attention: Triton kernel vs torch reference, the reference vs SDPA, and the backend.

Batches are ragged (prefill chunks with prior context mixed with decodes), block tables are shuffled
and non-contiguous (with unused trailing entries), and contexts span several blocks. Shapes are tiny
because the CPU interpreter is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine_svc.attention.backend import AttentionMetadata
from engine_svc.attention.triton_backend import TritonAttentionBackend
from kernels import _triton, paged_attention
from kernels._triton import HAS_TRITON
from kernels.kv_write_ref import kv_write as kv_write_ref
from kernels.paged_attention import DECODE_DEFAULTS, parse_decode_config, unified_paged_attention
from kernels.paged_attention_ref import unified_paged_attention as attention_ref

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# (q_len, seq_len) per request: decodes first, then a prefill chunk after context, a whole prompt,
# and a chunk that starts mid-block.
MIXED = [(1, 9), (1, 3), (6, 13), (5, 5), (3, 20)]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@dataclass
class Batch:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] this step's K/V
    value: torch.Tensor
    kv_cache: torch.Tensor  # context before this step already written
    meta: AttentionMetadata

    def attention_args(self) -> tuple:
        m = self.meta
        return (self.query, self.kv_cache, m.query_start_loc, m.seq_lens, m.block_table)

    def limits(self) -> tuple[int, int]:
        return self.meta.max_query_len, self.meta.max_seq_len


def make_batch(
    reqs: list[tuple[int, int]],
    *,
    block_size: int = 4,
    kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    pad_tokens: int = 0,
) -> Batch:
    """A random ragged batch whose blocks are drawn from a shuffled pool; K/V of the prior context are
    pre-written, this step's K/V are returned separately (slot_mapping places them)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for _, s in reqs]
    width = max(blocks_per_req) + 2  # trailing table entries are never read
    num_blocks = sum(blocks_per_req) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(reqs), width), generator=gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    slots, used = [], 0
    for i, ((q_len, seq_len), n) in enumerate(zip(reqs, blocks_per_req)):
        table[i, :n] = pool[used : used + n]
        used += n
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    tokens = len(slots) + pad_tokens
    slots += [-1] * pad_tokens
    q_lens = [q for q, _ in reqs]
    seq_lens = [s for _, s in reqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(torch.int32).to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        num_decodes=sum(1 for q in q_lens if q == 1),
    )

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    return Batch(
        query=rand(tokens, kv_heads * group, head_dim),
        key=rand(tokens, kv_heads, head_dim),
        value=rand(tokens, kv_heads, head_dim),
        kv_cache=cache.to(dtype).to(device),
        meta=meta,
    )


def _filled(batch: Batch) -> Batch:
    """The batch with this step's K/V written into its cache (what attention reads)."""
    kv_write_ref(batch.key, batch.value, batch.kv_cache, batch.meta.slot_mapping)
    return batch


def _check(batch: Batch, scale: float = 0.3, **kwargs) -> None:
    real = int(batch.meta.query_start_loc[-1])
    got = unified_paged_attention(*batch.attention_args(), scale, *batch.limits(), **kwargs)
    want = attention_ref(*batch.attention_args(), scale, *batch.limits())
    assert got.shape == batch.query.shape and got.dtype == batch.query.dtype
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(got[:real].float(), want[:real].float(), atol=tol, rtol=tol)


def test_reference_matches_sdpa_on_contiguous_prompt():
    """Sanity of the reference itself: a whole prompt equals causal SDPA with GQA."""
    batch = _filled(make_batch([(7, 7)], block_size=4, kv_heads=2, group=3, head_dim=16))
    k, v = (batch.kv_cache[i, batch.meta.block_table[0, :2].long()].flatten(0, 1)[:7] for i in (0, 1))
    want = F.scaled_dot_product_attention(
        batch.query.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=0.5,
        enable_gqa=True,
    ).transpose(0, 1)
    got = attention_ref(*batch.attention_args(), 0.5, *batch.limits())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_gqa_ratios(group, device):
    _check(_filled(make_batch(MIXED, kv_heads=8 // group, group=group, device=device, seed=group)))


@pytest.mark.parametrize(("head_dim", "group"), [(40, 3), (72, 1), (80, 2), (96, 4)])
def test_odd_head_sizes_and_group_sizes(head_dim, group, device):
    _check(
        _filled(make_batch(MIXED, kv_heads=1, group=group, head_dim=head_dim, device=device, seed=head_dim))
    )


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_block_sizes_with_multi_block_contexts(block_size, device):
    reqs = [(1, 37), (9, 41), (1, 17), (2, 33)]
    _check(_filled(make_batch(reqs, block_size=block_size, device=device, seed=block_size)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    _check(_filled(make_batch(MIXED, head_dim=64, dtype=dtype, device=device, seed=11)))


def test_decode_only_batch(device):
    reqs = [(1, 1), (1, 30), (1, 16), (1, 5)]
    _check(_filled(make_batch(reqs, kv_heads=2, group=4, device=device, seed=5)))


def test_long_prefill_chunk_spans_several_query_blocks(device):
    """q_len > BLOCK_Q (64 rows / group 2 = 32 tokens) exercises several query blocks per request."""
    _check(
        _filled(
            make_batch([(40, 52), (1, 7), (35, 35)], kv_heads=1, group=2, head_dim=16, device=device, seed=2)
        )
    )


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_kv_splits_and_tile_sizes_do_not_change_result(splits, device):
    batch = _filled(make_batch([(1, 45), (4, 30), (1, 2)], block_size=8, device=device, seed=splits))
    _check(batch, num_kv_splits=splits, tile_size=32 if splits == 3 else 16, min_keys_per_split=1)


@pytest.mark.parametrize(("tile", "warps", "stages"), [(64, 2, 1), (32, 8, 4)])
def test_decode_launch_shapes_do_not_change_result(tile, warps, stages, device):
    """The decode sweep's knobs (bench/kernel_attention.py --sweep): keys per step, warps, stages."""
    batch = _filled(make_batch([(1, 45), (1, 130), (1, 2), (1, 64)], block_size=16, device=device, seed=tile))
    _check(batch, tile_size=tile, num_warps=warps, num_stages=stages)


class _LaunchRecorder:
    """Stands in for a LazyKernel: records each launch's grid and keyword arguments."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((tuple(grid), kwargs))


@pytest.mark.parametrize(("q_lens", "head_dim", "tuned"), [([1, 1, 1], 128, True), ([1, 1], 64, True),
                                                          ([1, 4, 1], 128, False), ([1, 1], 256, False)])
def test_decode_steps_launch_with_the_tuned_shape(monkeypatch, q_lens, head_dim, tuned):
    """Decode steps with heads up to 128 use the H200 sweep's 32 keys x 2 warps; prefill chunks and larger
    heads (not measured) keep the block-size tile and triton's warps."""
    monkeypatch.setattr(paged_attention, "DECODE_OVERRIDE", {})
    recorder = _LaunchRecorder()
    monkeypatch.setattr(paged_attention, "_attention", recorder)
    batch = make_batch([(q, 40) for q in q_lens], block_size=16, kv_heads=1, group=2, head_dim=head_dim)
    unified_paged_attention(*batch.attention_args(), 1.0, *batch.limits(), num_kv_splits=1)
    (_, kwargs), = recorder.launches
    if tuned:
        assert (kwargs["TILE"], kwargs["num_warps"]) == (32, 2) == tuple(DECODE_DEFAULTS.values())
    else:
        assert kwargs["TILE"] == 16 and "num_warps" not in kwargs


def test_the_environment_overrides_the_tuned_shape(monkeypatch):
    monkeypatch.setattr(paged_attention, "DECODE_OVERRIDE", parse_decode_config("warps=8,stages=1"))
    assert paged_attention.decode_launch_config(128) == {"tile": 32, "warps": 8, "stages": 1}
    assert paged_attention.decode_launch_config(256) == {"warps": 8, "stages": 1}


def test_decode_config_from_the_environment() -> None:
    assert parse_decode_config("tile=64, warps=4,stages=3") == {"tile": 64, "warps": 4, "stages": 3}
    assert parse_decode_config("") == {}
    for bad in ("tile=48", "tile=8", "warps=0", "lanes=4", "warps", "warps=four"):
        with pytest.raises(ValueError, match="TANDEM_DECODE_ATTENTION"):
            parse_decode_config(bad)


# Decodes whose contexts span 1..7 tiles of 16 keys, and a prefill chunk: with up to 9 splits, some
# requests fill every split, others leave most of them empty.
SPLIT_REQS = [(1, 100), (1, 17), (1, 1), (1, 64), (3, 40)]


@pytest.mark.parametrize("splits", range(1, 10))
def test_every_split_count_including_empty_splits(splits, device):
    batch = _filled(make_batch(SPLIT_REQS, block_size=8, device=device, seed=20 + splits))
    _check(batch, num_kv_splits=splits, tile_size=16, min_keys_per_split=1)


@pytest.mark.parametrize(("splits", "min_keys"), [(8, 32), (8, 48), (16, 64), (64, 16)])
def test_min_keys_per_split_leaves_tail_splits_empty(splits, min_keys, device):
    """What a CUDA graph does: splits chosen for the longest context, replayed for short ones. Each
    split gets >= min_keys keys, so short contexts use their first splits and the rest exit early."""
    batch = _filled(make_batch(SPLIT_REQS, block_size=8, device=device, seed=splits + min_keys))
    _check(batch, num_kv_splits=splits, tile_size=16, min_keys_per_split=min_keys)


def test_empty_split_accumulators_are_never_read(device, monkeypatch):
    """The reduction must not read the accumulator of a split that did no work: the partial buffers
    start as NaN, so one read of an unwritten accumulator poisons the output."""
    batch = _filled(make_batch([(1, 20), (1, 3)], block_size=8, device=device, seed=31))
    real_empty = torch.empty

    def nan_filled(*shape, **kw):
        out = real_empty(*shape, **kw)
        return out.fill_(float("nan")) if out.dtype == torch.float32 else out

    monkeypatch.setattr(torch, "empty", nan_filled)  # the kernel wrapper allocates partials with it
    _check(batch, num_kv_splits=8, tile_size=16, min_keys_per_split=16)


def test_decode_with_a_graph_sized_max_seq_len(device):
    """max_seq_len far above every real context (a graph's bound) changes nothing but the split count."""
    batch = _filled(make_batch([(1, 9), (1, 33), (1, 1)], block_size=8, device=device, seed=6))
    real = int(batch.meta.query_start_loc[-1])
    want = attention_ref(*batch.attention_args(), 0.3, *batch.limits())
    got = unified_paged_attention(*batch.attention_args(), 0.3, 1, 4096, num_kv_splits=32, tile_size=16)
    torch.testing.assert_close(got[:real], want[:real], atol=2e-5, rtol=2e-5)


def test_padding_tokens_do_not_disturb_real_rows(device):
    _check(_filled(make_batch(MIXED, device=device, seed=4, pad_tokens=3)))


def test_backend_matches_reference_on_mixed_batch(device):
    batch = make_batch(MIXED, block_size=4, kv_heads=2, group=2, device=device, seed=9, pad_tokens=2)
    cache = batch.kv_cache.clone()
    out = TritonAttentionBackend().forward(batch.query, batch.key, batch.value, cache, batch.meta, 0.25)

    kv_write_ref(batch.key, batch.value, batch.kv_cache, batch.meta.slot_mapping)
    want = attention_ref(*batch.attention_args(), 0.25, *batch.limits())
    real = int(batch.meta.query_start_loc[-1])
    assert torch.equal(cache, batch.kv_cache)
    torch.testing.assert_close(out[:real], want[:real], atol=2e-5, rtol=2e-5)


def test_backend_matches_torch_backend(device):
    torch_backend = pytest.importorskip("engine_svc.attention.torch_backend")
    batch = make_batch(MIXED, block_size=4, kv_heads=2, group=4, head_dim=48, device=device, seed=13)
    # the torch backend keeps blocks head-major: the same cache with block_size and kv_heads swapped
    cache_triton, cache_torch = batch.kv_cache.clone(), batch.kv_cache.transpose(2, 3).contiguous()
    args = (batch.query, batch.key, batch.value)
    got = TritonAttentionBackend().forward(*args, cache_triton, batch.meta, 0.2)
    want = torch_backend.TorchAttentionBackend().forward(*args, cache_torch, batch.meta, 0.2)
    assert torch.equal(cache_triton, cache_torch.transpose(2, 3))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_missing_triton_gives_install_advice(monkeypatch):
    monkeypatch.setattr(_triton, "HAS_TRITON", False)
    with pytest.raises(
        RuntimeError, match=r"pip install 'tandem\[triton\]' or use --attention-backend torch"
    ):
        TritonAttentionBackend()


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = make_batch([(1, 3)])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        unified_paged_attention(*batch.attention_args(), 1.0, *batch.limits())


_LATE_INTERPRET_SCRIPT = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
import engine_svc.attention.triton_backend, kernels.kv_write, kernels.paged_attention
assert "triton" not in sys.modules, "importing the kernels must not import triton"
import triton  # imported before the interpreter is switched on
os.environ["TRITON_INTERPRET"] = "1"
x = torch.zeros(1, 1, 16)
try:
    kernels.kv_write.kv_write(x, x, torch.zeros(2, 1, 1, 1, 16), torch.zeros(1, dtype=torch.int64))
except RuntimeError as e:
    print(e)
"""


def test_imports_stay_triton_free_and_late_interpret_is_explained():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", _LATE_INTERPRET_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "TRITON_INTERPRET=1 was set after triton had been imported" in proc.stdout


# ------------------------------------------------------------------ sliding windows and attention sinks


def _sinks(num_heads: int, device) -> torch.Tensor:
    return (2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(7))).to(device)


def _check_options(batch: Batch, sinks, window, **kwargs) -> None:
    real = int(batch.meta.query_start_loc[-1])
    options = dict(sinks=sinks, sliding_window=window)
    got = unified_paged_attention(*batch.attention_args(), 0.3, *batch.limits(), **options, **kwargs)
    want = attention_ref(*batch.attention_args(), 0.3, *batch.limits(), **options)
    plain = attention_ref(*batch.attention_args(), 0.3, *batch.limits())
    assert not torch.allclose(want[:real], plain[:real])  # the options change the result here
    tol = TOLERANCE[batch.query.dtype]
    torch.testing.assert_close(got[:real].float(), want[:real].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("use_sinks", "window"), [(True, None), (False, 3), (True, 5), (True, 1)])
def test_sinks_and_sliding_windows_match_the_reference(use_sinks, window, device):
    """A window of 3 or 5 over contexts of up to 20 keys in blocks of 4 (whole tiles skipped, partial ones
    masked); a window of 1 (each query sees only itself); sinks alone; both."""
    batch = _filled(make_batch(MIXED, block_size=4, kv_heads=2, group=2, device=device, seed=21))
    _check_options(batch, _sinks(4, device) if use_sinks else None, window, tile_size=16)


@pytest.mark.parametrize("splits", [2, 5])
def test_sinks_and_windows_with_kv_splits(splits, device):
    """Split contexts: the sink joins the reduction once; splits wholly before the window stay empty."""
    batch = _filled(make_batch([(1, 60), (1, 33), (1, 7)], block_size=4, device=device, seed=22))
    _check_options(batch, _sinks(4, device), 24, num_kv_splits=splits, tile_size=16, min_keys_per_split=16)


def test_torch_backend_sinks_and_window_match_the_reference(device):
    torch_backend = pytest.importorskip("engine_svc.attention.torch_backend")
    batch = make_batch(MIXED, block_size=4, kv_heads=2, group=2, device=device, seed=23)
    cache_torch = batch.kv_cache.transpose(2, 3).contiguous()
    sinks = _sinks(4, device)
    got = torch_backend.TorchAttentionBackend().forward(batch.query, batch.key, batch.value, cache_torch,
                                                        batch.meta, 0.3, sinks=sinks, sliding_window=4)
    _filled(batch)
    want = attention_ref(*batch.attention_args(), 0.3, *batch.limits(), sinks=sinks, sliding_window=4)
    real = int(batch.meta.query_start_loc[-1])
    assert torch.equal(cache_torch.transpose(2, 3), batch.kv_cache)
    torch.testing.assert_close(got[:real], want[:real], atol=2e-5, rtol=2e-5)
