"""SamplingParams (shared_runtime/contract.py): defaults, normalization, the validation table shared by
frontend and engine, and engine_params()."""

from __future__ import annotations

import math

import pytest

from shared_runtime.contract import EngineSamplingParams, SamplingParams
from shared_runtime.violations import FieldViolation, ValidationError

NAN, INF = math.nan, math.inf

# (kwargs, the one field that must be reported)
BAD_PARAMS = [
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": NAN}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 1 << 64}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 17}, "min_tokens"),  # > default max_tokens (16)
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"frequency_penalty": NAN}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": INF}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),  # at most MAX_N (64) completions
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),  # at most 16 stop strings
    ({"stop": ["x" * 1025]}, "stop"),  # of at most 1024 characters
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),  # at most 1024 stop ids
    ({"temperature": "hot"}, "temperature"),
    ({"logit_bias": {5: NAN}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),  # token ids are integers (the OpenAI mapper converts keys)
    ({"logit_bias": {5: "up"}}, "logit_bias"),
    ({"logit_bias": dict.fromkeys(range(1025), 1.0)}, "logit_bias"),  # at most 1024 entries
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_PARAMS)
def test_bad_value_names_its_field(kwargs, field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.fields == [field]
    assert isinstance(info.value, ValueError)  # offline users may catch ValueError


GOOD_PARAMS = [
    {"temperature": 0.0}, {"top_p": 1.0}, {"top_k": -1}, {"top_k": 50}, {"min_p": 1.0},
    {"seed": 0}, {"seed": (1 << 64) - 1}, {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 1, "min_tokens": 1}, {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3}, {"logprobs": 0}, {"logprobs": 20, "prompt_logprobs": 0}, {"n": 4},
    {"n": 64}, {"logit_bias": dict.fromkeys(range(1024), -100.0)}, {"logit_bias": {0: 100.0, 2**31 - 1: -0.5}},
    {"stop": [f"{i:02d}" + "x" * 1022 for i in range(16)], "stop_token_ids": list(range(1024))},
]


@pytest.mark.parametrize("kwargs", GOOD_PARAMS)
def test_boundary_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert params.violations() == []


def test_every_violation_is_collected():
    with pytest.raises(ValidationError) as info:
        SamplingParams(temperature=-1, top_p=0, n=0, stop=[""], logprobs=99)
    assert info.value.fields == ["temperature", "top_p", "stop", "logprobs", "n"]
    assert all(isinstance(v, FieldViolation) and v.description for v in info.value.violations)


def test_validate_catches_mutation_after_construction():
    params = SamplingParams()
    params.top_p = 2.0
    with pytest.raises(ValidationError) as info:
        params.validate()
    assert info.value.fields == ["top_p"]


def test_defaults_and_stop_normalization():
    params = SamplingParams(stop="###")
    assert params.max_tokens == 16 and params.n == 1 and params.skip_special_tokens
    assert params.stop == ["###"] and params.stop_token_ids == []
    assert SamplingParams().stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_logit_bias_is_clamped_like_vllm_and_checked_against_the_vocabulary():
    params = SamplingParams(logit_bias={5: 250.0, 6: -1e9, 7: 0.5})
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 0.5}
    assert params.violations(vocab_size=8) == []
    assert [v.field for v in params.violations(vocab_size=7)] == ["logit_bias"]  # id 7 is not in [0, 7)
    assert SamplingParams(logit_bias=None).logit_bias == {}
    raw = EngineSamplingParams(logit_bias={5: 250.0})  # what the engine gets raw is not clamped: refused
    assert [v.field for v in raw.violations(vocab_size=8)] == ["logit_bias"]


def test_engine_params_are_the_token_level_part():
    params = SamplingParams(temperature=0.5, top_k=-1, seed=7, stop="x", stop_token_ids=[5], logprobs=2, n=3)
    engine = params.engine_params()
    assert type(engine) is EngineSamplingParams
    assert set(EngineSamplingParams.__struct_fields__) < set(SamplingParams.__struct_fields__)
    assert (engine.top_k, engine.seed, engine.stop_token_ids, engine.logprobs) == (-1, 7, [5], 2)
    assert params.engine_params(seed_offset=2).seed == 9
    engine.stop_token_ids.append(9)
    assert params.stop_token_ids == [5]  # a copy, not the params' own list


def test_the_engine_side_runs_the_same_rules():
    """What the engine checks (EngineSamplingParams.violations) is the frontend's rule set without
    the text-level fields: a bad value is named the same way on both sides."""
    bad = {"top_p": 1.5, "logprobs": 21, "stop_token_ids": list(range(1025))}
    expected = [FieldViolation("top_p", "must be in (0, 1], got 1.5"),
                FieldViolation("stop_token_ids", "at most 1024 stop token ids are allowed, got 1025"),
                FieldViolation("logprobs", "must be in [0, 20], got 21")]
    assert EngineSamplingParams(**bad).violations() == expected
    with pytest.raises(ValidationError) as info:
        SamplingParams(**bad)
    assert info.value.violations == expected
    assert EngineSamplingParams().violations() == []


def test_validation_error_needs_a_violation_and_prefixes():
    with pytest.raises(ValueError):
        ValidationError([])
    violation = FieldViolation("top_p", "bad")
    assert violation.with_prefix("sampling_params").field == "sampling_params.top_p"


@pytest.mark.parametrize(("temperature", "sent"), [(5e-324, 0.0), (1e-30, 0.0), (9.99e-6, 0.0), (1e-5, 1e-5), (0.7, 0.7)])
def test_a_temperature_below_1e_5_is_sent_as_greedy(temperature: float, sent: float) -> None:
    """vLLM's rule (_SAMPLING_EPS): dividing logits by 5e-324 overflows to inf and NaN probabilities."""
    assert SamplingParams(temperature=temperature).engine_params().temperature == sent


def test_number_checks_answer_plain_numbers_and_others_alike() -> None:
    """The sampling rules' number checks (plain int and float take a fast path, issue 19)."""
    import fractions

    import numpy as np

    from shared_runtime.contract import _is_finite, _is_int

    for value, is_int, is_finite in [(3, True, True), (-1, True, True), (True, False, False), (2.0, False, True),
                                     (float("nan"), False, False), (float("inf"), False, False),
                                     (np.int64(4), True, True), (np.float32(0.5), False, True),
                                     (np.bool_(True), False, False), (fractions.Fraction(1, 2), False, True),
                                     ("1", False, False), (None, False, False)]:
        assert _is_int(value) is is_int, value
        assert _is_finite(value) is is_finite, value
