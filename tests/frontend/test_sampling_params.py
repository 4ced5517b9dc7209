"""SamplingParams: defaults, normalization, the validation table, and engine_fields()."""

from __future__ import annotations

import math

import pytest

from frontend_svc.errors import FieldViolation, ValidationError
from frontend_svc.sampling_params import SamplingParams

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
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),  # at most 16 stop strings
    ({"stop": ["x" * 1025]}, "stop"),  # of at most 1024 characters
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),  # at most 1024 stop ids
    ({"temperature": "hot"}, "temperature"),
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


def test_engine_fields_match_the_engine_struct():
    protocol = pytest.importorskip("engine_svc.protocol")
    params = SamplingParams(temperature=0.5, top_k=-1, seed=7, stop="x", stop_token_ids=[5], logprobs=2, n=3)
    fields = params.engine_fields()
    assert set(fields) == set(protocol.EngineSamplingParams.__struct_fields__)
    assert fields["top_k"] == 0  # -1 (disabled) is sent as 0
    assert fields["seed"] == 7 and fields["stop_token_ids"] == [5] and fields["logprobs"] == 2
    protocol.EngineSamplingParams(**fields)  # constructible as-is
    fields["stop_token_ids"].append(9)
    assert params.stop_token_ids == [5]  # a copy, not the params' own list


def test_validation_error_needs_a_violation_and_prefixes():
    with pytest.raises(ValueError):
        ValidationError([])
    violation = FieldViolation("top_p", "bad")
    assert violation.with_prefix("sampling_params").field == "sampling_params.top_p"
