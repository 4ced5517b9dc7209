"""The engine with the Triton attention backend (kernels run by the interpreter on CPU) must equal
transformers token for token, through chunked prefill, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from engine_svc import LLM, SamplingParams
from tests.engine.test_hf_exact import MAX_TOKENS, PREEMPT_ARGS, hf_greedy, make_prompts, preempt_prompts

pytestmark = pytest.mark.slow  # the interpreter runs every kernel launch in Python


def _greedy(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_matches_transformers(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    # A 16-token budget: prompts are prefilled in chunks that attend to earlier context in the cache.
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", block_size=8, max_num_batched_tokens=16)
    assert llm.config.resolved_attention_backend == "triton"
    shared = make_prompts(7, 1, 500, lo=17, hi=17)[0]
    prompts = [shared + tail for tail in make_prompts(8, 3, 500, lo=2, hi=6)]
    outs = _greedy(llm, prompts)
    again = _greedy(llm, prompts[:1])  # every full block of this prompt is cached now
    assert again[0].num_cached_tokens >= 16
    for prompt, out in zip(prompts + prompts[:1], outs + again):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]


def test_triton_backend_under_preemption_matches_transformers(make_model) -> None:
    model_dir = make_model("qwen2")
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", **PREEMPT_ARGS)
    prompts = preempt_prompts(3)
    outs = _greedy(llm, prompts)
    assert llm.engine.get_stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
