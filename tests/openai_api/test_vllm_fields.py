"""Every field of vLLM's OpenAI request models is honoured (a test exists for it) or refused by name.

vLLM's fields come from tests/openai_api/data/vllm_fields.json (recorded from the installed vllm by
scripts/record_vllm_fields.py: the suite cannot import vllm). A field vLLM adds fails here until tandem
honours it (with a test named in HONOURED) or refuses it (protocol.REFUSED_*).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend_svc.openai import bodies
from frontend_svc.openai import protocol as p

FIXTURE = json.loads((Path(__file__).parent / "data" / "vllm_fields.json").read_text())
TESTS = Path(__file__).parent

_SAMPLING = "test_openai_bodies.py::test_sampling_params_carry_every_field"
_COMMON = {
    "model": "test_openai_bodies.py::test_model_name_must_be_the_served_one",
    "frequency_penalty": _SAMPLING, "presence_penalty": _SAMPLING, "temperature": _SAMPLING, "top_p": _SAMPLING,
    "seed": _SAMPLING, "stop": _SAMPLING, "top_k": _SAMPLING, "min_p": _SAMPLING, "repetition_penalty": _SAMPLING,
    "stop_token_ids": _SAMPLING, "include_stop_str_in_output": _SAMPLING, "ignore_eos": _SAMPLING,
    "min_tokens": _SAMPLING, "skip_special_tokens": _SAMPLING, "n": _SAMPLING, "max_tokens": _SAMPLING,
    "logit_bias": "test_openai_e2e.py::test_logit_bias_with_string_keys_equals_the_grpc_api",
    "stream": "test_openai_e2e.py::test_chat_stream_with_usage_and_logprobs",
    "stream_options": "test_openai_e2e.py::test_chat_stream_with_usage_and_logprobs",
    "user": "test_vllm_fields.py::test_user_is_accepted_and_changes_nothing",
    "priority": "test_openai_http.py::test_priority_and_token_filters_reach_the_engine",
    "allowed_token_ids": "test_openai_e2e.py::test_allowed_token_ids_and_bad_words_equal_the_grpc_api",
    "bad_words": "test_openai_e2e.py::test_allowed_token_ids_and_bad_words_equal_the_grpc_api",
    "truncate_prompt_tokens": "test_openai_e2e.py::test_truncate_prompt_tokens_keeps_the_last_or_first_tokens",
    "truncation_side": "test_openai_e2e.py::test_truncate_prompt_tokens_keeps_the_last_or_first_tokens",
    "add_special_tokens": "test_openai_e2e.py::test_add_special_tokens_and_max_tokens_fitted_to_the_context",
    "request_id": "test_openai_e2e.py::test_chat_echo_continue_final_message_and_request_id",
    "prompt_logprobs": "test_openai_e2e.py::test_prompt_logprobs_and_token_ids_on_both_apis",
    "return_token_ids": "test_openai_e2e.py::test_prompt_logprobs_and_token_ids_on_both_apis",
    "return_tokens_as_token_ids": "test_openai_e2e.py::test_prompt_logprobs_and_token_ids_on_both_apis",
    "structured_outputs": "test_structured_outputs_served.py::test_json_object_regex_and_choice",
    "stream_interval": "test_openai_stream_interval.py::test_chunks_hold_the_interval_and_add_up_to_interval_1",
    "kv_transfer_params": "test_kv_transfer_params.py::"
                          "test_the_sidecars_prefill_then_decode_reach_the_engine_and_the_response_names_the_blocks",
}
HONOURED = {
    "completions": {**_COMMON, "prompt": "test_openai_bodies.py::test_prompt_forms_and_strict_types",
                    "logprobs": "test_openai_e2e.py::test_completion_logprobs_shape",
                    "echo": "test_openai_e2e.py::test_echo_with_logprobs_through_the_openai_client",
                    "response_format": "test_openai_bodies.py::test_completions_take_response_format"},
    "chat": {**_COMMON, "messages": "test_openai_bodies.py::test_prompts_and_chat_messages",
             "logprobs": "test_openai_bodies.py::test_chat_logprobs_need_logprobs_true",
             "top_logprobs": "test_openai_bodies.py::test_chat_logprobs_need_logprobs_true",
             "max_completion_tokens": "test_openai_bodies.py::test_defaults_follow_openai",
             "add_generation_prompt": "test_openai_bodies.py::test_prompts_and_chat_messages",
             "echo": "test_openai_e2e.py::test_chat_echo_continue_final_message_and_request_id",
             "continue_final_message": "test_openai_e2e.py::test_chat_echo_continue_final_message_and_request_id",
             "documents": "test_openai_bodies.py::test_chat_options_follow_vllm",
             "chat_template": "test_chat_template.py::test_a_request_template_is_sandboxed_and_bounded",
             "chat_template_kwargs": "test_openai_bodies.py::test_chat_options_follow_vllm",
             "reasoning_effort": "test_openai_bodies.py::test_chat_options_follow_vllm",
             "response_format": "test_structured_outputs_served.py::test_every_completion_validates_against_its_schema",
             "tools": "test_structured_outputs_served.py::test_named_and_required_tool_choices_yield_valid_calls",
             "tool_choice": "test_structured_outputs_served.py::test_named_and_required_tool_choices_yield_valid_calls",
             "parallel_tool_calls": "test_tool_calls.py::test_auto_without_parallel_tool_calls_keeps_the_first_call"},
}
MODELS = {"completions": p.CompletionRequest, "chat": p.ChatCompletionRequest}
REFUSED = {"completions": p.REFUSED_COMPLETION, "chat": p.REFUSED_CHAT}
BASE = {"completions": {"prompt": "hi"}, "chat": {"messages": [{"role": "user", "content": "hi"}]}}


def _test_exists(node: str) -> bool:
    file, name = node.split("::")
    paths = [TESTS / file, TESTS.parent / "frontend" / file, TESTS.parent / "realmodel" / file]
    return any(path.exists() and f"def {name}(" in path.read_text() for path in paths)


def _not_default(default: object) -> object:
    """A value other than vLLM's default (and not null): what a client asking for the feature sends."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, str):
        return default + "-other"
    return {"x": 1} if default is None else None


