"""The native CPU decode op with attention sinks and sliding windows (gpt-oss, Mistral-style models).

- Against a float64 reference at model shapes (head_dim 64, 16-token blocks: the AVX512-BF16 kernels where
  the CPU has them; and 5-token blocks: the portable loops), float32 and bfloat16, both entries: the sink
  joins the softmax's max and denominator; the window starts each request's keys at seq_len - W. The
  table entries of the blocks before a request's window point at a block full of NaN (as a freed block's
  stale entry may point at another request's K/V): the op must never read them, nor check them.
- The torch backend's windowed / sink layers send their decodes to the op and their prefills to the
  torch path, and equal the all-torch path (native=False) on a mixed batch.
- gpt-oss through the engine: its decodes take the native op, greedy tokens and logprobs equal
  transformers'.
"""

from __future__ import annotations

import pytest
import torch

from engine_svc.attention import cpu_paged
from engine_svc.attention.torch_backend import TorchAttentionBackend
from tests.engine.test_cpu_fused_ops import _Spy
from tests.engine.test_torch_attention import SCALE, Batch, native_op_expected

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
LENS = [1, 16, 17, 300, 255, 64, 129, 2, 33]


def _decodes(dtype: torch.dtype, block: int, window: int, seed: int):
    """(query, cache, block_table, seq_lens, sinks, expected): decodes of mixed lengths over random blocks,
    every table entry before a request's window pointing at a NaN block; `expected` in float64."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in LENS)
    num_blocks = sum(-(-n // block) for n in LENS) + 1
    cache = (1e3 * torch.randn(2, num_blocks, KV_HEADS, block, HEAD_DIM, generator=gen)).to(dtype)
    poisoned = num_blocks - 1
    cache[:, poisoned] = float("nan")
    perm = torch.randperm(num_blocks - 1, generator=gen)
    table = torch.full((len(LENS), width), 10**6, dtype=torch.int32)  # out of range past the context
    query = torch.randn(len(LENS), HEADS, HEAD_DIM, generator=gen).to(dtype)
    sinks = (2 * torch.randn(HEADS, generator=gen)).to(dtype)
    expected, used = [], 0
    for r, n in enumerate(LENS):
        blocks = perm[used : used + -(-n // block)]
        used += len(blocks)
        kv = torch.randn(2, len(blocks), KV_HEADS, block, HEAD_DIM, generator=gen).to(dtype)
        cache[:, blocks] = kv
        lo = max(0, n - window) if window else 0
        table[r, : len(blocks)] = blocks.int()
        table[r, : lo // block] = poisoned
        k, v = kv.double().transpose(2, 3).reshape(2, -1, KV_HEADS, HEAD_DIM)[:, lo:n].unbind(0)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        scores = torch.einsum("hd,khd->hk", query[r].double(), k) * HEAD_DIM**-0.5
        scores = torch.cat([scores, sinks.double().unsqueeze(1)], dim=1)
        expected.append(torch.einsum("hk,khd->hd", scores.softmax(-1)[:, :-1], v))
    return query, cache, table, torch.tensor(LENS, dtype=torch.int32), sinks, torch.stack(expected)


@pytest.mark.parametrize("entry", ["paged_decode", "paged_decode_portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("block", "window"), [(16, 40), (16, 128), (5, 23), (16, 0)])
def test_sinks_and_window_match_the_reference(entry, dtype, block, window):
    native_op_expected()
    query, cache, table, lens, sinks, expected = _decodes(dtype, block, window, seed=block + window)
    out = getattr(cpu_paged.load(), entry)(query, cache, table, lens, HEAD_DIM**-0.5, sinks, window)
    assert not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_without_sinks_and_window_the_op_is_unchanged():
    """Omitted sinks / window 0 are plain causal decode (the keyword defaults)."""
    native_op_expected()
    query, cache, table, lens, _, _ = _decodes(torch.float32, 16, 0, seed=3)
    op = cpu_paged.load()
    plain = op.paged_decode(query, cache, table, lens, 0.125)
    torch.testing.assert_close(op.paged_decode(query, cache, table, lens, 0.125, None, 0), plain, atol=0, rtol=0)
    with_sinks = op.paged_decode(query, cache, table, lens, 0.125, torch.zeros(HEADS), 0)
    assert not torch.allclose(with_sinks, plain)  # a zero logit still joins the denominator
    with pytest.raises(RuntimeError, match="sinks must be"):
        op.paged_decode(query, cache, table, lens, 0.125, torch.zeros(HEADS + 1), 0)


@pytest.mark.parametrize(("sinks", "window"), [(True, 5), (True, None), (False, 5)])
def test_backend_sends_windowed_decodes_to_the_native_op(sinks, window):
    """A mixed batch (decodes, prefills after a context) of a windowed / sink layer: native decodes plus
    torch prefills equal the all-torch path."""
    native_op_expected()
    batch = Batch([(1, 6), (1, 17), (1, 4), (5, 12), (6, 6), (2, 9)], num_kv_heads=2, seed=9)
    logits = torch.randn(4, generator=torch.Generator().manual_seed(1)) if sinks else None
    native, reference = TorchAttentionBackend(native=True), TorchAttentionBackend(native=False)
    calls = []
    real = native._native_decode
    native._native_decode = lambda q, c: calls.append(1) or real(q, c)  # type: ignore[method-assign]
    cache = batch.cache.clone()
    got = native.forward(*batch.inputs(), cache, batch.meta, SCALE, sinks=logits, sliding_window=window)
    for memo in ("_torch_attention_plan", "_torch_attention_contexts"):  # nothing shared between the two
        batch.meta.__dict__.pop(memo, None)
    want = reference.forward(*batch.inputs(), batch.cache, batch.meta, SCALE, sinks=logits, sliding_window=window)
    assert calls, "the decodes did not take the native op"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gpt_oss_decodes_natively_and_equals_transformers(make_model, monkeypatch):
    from tests.engine.test_hf_exact import make_prompts, run_and_compare

    native_op_expected()
    spy = _Spy(cpu_paged.load())
    monkeypatch.setattr(cpu_paged, "load", lambda: spy)
    run_and_compare(make_model("gpt_oss"), make_prompts(17, 3, 500, lo=10, hi=30))
    assert "paged_decode" in spy.called
