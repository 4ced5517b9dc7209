"""A continuation (`EngineCoreRequest.output_token_ids`: a request moved from an engine that died or drained)
goes on exactly where the request was: run a request to its end, then send its prompt with its first k
outputs as a continuation to a fresh engine; the fresh engine's outputs are the original's outputs from k on
- greedy and seeded sampling, with penalties, min_tokens, stop tokens and logprobs, and a structured-output
grammar advanced through the earlier tokens. Bad continuations are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from shared_runtime.contract import EngineCoreRequest, EngineSamplingParams, StructuredOutputs

PROMPT = [5, 9, 14, 22, 31, 40, 47, 51, 60, 66, 71]


def _core(model: Path) -> EngineCore:
    return EngineCore(EngineConfig.create(model=str(model), dtype="float32", device="cpu", max_model_len=512,
                                          block_size=16, num_gpu_blocks_override=64, max_num_seqs=8))


def _run(core: EngineCore, request: EngineCoreRequest) -> tuple[list[int], list[Any], Any]:
    """(new tokens, their logprob entries, the final output) of `request` run alone on `core`."""
    core.add_request(request)
    tokens: list[int] = []
    logprobs: list[Any] = []
    last = None
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += out.new_token_ids
            logprobs += out.new_logprobs or []
            last = out
    return tokens, logprobs, last


CASES = {
    "greedy": EngineSamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
    "seeded": EngineSamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=40, ignore_eos=True),
    "penalties": EngineSamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True,
                                      presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3),
    "min_tokens_and_stops": EngineSamplingParams(temperature=1.0, seed=77, max_tokens=60, min_tokens=25,
                                                 stop_token_ids=[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k", [1, 17])
def test_a_continuation_gives_the_rest_of_the_original_output(llama_dir: Path, case: str, k: int) -> None:
    params = CASES[case]
    whole, whole_logprobs, whole_end = _run(_core(llama_dir), EngineCoreRequest(
        request_id="r", prompt_token_ids=PROMPT, sampling_params=params))
    assert len(whole) > k, whole
    rest, rest_logprobs, rest_end = _run(_core(llama_dir), EngineCoreRequest(
        request_id="r.m1", prompt_token_ids=PROMPT, sampling_params=params, output_token_ids=whole[:k]))
    assert rest == whole[k:]
    assert (rest_end.finish_reason, rest_end.stop_token_id) == (whole_end.finish_reason, whole_end.stop_token_id)
    assert [e.token_id for e in rest_logprobs] == [e.token_id for e in whole_logprobs[k:]]
    for got, want in zip(rest_logprobs, whole_logprobs[k:], strict=True):
        assert abs(got.logprob - want.logprob) < 1e-4
        assert got.top_token_ids == want.top_token_ids


def test_a_continuation_counts_its_earlier_tokens_against_max_tokens(llama_dir: Path) -> None:
    params = EngineSamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rest, _, end = _run(_core(llama_dir), EngineCoreRequest(
        request_id="r", prompt_token_ids=PROMPT, sampling_params=params, output_token_ids=[20] * 10))
    assert len(rest) == 2 and end.finish_reason == 2  # LENGTH after 12 outputs in all


def test_a_grammar_continues_after_the_earlier_tokens(llama_dir: Path, tokenizer: Any) -> None:
    constraint = StructuredOutputs(regex="[a-e]{2}[0-9]{20,30}")  # its state after 3 tokens is not its start
    params = EngineSamplingParams(temperature=0.7, seed=3, max_tokens=40, structured_outputs=constraint)
    whole, _, end = _run(_core(llama_dir), EngineCoreRequest(
        request_id="r", prompt_token_ids=PROMPT, sampling_params=params, eos_token_ids=[1]))
    assert end.error is None and len(whole) > 3
    rest, _, rest_end = _run(_core(llama_dir), EngineCoreRequest(
        request_id="r.m1", prompt_token_ids=PROMPT, sampling_params=params, eos_token_ids=[1],
        output_token_ids=whole[:3]))
    assert rest_end.error is None and rest == whole[3:]


@pytest.mark.parametrize(("outputs", "max_tokens", "says"), [
    ([10**6], 10, "outside the vocabulary"),
    ([7] * 10, 10, "already has its 10 output tokens"),
    ([7] * 505, 10_000, "more than max_model_len"),
])
def test_a_bad_continuation_is_refused_by_name(llama_dir: Path, outputs: list[int], max_tokens: int, says: str) -> None:
    params = EngineSamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rest, _, end = _run(_core(llama_dir), EngineCoreRequest(
        request_id="r", prompt_token_ids=PROMPT, sampling_params=params, output_token_ids=outputs))
    assert rest == [] and end.error is not None and end.error.code == 3  # INVALID_ARGUMENT
    assert says in end.error.message


def test_tokens_a_grammar_refuses_are_refused(llama_dir: Path) -> None:
    params = EngineSamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputs(regex="a+"))
    core = _core(llama_dir)
    vocab_token = next(i for i in range(5, 200))  # some token; "a+" allows only a's pieces
    _, _, end = _run(core, EngineCoreRequest(request_id="r", prompt_token_ids=PROMPT, sampling_params=params,
                                             eos_token_ids=[1], output_token_ids=[vocab_token] * 3))
    assert end.error is not None and "output_token_ids do not follow the constraint" in end.error.message
