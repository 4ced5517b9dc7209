"""The gRPC API's sampling fields -> the contract's SamplingParams (frontend_svc/grpc_api/wire.py), field by field."""

from __future__ import annotations

import math
from typing import Any

import pytest
from tandem.v1 import generation_pb2 as pb

from frontend_svc.grpc_api.wire import sampling_params_from_pb
from shared_runtime.contract import SamplingParams, StructuredOutputs
from shared_runtime.violations import ValidationError

# A non-default value for every public field (exact in float32, as the public proto carries floats).
EVERY_FIELD: dict[str, Any] = {
    "temperature": 0.5, "top_p": 0.75, "top_k": 7, "min_p": 0.25, "seed": 2**63 + 1, "max_tokens": 9,
    "min_tokens": 2, "stop": ["a", "b"], "stop_token_ids": [3, 4], "include_stop_str_in_output": True,
    "ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.25,
    "logprobs": 2, "prompt_logprobs": 1, "n": 3, "skip_special_tokens": False,
    "logit_bias": {5: 1.5, 9: -100.0}, "allowed_token_ids": [5, 6, 7], "bad_words": ["x", "y z"],
    "structured_outputs": pb.StructuredOutputs(choice=pb.Choices(choices=["yes", "no"])), "stream_interval": 4,
}
# What each field becomes in the contract, where that is not the proto value itself.
CONTRACT_VALUE: dict[str, Any] = {"structured_outputs": StructuredOutputs(choice=["yes", "no"])}


def test_every_public_field_reaches_the_contract_under_its_name() -> None:
    assert set(EVERY_FIELD) == set(pb.SamplingParams.DESCRIPTOR.fields_by_name)  # a new field: add it here
    params = sampling_params_from_pb(pb.SamplingParams(**EVERY_FIELD))
    assert {name: getattr(params, name) for name in EVERY_FIELD} == {**EVERY_FIELD, **CONTRACT_VALUE}


def test_unset_fields_are_the_documented_defaults() -> None:
    params = sampling_params_from_pb(pb.SamplingParams())
    assert params == SamplingParams(max_tokens=None)  # unset max_tokens: fill the context window
    assert sampling_params_from_pb(pb.SamplingParams(n=0)).n == 1
    explicit_zero = sampling_params_from_pb(pb.SamplingParams(temperature=0.0, logprobs=0))
    assert (explicit_zero.temperature, explicit_zero.logprobs) == (0.0, 0)


def test_bad_values_carry_public_field_paths() -> None:
    with pytest.raises(ValidationError) as info:
        sampling_params_from_pb(pb.SamplingParams(top_p=1.5, n=65, logit_bias={3: math.nan}))
    assert info.value.fields == ["sampling_params.top_p", "sampling_params.logit_bias", "sampling_params.n"]
    assert sampling_params_from_pb(pb.SamplingParams(logit_bias={3: 1e6})).logit_bias == {3: 100.0}
