"""Sliding-window models through the engine against transformers, with KV blocks freed behind the window.

Tiny random Mistral and Qwen2 models whose every layer slides over 8 tokens (prompts of 10-40 tokens
outgrow it many times over), blocks of 4: float32 greedy tokens and logprobs equal transformers' (a
full recompute per token, its own sliding-window mask), with chunked prefill, async scheduling,
speculative decoding (n-gram drafts verified as multi-token steps),
preemption under a tiny cache and prefix-cache hits. Each run also checks that blocks really were
freed (no request ever holds more than its window's and its step's blocks) and that every block is
back in the pool at the end. A Qwen2 whose first layer attends to everything (hybrid) keeps its blocks
with --disable-hybrid-kv-cache-manager and is exact too (tests/engine/test_hybrid_kv.py: its KV groups).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine_svc.kv.kv_cache_manager import NULL_BLOCK
from entrypoints import LLM, SamplingParams
from tests.engine.test_hf_exact import (
    MAX_TOKENS,
    assert_greedy_matches_hf,
    assert_no_block_leaks,
    hf_greedy,
    make_prompts,
)

WINDOW, BS = 8, 4


def windowed(make_model, tmp_path_factory, arch: str, **fields) -> Path:
    """A copy of the tiny `arch` model whose config.json sets `fields` (drops `layer_types`, so Qwen2
    derives them from max_window_layers as transformers does)."""
    src = make_model(arch)
    dst = tmp_path_factory.mktemp(f"{arch}-window") / "model"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("layer_types", None)
    (dst / "config.json").write_text(json.dumps({**config, **fields}))
    return dst


@pytest.fixture(scope="module")
def mistral(make_model, tmp_path_factory) -> Path:
    return windowed(make_model, tmp_path_factory, "mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2(make_model, tmp_path_factory) -> Path:
    return windowed(make_model, tmp_path_factory, "qwen2", sliding_window=WINDOW, use_sliding_window=True,
                    max_window_layers=0)


def run_windowed(model_dir: Path, prompts: list[list[int]], expect_window: int | None, **engine_args):
    """Generate greedily with the engine, recording after every step the most real blocks any running
    request holds; compare tokens and logprobs with transformers; check no block leaked."""
    llm = LLM(str(model_dir), dtype="float32", block_size=BS, **engine_args)
    assert llm.config.kv_sliding_window == expect_window
    scheduler = llm.engine.scheduler
    most_held: list[int] = []
    step = llm.engine.step

    def recording_step():
        out = step()
        tables = [scheduler.kv._tables.get(r.request_id, []) for r in scheduler.running]
        most_held.append(max((sum(b is not NULL_BLOCK for b in t) for t in tables), default=0))
        return out

    llm.engine.step = recording_step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    assert_greedy_matches_hf(model_dir, prompts, llm.generate(prompts, params, use_tqdm=False))
    assert_no_block_leaks(llm)
    return llm, max(most_held)


def chunk_bound(chunk: int) -> int:
    """The most blocks a request may hold computing `chunk` tokens: its window's keys and the chunk."""
    return -(-(WINDOW - 1 + chunk) // BS) + 1


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_windowed_models_match_transformers_while_freeing(request, arch: str) -> None:
    model_dir = request.getfixturevalue(arch)
    prompts = make_prompts(11, 5, 500, lo=20, hi=40)
    _, most = run_windowed(model_dir, prompts, WINDOW, max_num_batched_tokens=16)
    assert most <= chunk_bound(16) < -(-(40 + MAX_TOKENS) // BS)


def test_async_scheduling_and_preemption_with_freeing(mistral: Path) -> None:
    """Eight blocks for five requests: preempted and resumed (recomputed) while freeing; async
    scheduling keeps placeholders in flight across the freed blocks."""
    prompts = make_prompts(12, 5, 500, lo=10, hi=20)
    llm, most = run_windowed(mistral, prompts, WINDOW, num_gpu_blocks_override=8, max_num_batched_tokens=16,
                             async_scheduling=True)
    assert llm.engine.get_stats().num_preemptions > 0
    assert most <= 8


def test_prefix_hits_with_freed_blocks_match_transformers(mistral: Path) -> None:
    """A shared 33-token prefix, run once; then its first six blocks are evicted from the cache (as the
    pool would when it hands them out). The second wave still hits 32 tokens: position 32 reads blocks 6
    and 7 only, which are cached; blocks 0-5 are placeholders no kernel reads. Tokens equal transformers'."""
    shared = make_prompts(13, 1, 500, lo=33, hi=33)[0]
    prompts = [shared + tail for tail in make_prompts(14, 3, 500, lo=2, hi=9)]
    llm = LLM(str(mistral), dtype="float32", block_size=BS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)
    pool = llm.engine.scheduler.kv.pool
    early = {tuple(shared[i * BS : (i + 1) * BS]) for i in range(6)}
    evicted = 0
    for block in pool.blocks:
        if block.token_ids in early:
            assert block.ref_cnt == 0
            pool.uncache(block)
            evicted += 1
    assert evicted == 6
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    for prompt, out in zip(prompts[1:], rest):
        assert out.num_cached_tokens == 32
        assert out.outputs[0].token_ids == hf_greedy(mistral, prompt, MAX_TOKENS)[0]
    assert_no_block_leaks(llm)


def test_a_hybrid_model_keeps_its_blocks_and_matches(make_model, tmp_path_factory) -> None:
    """Qwen2 with max_window_layers=1: layer 0 attends to everything, layer 1 slides; without its KV groups
    nothing is freed."""
    model_dir = windowed(make_model, tmp_path_factory, "qwen2", sliding_window=WINDOW, use_sliding_window=True,
                         max_window_layers=1)
    prompts = make_prompts(15, 3, 500, lo=20, hi=30)
    llm, most = run_windowed(model_dir, prompts, None, disable_hybrid_kv_cache_manager=True)
    assert llm.config.kv_group_windows is None
    assert llm.engine.scheduler.kv.sliding_window is None
    # the longest prompt's blocks after its prefill, then more while decoding (freeing would drop to 3)
    assert most > -(-max(map(len, prompts)) // BS)


def test_speculative_decoding_with_freeing_matches_transformers(mistral: Path) -> None:
    """n-gram drafts verified as multi-token steps over freed blocks (repetitive prompts, so the
    proposer drafts): still transformers' tokens and logprobs."""
    prompts = [(p * 6)[:24 + 3 * i] for i, p in enumerate(make_prompts(16, 3, 500, lo=3, hi=5))]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    llm, _ = run_windowed(mistral, prompts, WINDOW, speculative_config=spec)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0
