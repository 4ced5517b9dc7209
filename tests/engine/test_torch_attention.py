"""TorchAttentionBackend against a dense per-request reference attention."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine_svc.attention import cpu_paged
from engine_svc.attention.backend import AttentionMetadata
from engine_svc.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 8
NUM_HEADS = 4
SCALE = HEAD_DIM**-0.5


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of a context k/v [S, Hkv, D]; causal; GQA by repetition."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    allowed = torch.arange(seq_len)[None, :] <= torch.arange(q_len)[:, None] + (seq_len - q_len)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


class Batch:
    """A ragged batch: each request (q_len, seq_len) with random full-context K/V, its earlier tokens
    already in a cache full of large garbage (so attending to any unwritten slot changes the result).
    The garbage is finite: the backend's contract is a finite cache (zero-initialised, then only model
    K/V), because masked positions are weighted by an exact 0."""

    def __init__(
        self, shape: list[tuple[int, int]], num_kv_heads: int, seed: int, value_seed: int = 0
    ) -> None:
        perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
        gen = torch.Generator().manual_seed(value_seed)
        garbage = torch.Generator().manual_seed(seed + 1000)
        self.cache = 1e4 * torch.randn((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), generator=garbage)
        flat = self.cache.view(2, -1, num_kv_heads, HEAD_DIM)
        self.reqs, tables, slots = [], [], []
        for q_len, seq_len in shape:
            num_blocks = -(-seq_len // BLOCK_SIZE)
            blocks, perm = perm[:num_blocks], perm[num_blocks:]
            req_slots = torch.tensor(
                [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
            )
            k, v = (torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen) for _ in range(2))
            q = torch.randn(q_len, NUM_HEADS, HEAD_DIM, generator=gen)
            old = req_slots[: seq_len - q_len]
            flat[0, old], flat[1, old] = k[: seq_len - q_len], v[: seq_len - q_len]
            self.reqs.append((q, k, v))
            tables.append(blocks)
            slots.append(req_slots[seq_len - q_len :])
        # filled in the contract's token-major layout, handed to the backend in its own (head-major) one
        self.token_major = self.cache
        self.cache = self.cache.transpose(2, 3).contiguous()
        assert self.cache.shape == TorchAttentionBackend.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
        width = max(len(t) for t in tables)
        q_lens = [q for q, _ in shape]
        seq_lens = [s for _, s in shape]
        self.meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
            num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
        )

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.cat([q for q, _, _ in self.reqs])
        k = torch.cat([k[k.shape[0] - q.shape[0] :] for q, k, _ in self.reqs])
        v = torch.cat([v[v.shape[0] - q.shape[0] :] for q, _, v in self.reqs])
        return q, k, v

    def expected(self) -> torch.Tensor:
        return torch.cat([_reference(q, k, v) for q, k, v in self.reqs])


SHAPES = {
    "decodes_only": [(1, 1), (1, 7), (1, 13)],
    "prefill_only": [(9, 9)],
    "prefill_after_context": [(5, 12)],
    "mixed": [(1, 6), (1, 17), (1, 4), (5, 12), (6, 6), (3, 3), (2, 9)],
    # Eleven long and nine short decodes, interleaved: attended in two length groups, then reassembled.
    "decodes_in_length_groups": [(1, 12), (1, 3), (1, 11), (1, 3), (1, 10), (1, 3)] * 3 + [(1, 12), (1, 10)],
}


def test_decodes_are_grouped_by_length():
    from engine_svc.attention.torch_backend import _group_decodes

    lens = [seq_len for _, seq_len in SHAPES["decodes_in_length_groups"]]
    groups = _group_decodes(lens)
    assert len(groups) == 2
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert {lens[i] for i in groups[0]} == {10, 11, 12} and {lens[i] for i in groups[1]} == {3}
    assert _group_decodes([5, 4, 1]) == [[0, 1, 2]]  # too few to split: one group, original order


def native_op_expected() -> bool:
    """The native CPU op must be built wherever it can be (a C++ compiler and ninja: `make install`)."""
    if not (shutil.which("c++") and (shutil.which("ninja") or (Path(sys.executable).parent / "ninja").exists())):
        pytest.skip("no C++ compiler / ninja: the native CPU decode op cannot be built here")
    assert cpu_paged.load() is not None, "the native CPU decode op did not build"
    return True


# How decodes are attended: the native CPU op reading blocks in place; torch's batched GEMMs; one SDPA call.
DECODE_PATHS = {"native": (True, 10**6), "bmm": (False, 1), "sdpa": (False, 10**6)}


def backend_for(path: str, monkeypatch) -> TorchAttentionBackend:
    native, bmm_from = DECODE_PATHS[path]
    monkeypatch.setattr("engine_svc.attention.torch_backend._BMM_MIN_DECODES", bmm_from)
    if native:
        native_op_expected()
    return TorchAttentionBackend(native=native)


@pytest.mark.parametrize("decode_path", list(DECODE_PATHS))
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_dense_reference(shape, num_kv_heads, decode_path, monkeypatch):
    batch = Batch(SHAPES[shape], num_kv_heads, seed=len(shape) + num_kv_heads)
    out = backend_for(decode_path, monkeypatch).forward(*batch.inputs(), batch.cache, batch.meta, SCALE)
    assert out.shape == (sum(q for q, _ in SHAPES[shape]), NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(out, batch.expected(), atol=1e-5, rtol=1e-5)


def test_writes_new_kv_through_slot_mapping_only():
    batch = Batch(SHAPES["mixed"], num_kv_heads=2, seed=3)
    before = batch.token_major.clone()
    _, k, v = batch.inputs()
    TorchAttentionBackend().forward(*batch.inputs(), batch.cache, batch.meta, SCALE)
    after = batch.cache.transpose(2, 3).contiguous()  # back to token-major: slot s = block s // 4, offset s % 4
    flat, flat_before = after.view(2, -1, 2, HEAD_DIM), before.view(2, -1, 2, HEAD_DIM)
    slots = batch.meta.slot_mapping
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    torch.testing.assert_close(flat[:, untouched], flat_before[:, untouched], equal_nan=True)


@pytest.mark.parametrize("decode_path", ["native", "bmm"])
def test_one_metadata_serves_every_layer(decode_path, monkeypatch):
    """The per-step plan is memoised on the metadata; a second layer with its own cache must still
    get its own (correct) attention."""
    shape = SHAPES["mixed"]
    layer0, layer1 = Batch(shape, 2, seed=5, value_seed=1), Batch(shape, 2, seed=5, value_seed=2)
    backend = backend_for(decode_path, monkeypatch)
    backend.forward(*layer0.inputs(), layer0.cache, layer0.meta, SCALE)
    out = backend.forward(*layer1.inputs(), layer1.cache, layer0.meta, SCALE)
    assert not torch.allclose(out, layer0.expected())
    torch.testing.assert_close(out, layer1.expected(), atol=1e-5, rtol=1e-5)


def _model_sized_decodes(dtype: torch.dtype, seed: int, heads: int = 9, kv_heads: int = 3,
                         head_dim: int = 64) -> tuple[torch.Tensor, ...]:
    """Decodes at a real model's shape (SmolLM2: 9 query / 3 KV heads, head_dim 64, 16-token blocks):
    mixed context lengths (one block, a partial last block, several hundred tokens), random block
    tables, the cache outside every context filled with large values. Returns (query, cache,
    block_table, seq_lens, expected) with `expected` computed in float64 from the same rounded inputs."""
    gen = torch.Generator().manual_seed(seed)
    block, num_blocks = 16, 160
    lens = [1, 16, 17, 300, 255, 64, 129, 2]
    width = max(-(-n // block) for n in lens)
    cache = (1e3 * torch.randn(2, num_blocks, kv_heads, block, head_dim, generator=gen)).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    query = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    expected = []
    used = 0
    for r, n in enumerate(lens):
        blocks = perm[used : used + -(-n // block)]
        used += len(blocks)
        table[r, : len(blocks)] = blocks.int()
        kv = torch.randn(2, len(blocks), kv_heads, block, head_dim, generator=gen).to(dtype)
        cache[:, blocks] = kv
        k, v = kv.double().transpose(2, 3).reshape(2, -1, kv_heads, head_dim)[:, :n].unbind(0)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        probs = (torch.einsum("hd,khd->hk", query[r].double(), k) * head_dim**-0.5).softmax(-1)
        expected.append(torch.einsum("hk,khd->hd", probs, v))
    return query, cache, table, torch.tensor(lens, dtype=torch.int32), torch.stack(expected)


@pytest.mark.parametrize("entry", ["paged_decode", "paged_decode_portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_reads_blocks_in_place_at_model_shapes(dtype, entry):
    """Both kernels: the one this CPU runs (bfloat16 keys scored with AVX512-BF16 where the build has
    it) and the portable one every CPU can run."""
    native_op_expected()
    op = cpu_paged.load()
    query, cache, table, lens, expected = _model_sized_decodes(dtype, seed=7)
    before = cache.clone()
    # the query as the model hands it over: a view of the fused qkv projection's rows
    qkv = torch.cat([query, torch.full((query.shape[0], 6, query.shape[2]), 1e4, dtype=dtype)], dim=1)
    out = getattr(op, entry)(qkv[:, :9], cache, table, lens, 64**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.equal(cache, before)
    # float32: exact up to summation order; bfloat16: float32 accumulation, only the output rounded
    # (one bf16 ulp of values ~1), which a bf16 accumulation over hundreds of positions would exceed.
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(5, 1, 32), (10, 2, 48), (8, 1, 128), (4, 2, 96)])
def test_native_bfloat16_decode_at_other_groups_and_head_dims(heads, kv_heads, head_dim):
    """The AVX512-BF16 path's other shapes: query groups of 5 and 8 (passes of up to 4 rows), 2 and 1;
    head dims whose key pairs come from a register transpose (32, 96, 128: multiples of 32) and from a
    gather (48); head_dim 64 alone sums values in registers. Each equals the float64 reference and the
    portable kernel."""
    native_op_expected()
    op = cpu_paged.load()
    query, cache, table, lens, expected = _model_sized_decodes(torch.bfloat16, 11, heads, kv_heads, head_dim)
    out = op.paged_decode(query, cache, table, lens, head_dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=8e-3, rtol=8e-3)
    portable = op.paged_decode_portable(query, cache, table, lens, head_dim**-0.5)
    torch.testing.assert_close(out, portable, atol=8e-3, rtol=8e-3)


def test_native_decode_uses_avx512_bf16_where_the_cpu_has_it():
    """A -march=native build on a CPU with AVX512-BF16 must score bfloat16 keys with it (the fast path
    is not silently lost to a build flag)."""
    native_op_expected()
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert cpu_paged.load().has_avx512_bf16() == ("avx512_bf16" in flags)


def test_native_decode_refuses_tables_that_do_not_cover_the_context():
    native_op_expected()
    query, cache, table, lens, _ = _model_sized_decodes(torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        cpu_paged.load().paged_decode(query, cache, table[:, :2].contiguous(), lens, 0.125)
    bad = table.clone()
    bad[0, 0] = cache.shape[1]
    with pytest.raises(RuntimeError, match="block out of range"):
        cpu_paged.load().paged_decode(query, cache, bad, lens, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_uses_the_native_op_on_cpu_and_matches_the_torch_path(dtype, monkeypatch):
    """The backend's CPU decodes go through the native op (no gather workspace is allocated) and agree
    with the torch path."""
    native_op_expected()
    batch = Batch(SHAPES["mixed"], num_kv_heads=2, seed=11)
    inputs = [t.to(dtype) for t in batch.inputs()]
    native = TorchAttentionBackend()
    out = native.forward(*inputs, batch.cache.to(dtype), batch.meta, SCALE)
    assert not native._workspace
    monkeypatch.setattr("engine_svc.attention.torch_backend._BMM_MIN_DECODES", 1)
    reference = TorchAttentionBackend(native=False)
    meta = Batch(SHAPES["mixed"], num_kv_heads=2, seed=11).meta  # a fresh plan (the first was made without decode groups)
    want = reference.forward(*inputs, batch.cache.to(dtype), meta, SCALE)
    assert reference._workspace
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
