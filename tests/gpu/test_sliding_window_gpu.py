"""Sliding-window KV freeing on CUDA (Triton attention: windows skip whole tiles, partly-seen tiles mask
the positions before the window): a tiny Mistral sliding over 8 tokens, float32, prompts of 20-40 tokens,
under chunked prefill and a cache small enough to preempt. Greedy tokens equal transformers', and equal
the same engine keeping every block (--disable-hybrid-kv-cache-manager), with every block back at the end;
and the same for tiny gpt-oss with its hybrid KV groups (one block table per attention type)."""

from __future__ import annotations

import pytest
import torch

from entrypoints import LLM, SamplingParams
from tests.engine.test_hf_exact import MAX_TOKENS, assert_no_block_leaks, hf_greedy, make_prompts
from tests.engine.test_hybrid_kv_groups import with_windows
from tests.engine.test_sliding_window_hf import WINDOW, windowed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _generate(model_dir, prompts, **args):
    llm = LLM(str(model_dir), dtype="float32", device="cuda", attention_backend="triton", block_size=4,
              num_gpu_blocks_override=24, max_num_batched_tokens=16, **args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_block_leaks(llm)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_freeing_on_cuda_matches_transformers_and_keeping_every_block(make_model, tmp_path_factory) -> None:
    model_dir = windowed(make_model, tmp_path_factory, "mistral", sliding_window=WINDOW)
    prompts = make_prompts(21, 6, 500, lo=20, hi=40)
    freeing, freed_tokens = _generate(model_dir, prompts)
    assert freeing.config.kv_sliding_window == WINDOW
    _, kept_tokens = _generate(model_dir, prompts, disable_hybrid_kv_cache_manager=True)
    assert freed_tokens == kept_tokens
    for prompt, got in zip(prompts, freed_tokens):
        assert got == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]


def test_hybrid_kv_groups_on_cuda_match_transformers_and_one_table(make_model) -> None:
    """Tiny gpt-oss (sliding and full layers in turn, window 8) with its KV groups on CUDA: Triton
    attention, the fused rotary kernel writing each group's slots, decode steps replayed from CUDA graphs
    (whose metadata holds both groups' tables), prefix hits over a shared prefix, a pool small enough to
    reuse freed blocks. Greedy tokens equal one table's (--disable-hybrid-kv-cache-manager) and
    transformers'."""
    model_dir = make_model("gpt_oss")
    shared = make_prompts(41, 1, 500, lo=20, hi=20)[0]
    prompts = [shared + tail for tail in make_prompts(42, 4, 500, lo=2, hi=12)]
    runs = {}
    for hybrid in (True, False):
        llm = LLM(str(model_dir), dtype="float32", device="cuda", attention_backend="triton", block_size=4,
                  num_gpu_blocks_override=48, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=not hybrid)
        assert llm.config.kv_group_windows == ((None, WINDOW) if hybrid else None)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        runs[hybrid] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_block_leaks(llm)
        graphs = llm.engine.executor.worker.runner.cuda_graphs  # type: ignore[attr-defined]
        assert graphs is not None and graphs.num_replays > 0
        assert llm.engine.get_stats().prefix_cache_hits > 0
    assert runs[True] == runs[False]
    for prompt, got in zip(prompts, runs[True]):
        assert got == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]


def test_unequal_kv_groups_on_cuda_match_transformers_and_one_table(make_model, tmp_path_factory) -> None:
    """A tiny Qwen3 of 1 full + 3 sliding layers (window 8): four KV groups of one layer, so four slot rows
    in the staging buffers and the CUDA graphs' metadata; the same checks as above."""
    model_dir = with_windows(make_model, tmp_path_factory, "qwen3", 4, layer_types=["sliding_attention",
                             "full_attention", "sliding_attention", "sliding_attention"])
    shared = make_prompts(43, 1, 500, lo=20, hi=20)[0]
    prompts = [shared + tail for tail in make_prompts(44, 4, 500, lo=2, hi=12)]
    runs = {}
    for hybrid in (True, False):
        llm = LLM(str(model_dir), dtype="float32", device="cuda", attention_backend="triton", block_size=4,
                  num_gpu_blocks_override=96, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=not hybrid)
        assert llm.config.kv_group_windows == ((None, WINDOW, WINDOW, WINDOW) if hybrid else None)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        runs[hybrid] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_block_leaks(llm)
        graphs = llm.engine.executor.worker.runner.cuda_graphs  # type: ignore[attr-defined]
        assert graphs is not None and graphs.num_replays > 0
    assert runs[True] == runs[False]
    for prompt, got in zip(prompts, runs[True]):
        assert got == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