def test_the_fixture_names_its_vllm_version_and_how_to_record_it() -> None:
    assert FIXTURE["vllm_version"] and "record_vllm_fields.py" in FIXTURE["regenerate"]
    assert len(FIXTURE["completions"]) > 40 and len(FIXTURE["chat"]) > 50


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_vllm_field_is_honoured_or_refused_by_name(endpoint: str) -> None:
    model, refused, honoured = MODELS[endpoint], REFUSED[endpoint], HONOURED[endpoint]
    unaccounted = [f for f in FIXTURE[endpoint] if f not in honoured and f not in refused]
    assert not unaccounted, f"vLLM {endpoint} fields neither honoured nor refused: {unaccounted}"
    assert not set(honoured) & set(refused)
    for field, node in honoured.items():
        assert field in model.model_fields, f"{field} is honoured but the body model drops it"
        assert _test_exists(node), f"{field}: no test {node}"
    for field in refused:
        assert field in model.model_fields, f"{field} is refused but the body model never sees it"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_refused_fields_are_400_naming_them_unless_default_or_null(endpoint: str) -> None:
    model = MODELS[endpoint]
    for field, default in REFUSED[endpoint].items():
        recorded = FIXTURE[endpoint].get(field, default)
        assert recorded in (default, None), f"{field}: vLLM's default is {recorded!r}, refused unless {default!r}"
        for accepted in (default, None):
            assert bodies.unsupported(model.model_validate({**BASE[endpoint], field: accepted})) is None, field
        body = model.model_validate({**BASE[endpoint], field: _not_default(default)})
        error = bodies.unsupported(body)
        assert error is not None and (error.status, error.param) == (400, field), field
        assert field in error.message


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_null_is_accepted_wherever_vllm_accepts_it(endpoint: str) -> None:
    """An explicit null (OpenAI's SDKs send `n=None`, `stream=None`, ...) is accepted for every field
    vLLM's model accepts it for (recorded), and where tandem's type is not optional it means the default."""
    model, base = MODELS[endpoint], BASE[endpoint]
    accepted = FIXTURE["accepts_null"][endpoint]
    assert {"stream", "logprobs"} <= set(accepted)
    plain = model.model_validate(base)
    for field in accepted:
        body = model.model_validate({**base, field: None})
        assert bodies.unsupported(body) is None, field
        if field in model.NULL_IS_DEFAULT:
            assert body == plain, f"{field}: null should mean the default"


def test_user_is_accepted_and_changes_nothing() -> None:
    """OpenAI's end-user id: vLLM accepts it and it changes nothing there either."""
    plain, tagged = (bodies.sampling_params(p.CompletionRequest.model_validate({**BASE["completions"], **extra}))
                     for extra in ({}, {"user": "u-1"}))
    assert plain == tagged and bodies.unsupported(p.CompletionRequest.model_validate(
        {**BASE["completions"], "user": "u-1"})) is None
