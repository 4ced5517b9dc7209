"""bfloat16 on a GPU agrees with Hugging Face transformers (bfloat16, same GPU), vLLM-style.

Token-exact agreement is not expected in bf16: both sides round differently, and on near-ties greedy
picks can differ. As vLLM's `check_logprobs_close`: walk each completion; at the first position where
the tokens differ, each side's token must be in the other's top-5 there, and the comparison stops (what
follows is conditioned on different text). Before that, the chosen tokens' logprobs must agree within
LOGPROB_TOL nats. The engine runs as served: triton attention with decode CUDA graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOP_K = 5
MAX_TOKENS = 24
LOGPROB_TOL = 0.5  # nats; bf16 logits of these tiny models are off by ~0.05 at most


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in (4, 17, 30, 52)]


@torch.no_grad()
def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], list[float], list[set[int]]]:
    """Greedy with the HF KV cache: (tokens, their logprobs, top-k ids at each position)."""
    out = model(torch.tensor([prompt], device="cuda"), use_cache=True)
    tokens: list[int] = []
    logprobs: list[float] = []
    tops: list[set[int]] = []
    for _ in range(MAX_TOKENS):
        lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
        tops.append(set(lp.topk(TOP_K).indices.tolist()))
        out = model(torch.tensor([[token]], device="cuda"), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs, tops


def _tandem_greedy(model_dir, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list[set[int]]]]:
    from entrypoints import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", device="cuda", attention_backend="triton",
              max_model_len=256, max_num_seqs=8)
    assert llm.engine.executor.worker.runner.cuda_graphs is not None
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    results = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        entries = completion.logprobs or []
        results.append((completion.token_ids, [e.logprob for e in entries],
                        [{tid for tid, _ in e.top} for e in entries]))
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_agrees_with_transformers(make_model, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_model(arch)
    prompts = _prompts(500)
    ours = _tandem_greedy(model_dir, prompts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    compared = 0
    for prompt, (tokens, logprobs, tops) in zip(prompts, ours, strict=True):
        ref_tokens, ref_logprobs, ref_tops = _hf_greedy(hf, prompt)
        assert len(tokens) == len(logprobs) == len(tops) == MAX_TOKENS
        for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
            if a != b:
                assert a in ref_tops[i], f"prompt len {len(prompt)}, pos {i}: ours {a} not in HF top-{TOP_K}"
                assert b in tops[i], f"prompt len {len(prompt)}, pos {i}: HF {b} not in our top-{TOP_K}"
                break
            assert logprobs[i] == pytest.approx(ref_logprobs[i], abs=LOGPROB_TOL), f"pos {i}"
            compared += 1
    assert compared >= MAX_TOKENS // 2  # not vacuous: a fair share agreed before any divergence
