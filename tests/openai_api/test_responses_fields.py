"""Every field of vLLM's ResponsesRequest is honoured (a test exists for it) or refused by name.

vLLM's fields come from tests/openai_api/data/vllm_responses_fields.json (recorded from the installed vllm
by scripts/record_vllm_fields.py). A field vLLM adds fails here until tandem honours it (with a test
named in HONOURED) or refuses it (responses_protocol.REFUSED_RESPONSES).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend_svc.openai import responses
from frontend_svc.openai import responses_protocol as rp
from tests.openai_api.test_vllm_fields import _not_default, _test_exists

FIXTURE = json.loads((Path(__file__).parent / "data" / "vllm_responses_fields.json").read_text())
R = "test_responses.py::"
_SAMPLING = R + "test_sampling_fields_reach_the_engine"
HONOURED = {
    "input": R + "test_input_items_parts_and_a_partial_assistant_message",
    "instructions": R + "test_a_response_is_the_chat_completion_of_the_same_messages",
    "max_output_tokens": R + "test_a_response_is_the_chat_completion_of_the_same_messages",
    "model": R + "test_errors_name_the_responses_fields",
    "stream": R + "test_streaming_sends_vllms_events_in_order",
    "text": R + "test_text_format_json_schema_constrains_the_output",
    "chat_template_kwargs": R + "test_to_chat_maps_every_honoured_field",
    "store": R + "test_nothing_is_stored_so_ids_are_404_as_vllm_without_a_store",
    "previous_response_id": R + "test_nothing_is_stored_so_ids_are_404_as_vllm_without_a_store",
    "background": R + "test_unsupported_fields_are_400_naming_them",
    **{name: _SAMPLING for name in (
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
        "logit_bias", "priority", "request_id", "metadata", "user", "service_tier", "parallel_tool_calls",
        "tool_choice", "prompt_cache_key", "include_reasoning", "reasoning")},
}


def test_the_fixture_names_its_vllm_version() -> None:
    assert FIXTURE["vllm_version"] and len(FIXTURE["responses"]) > 40


def test_every_vllm_responses_field_is_honoured_or_refused_by_name() -> None:
    fields, refused = FIXTURE["responses"], rp.REFUSED_RESPONSES
    unaccounted = [f for f in fields if f not in HONOURED and f not in refused]
    assert not unaccounted, f"vLLM Responses fields neither honoured nor refused: {unaccounted}"
    assert not set(HONOURED) & set(refused)
    for field, node in HONOURED.items():
        assert field in rp.ResponsesRequest.model_fields, f"{field} is honoured but the body model drops it"
        assert _test_exists(node), f"{field}: no test {node}"
    for field in refused:
        assert field in rp.ResponsesRequest.model_fields, f"{field} is refused but the body model never sees it"


def test_refused_fields_are_400_naming_them_unless_default_or_null() -> None:
    for field, default in rp.REFUSED_RESPONSES.items():
        recorded = FIXTURE["responses"].get(field, default)
        assert recorded in (default, None, "<required or generated>"), f"{field}: vLLM's default is {recorded!r}"
        for accepted in (default, None):
            body = rp.ResponsesRequest.model_validate({"input": "hi", field: accepted})
            assert responses.unsupported(body) is None, field
        other = [{"x": 1}] if default == [] else _not_default(default)
        body = rp.ResponsesRequest.model_validate({"input": "hi", field: other})
        error = responses.unsupported(body)
        assert error is not None and (error.status, error.param) == (400, field), field
        assert field in error.message


@pytest.mark.parametrize("value", [[], None])
def test_no_tools_is_vllms_default(value: object) -> None:
    assert responses.unsupported(rp.ResponsesRequest.model_validate({"input": "hi", "tools": value})) is None
