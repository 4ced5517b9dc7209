"""The oracle: greedy float32 outputs must equal Hugging Face transformers token for token.

Each scenario runs a batch of prompts of mixed lengths through the offline LLM API and compares every
completion with a plain transformers greedy loop (full recompute each step, no cache). Scenarios cover
every architecture, chunked prefill under a tiny token budget, forced preemption (a KV cache too small
for the batch), prefix-cache hits on repeated prompts, and logprobs against log_softmax.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from entrypoints import LLM, SamplingParams
from tests.conftest import ARCHS

MAX_TOKENS = 12


def make_prompts(seed: int, count: int, vocab: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@cache
def hf_model(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with transformers, recomputing the whole sequence each step."""
    model = hf_model(model_dir)
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return ids[len(prompt):], logprobs


def run_and_compare(model_dir: Path, prompts: list[list[int]], **engine_args) -> list:
    llm = LLM(str(model_dir), dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_greedy_matches_hf(model_dir, prompts, outs)
    assert_no_block_leaks(llm)
    return outs


def assert_greedy_matches_hf(model_dir: Path, prompts: list[list[int]], outs: list) -> None:
    """Each output (greedy, `logprobs=0`, MAX_TOKENS, ignore_eos) is transformers' tokens and logprobs."""
    for prompt, out in zip(prompts, outs):
        expected, expected_lp = hf_greedy(model_dir, prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == expected, f"prompt len {len(prompt)}"
        got_lp = [entry.logprob for entry in got.logprobs]
        assert got_lp == pytest.approx(expected_lp, abs=1e-4)
        assert got.finish_reason == "length"


def assert_no_block_leaks(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    run_and_compare(model_dir, make_prompts(1, 6, 500))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(make_model, arch: str) -> None:
    # A 16-token budget splits every long prompt into chunks and mixes them with decodes.
    model_dir = make_model(arch)
    run_and_compare(model_dir, make_prompts(2, 5, 500), max_num_batched_tokens=16, block_size=8)


# Five short prompts are all admitted into 12 blocks of 4 tokens, then outgrow them while decoding:
# the scheduler must preempt (recompute) from the tail and still produce exactly HF's tokens.
PREEMPT_ARGS = dict(num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=64)


def preempt_prompts(seed: int) -> list[list[int]]:
    return make_prompts(seed, 5, 500, lo=5, hi=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_transformers(make_model, arch: str) -> None:
    outs = run_and_compare(make_model(arch), preempt_prompts(3), **PREEMPT_ARGS)
    assert len(outs) == 5


def test_preemption_actually_happens(make_model) -> None:
    llm = LLM(str(make_model("llama")), dtype="float32", **PREEMPT_ARGS)
    llm.generate(preempt_prompts(3), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                 use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert_no_block_leaks(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_transformers(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    shared = make_prompts(4, 1, 500, lo=33, hi=33)[0]
    prompts = [shared + tail for tail in make_prompts(5, 4, 500, lo=2, hi=9)]
    llm = LLM(str(model_dir), dtype="float32", block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:] + prompts[:1], params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    for prompt, out in zip(prompts[1:] + prompts[:1], rest):
        assert out.num_cached_tokens >= 32  # the 4 full shared blocks
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
    assert_no_block_leaks(llm)


def test_priority_policy_with_preemption_matches_transformers(make_model) -> None:
    model_dir = make_model("llama")
    prompts = preempt_prompts(6)
    llm = LLM(str(model_dir), dtype="float32", scheduling_policy="priority", **PREEMPT_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[3, 1, 4, 0, 2])
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
    assert llm.engine.get_stats().num_preemptions > 0
    assert_no_block_leaks(llm)


def test_long_prefill_threshold_matches_transformers(make_model) -> None:
    """A 5-token per-request prefill cap (vLLM's long_prefill_token_threshold) while others decode: a
    32-token budget staggers the prompts, so later ones are prefilled 5 tokens a step beside running
    decodes - and their prompt logprobs, computed chunk by chunk, are transformers' log_softmax."""
    model_dir = make_model("llama")
    prompts = make_prompts(7, 5, 500, lo=20, hi=40)
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=2, max_num_batched_tokens=32,
              long_prefill_token_threshold=5, block_size=8)
    steps: list[dict[str, int]] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        so = schedule()
        steps.append(dict(so.num_scheduled_tokens))
        return so

    llm.engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert any(sorted(step.values()) == [1, 5] for step in steps)  # a decode beside a capped prefill chunk
    model = hf_model(model_dir)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
        with torch.no_grad():
            expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert entry is not None and entry.token_id == prompt[pos]
            assert entry.logprob == pytest.approx(float(expected[pos - 1, prompt[pos]]), abs=1e-4)
    assert_no_block_leaks(llm)
