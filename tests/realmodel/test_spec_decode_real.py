"""Speculative decoding (ngram, and a draft model) on SmolLM2-135M-Instruct: greedy float32 output equal
to transformers' and to plain decoding, on input-grounded prompts (repeat, quote, edit) where prompt lookup's drafts are
accepted, and on an open question where they mostly are not; acceptance counted, every block back."""

from __future__ import annotations

from pathlib import Path

import pytest

from entrypoints import LLM, SamplingParams
from frontend_svc.outputs import RequestOutput
from tests.realmodel.support import chat

pytestmark = pytest.mark.slow  # a 135M model and its transformers oracle: `make test`, not `make test-fast`

MAX_TOKENS = 48
GROUNDED = (
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog while the cat sleeps.",
    "Copy this list: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Rewrite this code with the variable x renamed to y: def f(x):\n    return x * x + x",
)
OPEN = ("Write a haiku about the sea.",)
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)


@pytest.fixture(scope="module")
def plain(smollm2_dir: Path) -> dict[str, RequestOutput]:
    """Plain float32 greedy decoding of every question here (both tests' oracle besides transformers), one
    batch, by question: one engine for the module."""
    llm = LLM(str(smollm2_dir), dtype="float32")
    outs = llm.chat([chat(q) for q in GROUNDED + OPEN], PARAMS, use_tqdm=False)
    llm.engine.shutdown()
    return dict(zip(GROUNDED + OPEN, outs, strict=True))


def test_greedy_speculation_equals_transformers_and_plain(smollm2_dir: Path, chat_ids, hf_greedy,
                                                          plain: dict[str, RequestOutput]) -> None:
    questions = GROUNDED + OPEN
    conversations = [chat(q) for q in questions]
    plain_outs = [plain[q] for q in questions]
    spec = LLM(str(smollm2_dir), dtype="float32", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    spec_outs = spec.chat(conversations, PARAMS, use_tqdm=False)
    for question, a, b in zip(questions, plain_outs, spec_outs):
        assert b.outputs[0].token_ids == hf_greedy(chat_ids(question), MAX_TOKENS)[: len(b.outputs[0].token_ids)]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, question
        assert b.outputs[0].text == a.outputs[0].text and b.outputs[0].finish_reason == a.outputs[0].finish_reason
        assert [e.logprob for e in b.outputs[0].logprobs] == pytest.approx(
            [e.logprob for e in a.outputs[0].logprobs], abs=1e-3)
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens > 0
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    spec.engine.shutdown()


def test_greedy_draft_model_equals_transformers_and_plain(smollm2_dir: Path, chat_ids, hf_greedy,
                                                          plain: dict[str, RequestOutput], tmp_path: Path) -> None:
    """A draft cut from SmolLM2's first 8 layers (entrypoints/layer_draft.py): the same tokens and
    logprobs as plain decoding and transformers; some drafts accepted; every block back."""
    from entrypoints.layer_draft import make_layer_draft

    draft = make_layer_draft(smollm2_dir, tmp_path / "draft", 8)
    questions = GROUNDED[:2] + OPEN
    conversations = [chat(q) for q in questions]
    plain_outs = [plain[q] for q in questions]
    spec = LLM(str(smollm2_dir), dtype="float32", speculative_config={
        "method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    spec_outs = spec.chat(conversations, PARAMS, use_tqdm=False)
    for question, a, b in zip(questions, plain_outs, spec_outs):
        assert b.outputs[0].token_ids == hf_greedy(chat_ids(question), MAX_TOKENS)[: len(b.outputs[0].token_ids)]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, question
        assert [e.logprob for e in b.outputs[0].logprobs] == pytest.approx(
            [e.logprob for e in a.outputs[0].logprobs], abs=1e-3)
    stats = spec.engine.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
    spec.engine.shutdown()
