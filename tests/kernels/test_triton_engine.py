"""The engine with the Triton attention backend (kernels run by the interpreter on CPU) must equal
transformers token for token, through chunked prefill, prefix-cache hits and preemption.

With the Triton backend the model runs its fused kernels too (norms, q/k-norm + RoPE + KV-cache write,
SiLU-and-mul, and a MoE model's grouped-GEMM experts): each test checks they were launched, and that the
backend's separate KV write was not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from entrypoints import LLM, SamplingParams
from kernels import activation, fused_moe, kv_write, paged_attention, rms_norm, rope
from tests.engine.test_hf_exact import MAX_TOKENS, PREEMPT_ARGS, hf_greedy, make_prompts, preempt_prompts

pytestmark = pytest.mark.slow  # the interpreter runs every kernel launch in Python

FUSED = {"rms_norm": rms_norm._kernel, "rope": rope._kernel, "silu_and_mul": activation._kernel}


@contextmanager
def fused_kernels_proven(llm: LLM) -> Iterator[None]:
    """Asserts that the block launched every fused kernel and attention, and never the separate KV write."""
    assert llm.engine.executor.worker.model.fused_kernels
    kernels = {**FUSED, "attention": paged_attention._attention, "kv_write": kv_write._kernel,
               "fused_moe": fused_moe._kernel}
    arch = llm.engine.executor.worker.model.config.architectures[0]
    moe = arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
    # gpt-oss's experts use clamped SwiGLU (torch ops between the grouped GEMMs), no SiLU-and-mul anywhere
    expected = [name for name in (*FUSED, "attention") if not (name == "silu_and_mul" and arch == "GptOssForCausalLM")]
    before = {name: k.launches for name, k in kernels.items()}
    yield
    launched = {name: k.launches - before[name] for name, k in kernels.items()}
    assert launched["kv_write"] == 0, launched
    assert all(launched[name] > 0 for name in expected), launched
    assert (launched["fused_moe"] > 0) == moe, launched


def _greedy(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss"])
def test_triton_backend_matches_transformers(make_model, arch: str) -> None:
    model_dir = make_model(arch)
    # A 16-token budget: prompts are prefilled in chunks that attend to earlier context in the cache.
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", block_size=8, max_num_batched_tokens=16)
    assert llm.config.resolved_attention_backend == "triton"
    shared = make_prompts(7, 1, 500, lo=17, hi=17)[0]
    prompts = [shared + tail for tail in make_prompts(8, 3, 500, lo=2, hi=6)]
    with fused_kernels_proven(llm):
        outs = _greedy(llm, prompts)
    again = _greedy(llm, prompts[:1])  # every full block of this prompt is cached now
    assert again[0].num_cached_tokens >= 16
    for prompt, out in zip(prompts + prompts[:1], outs + again):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]


def test_triton_backend_under_preemption_matches_transformers(make_model) -> None:
    model_dir = make_model("qwen2")
    llm = LLM(str(model_dir), dtype="float32", attention_backend="triton", **PREEMPT_ARGS)
    prompts = preempt_prompts(3)
    with fused_kernels_proven(llm):
        outs = _greedy(llm, prompts)
    assert llm.engine.get_stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, MAX_TOKENS)[0]
