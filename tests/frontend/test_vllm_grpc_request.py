"""vLLM's `vllm.GenerateRequest` -> tandem's request (frontend_svc/vllm_grpc/request.py): every field honoured
with vLLM's semantics or refused by name.

The descriptor walk fails when vLLM's proto gains a field the mapping neither honours nor refuses (update the
vendored protos and this test names it); each refused field, set alone, is refused naming its path; each
honoured field, set alone, changes the mapped request the way vLLM's server reads it; vLLM's gRPC defaults
(greedy, 20 new tokens, proto3 zeros as "unset") apply where tandem's own API differs.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import struct_pb2
from tandem.vendor.vllm import inference_pb2 as ipb

from frontend_svc.vllm_grpc.request import (
    DEFAULT_MAX_NEW_TOKENS,
    HONOURED,
    REFUSED,
    InferencePlan,
    ModelNotFound,
    plan,
)
from shared_runtime.contract import SamplingParams, StructuredOutputs
from shared_runtime.violations import ValidationError

MODEL = "served-model"


def mapped(**fields: Any) -> InferencePlan:
    fields.setdefault("text", "hello")
    return plan(ipb.GenerateRequest(**fields), MODEL, lora_adapters=("adapter",))


def refused(**fields: Any) -> list[str]:
    fields.setdefault("text", "hello")
    with pytest.raises(ValidationError) as caught:
        plan(ipb.GenerateRequest(**fields), MODEL)
    return [v.field for v in caught.value.violations]


def _messages() -> list[Any]:
    """Every message type a request can hold, the request first (walked from its descriptor)."""
    seen: dict[str, Any] = {}

    def walk(descriptor: Any) -> None:
        if descriptor.name in seen or descriptor.full_name.startswith("google."):
            return
        seen[descriptor.name] = descriptor
        for field in descriptor.fields:
            if field.message_type is not None and not field.message_type.GetOptions().map_entry:
                walk(field.message_type)

    walk(ipb.GenerateRequest.DESCRIPTOR)
    return list(seen.values())


@pytest.mark.parametrize("descriptor", _messages(), ids=lambda d: d.name)
def test_every_field_of_every_request_message_is_honoured_or_refused(descriptor: Any) -> None:
    name = descriptor.name
    if name in ("MediaItem", "PreprocessedMediaFeatures"):  # inside `media`, which is refused whole
        assert "media" in REFUSED["GenerateRequest"]
        return
    fields = {f.name for f in descriptor.fields}
    honoured, refused_here = HONOURED[name], set(REFUSED[name])
    assert not honoured & refused_here
    unhandled = fields - honoured - refused_here
    assert not unhandled, f"{name} fields neither honoured nor refused: {sorted(unhandled)}"
    assert honoured | refused_here == fields, "the tables name fields the proto does not have"


REFUSED_VALUES: dict[str, dict[str, Any]] = {
    "session_id": {"session_id": "s1"},
    "media": {"media": [ipb.MediaItem(url="http://example.invalid/a.png")]},
    "kv.bypass_prefix_cache": {"kv": ipb.KVCacheParameters(bypass_prefix_cache=True)},
    "kv.cache_salt": {"kv": ipb.KVCacheParameters(cache_salt="salt")},
    "kv.kv_transfer_params": {"kv": ipb.KVCacheParameters(kv_transfer_params=struct_pb2.Struct())},
    "kv.ec_transfer_params": {"kv": ipb.KVCacheParameters(ec_transfer_params=struct_pb2.Struct())},
    "response.output_candidates.token_ids": {"response": ipb.ResponseOptions(
        output_logprobs=True, output_candidates=ipb.CandidateTokens(token_ids=ipb.TokenIds(ids=[5])))},
    "response.output_candidates.all": {"response": ipb.ResponseOptions(
        output_logprobs=True, output_candidates=ipb.CandidateTokens(all=True))},
    "response.prompt_candidates.token_ids": {"response": ipb.ResponseOptions(
        prompt_logprobs=True, prompt_candidates=ipb.CandidateTokens(token_ids=ipb.TokenIds(ids=[5])))},
    "response.prompt_candidates.all": {"response": ipb.ResponseOptions(
        prompt_logprobs=True, prompt_candidates=ipb.CandidateTokens(all=True))},
}


def test_the_refusal_cases_cover_every_refused_field() -> None:
    top = {f"kv.{name}" for name in REFUSED["KVCacheParameters"]} | {
        name for name in REFUSED["GenerateRequest"]}
    candidates = {f"response.{where}.{kind}" for where in ("prompt_candidates", "output_candidates")
                  for kind in REFUSED["CandidateTokens"]}
    assert set(REFUSED_VALUES) == top | candidates


@pytest.mark.parametrize("path", sorted(REFUSED_VALUES))
def test_each_refused_field_is_refused_by_its_path(path: str) -> None:
    assert refused(**REFUSED_VALUES[path]) == [path]


def test_vllm_s_unset_values_are_not_refusals() -> None:
    """Empty strings, false flags and an empty id selector are vLLM's "unset": accepted."""
    mapped(session_id="", lora_name="", kv=ipb.KVCacheParameters(bypass_prefix_cache=False, cache_salt=""),
           response=ipb.ResponseOptions(output_logprobs=True, output_candidates=ipb.CandidateTokens(
               token_ids=ipb.TokenIds()), prompt_candidates=ipb.CandidateTokens(all=False)))


def test_vllm_s_grpc_defaults() -> None:
    """Nothing set: greedy, 20 new tokens, one sequence, no filters, text out, special tokens skipped."""
    got = mapped()
    want = SamplingParams(temperature=0.0, max_tokens=DEFAULT_MAX_NEW_TOKENS)
    assert got.params == want and DEFAULT_MAX_NEW_TOKENS == 20
    assert got.request_id is None and got.priority == 0 and got.options.truncate_prompt_tokens is None
    assert got.shape.output_text and not got.shape.output_token_ids and not got.shape.output_logprobs
    # proto3 zeros are "unset", not zero: top_p 0 would be invalid, repetition_penalty 0 too
    zeros = mapped(sampling=ipb.RandomSampling(top_p=0, top_k=0, min_p=0, num_sequences=0),
                   decoding=ipb.DecodingParameters(repetition_penalty=0), stopping=ipb.StoppingCriteria())
    assert zeros.params == want


MODEL_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 50.0, "min_p": 0.05, "repetition_penalty": 1.1}


def test_the_model_s_sampling_defaults_fill_vllm_s_unset_fields() -> None:
    """vLLM's "model-specific default": generation_config.json's values where the request leaves a field unset
    (temperature absent, the others 0); a value the request sets wins."""
    request = ipb.GenerateRequest(text="Hi")
    got = plan(request, MODEL, defaults=MODEL_DEFAULTS).params
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (0.7, 0.9, 50, 0.05, 1.1)
    request = ipb.GenerateRequest(text="Hi", temperature=0.0, sampling=ipb.RandomSampling(top_p=0.5, top_k=3, min_p=0.2),
                                  decoding=ipb.DecodingParameters(repetition_penalty=1.3))
    got = plan(request, MODEL, defaults=MODEL_DEFAULTS).params
    assert (got.temperature, got.top_p, got.top_k, round(got.min_p, 6), round(got.repetition_penalty, 6)) == \
        (0.0, 0.5, 3, 0.2, 1.3)


def test_generation_config_sampling_fields_are_read(tmp_path: Any) -> None:
    from frontend_svc.tokenizer import generation_sampling_defaults

    config = tmp_path / "generation_config.json"
    config.write_text('{"temperature": 0.6, "top_k": 20, "top_p": "x", "do_sample": true, "min_p": false, '
                      '"eos_token_id": 2}')
    assert generation_sampling_defaults(config) == {"temperature": 0.6, "top_k": 20.0}
    assert generation_sampling_defaults(tmp_path / "missing.json") == {}


# honoured field -> (request fields, what the mapped plan must then say)
HONOURED_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "request_id": ({"request_id": "r-7"}, lambda p: p.request_id == "r-7"),
    "model": ({"model": MODEL}, lambda p: p.request_id is None),
    "text": ({"text": "some text"}, lambda p: p.prompt == "some text"),
    "token_ids": ({"text": None, "token_ids": ipb.TokenIds(ids=[4, 5, 6])}, lambda p: list(p.prompt) == [4, 5, 6]),
    "temperature": ({"temperature": 0.7}, lambda p: abs(p.params.temperature - 0.7) < 1e-6),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 3},
                               lambda p: p.options.truncate_prompt_tokens == 3 and p.options.truncation_side == "left"),
    "priority": ({"priority": -2}, lambda p: p.priority == -2),
    "lora_name": ({"lora_name": "adapter"}, lambda p: p.lora_name == "adapter"),
    "sampling.num_sequences": ({"sampling": ipb.RandomSampling(num_sequences=3), "temperature": 1.0},
                               lambda p: p.params.n == 3),
    "sampling.top_k": ({"sampling": ipb.RandomSampling(top_k=5)}, lambda p: p.params.top_k == 5),
    "sampling.top_p": ({"sampling": ipb.RandomSampling(top_p=0.5)}, lambda p: p.params.top_p == 0.5),
    "sampling.min_p": ({"sampling": ipb.RandomSampling(min_p=0.25)}, lambda p: p.params.min_p == 0.25),
    "sampling.seed": ({"sampling": ipb.RandomSampling(seed=0)}, lambda p: p.params.seed == 0),
    "sampling.seed negative": ({"sampling": ipb.RandomSampling(seed=-1)}, lambda p: p.params.seed == 2**64 - 1),
    "decoding.presence_penalty": ({"decoding": ipb.DecodingParameters(presence_penalty=0.5)},
                                  lambda p: p.params.presence_penalty == 0.5),
    "decoding.frequency_penalty": ({"decoding": ipb.DecodingParameters(frequency_penalty=-0.5)},
                                   lambda p: p.params.frequency_penalty == -0.5),
    "decoding.repetition_penalty": ({"decoding": ipb.DecodingParameters(repetition_penalty=1.25)},
                                    lambda p: p.params.repetition_penalty == 1.25),
    "decoding.logit_bias": ({"decoding": ipb.DecodingParameters(logit_bias={5: 2.5})},
                            lambda p: p.params.logit_bias == {5: 2.5}),
    "decoding.allowed_token_ids": ({"decoding": ipb.DecodingParameters(allowed_token_ids=[5, 6])},
                                   lambda p: p.params.allowed_token_ids == [5, 6]),
    "decoding.json": ({"decoding": ipb.DecodingParameters(json='{"type": "object"}')},
                      lambda p: p.params.structured_outputs == StructuredOutputs(json='{"type": "object"}')),
    "decoding.regex": ({"decoding": ipb.DecodingParameters(regex="a+")},
                       lambda p: p.params.structured_outputs == StructuredOutputs(regex="a+")),
    "decoding.choice": ({"decoding": ipb.DecodingParameters(choice=ipb.DecodingParameters.StringChoices(
        choices=["yes", "no"]))}, lambda p: p.params.structured_outputs == StructuredOutputs(choice=["yes", "no"])),
    "decoding.grammar": ({"decoding": ipb.DecodingParameters(grammar='root ::= "a"')},
                         lambda p: p.params.structured_outputs == StructuredOutputs(grammar='root ::= "a"')),
    "decoding.json_object": ({"decoding": ipb.DecodingParameters(json_object=True)},
                             lambda p: p.params.structured_outputs == StructuredOutputs(json_object=True)),
    "decoding.json_object false": ({"decoding": ipb.DecodingParameters(json_object=False)},
                                   lambda p: p.params.structured_outputs is None),
    "decoding.structural_tag": ({"decoding": ipb.DecodingParameters(structural_tag='{"type": "x"}')},
                                lambda p: p.params.structured_outputs == StructuredOutputs(structural_tag='{"type": "x"}')),
    "stopping.max_new_tokens": ({"stopping": ipb.StoppingCriteria(max_new_tokens=7)}, lambda p: p.params.max_tokens == 7),
    "stopping.min_new_tokens": ({"stopping": ipb.StoppingCriteria(min_new_tokens=2)}, lambda p: p.params.min_tokens == 2),
    "stopping.stop_token_ids": ({"stopping": ipb.StoppingCriteria(stop_token_ids=[9])},
                                lambda p: p.params.stop_token_ids == [9]),
    "stopping.stop_strings": ({"stopping": ipb.StoppingCriteria(stop_strings=["\n"])}, lambda p: p.params.stop == ["\n"]),
    "stopping.include_stop_strings": ({"stopping": ipb.StoppingCriteria(stop_strings=["x"], include_stop_strings=True)},
                                      lambda p: p.params.include_stop_str_in_output),
    "stopping.ignore_eos": ({"stopping": ipb.StoppingCriteria(ignore_eos=True)}, lambda p: p.params.ignore_eos),
    "response.prompt_token_ids": ({"response": ipb.ResponseOptions(prompt_token_ids=True)},
                                  lambda p: p.shape.prompt_token_ids),
    "response.prompt_logprobs": ({"response": ipb.ResponseOptions(prompt_logprobs=True)},
                                 lambda p: p.shape.prompt_logprobs and p.params.prompt_logprobs == 0),
    "response.prompt_candidates": ({"response": ipb.ResponseOptions(
        prompt_logprobs=True, prompt_candidates=ipb.CandidateTokens(top_n=3))}, lambda p: p.params.prompt_logprobs == 3),
    "response.output_text": ({"response": ipb.ResponseOptions(output_text=False)}, lambda p: not p.shape.output_text),
    "response.output_token_ids": ({"response": ipb.ResponseOptions(output_token_ids=True)},
                                  lambda p: p.shape.output_token_ids),
    "response.output_logprobs": ({"response": ipb.ResponseOptions(output_logprobs=True)},
                                 lambda p: p.shape.output_logprobs and p.params.logprobs == 0),
    "response.output_candidates": ({"response": ipb.ResponseOptions(
        output_logprobs=True, output_candidates=ipb.CandidateTokens(top_n=4))}, lambda p: p.params.logprobs == 4),
    "response.output_candidates without output_logprobs": (
        {"response": ipb.ResponseOptions(output_candidates=ipb.CandidateTokens(top_n=4))},
        lambda p: p.params.logprobs is None),  # vLLM: candidates only come with output_logprobs
    "response.skip_special_tokens": ({"response": ipb.ResponseOptions(skip_special_tokens=False)},
                                     lambda p: not p.params.skip_special_tokens),
}


@pytest.mark.parametrize("case", sorted(HONOURED_CASES))
def test_each_honoured_field_reaches_the_mapped_request(case: str) -> None:
    fields, check = HONOURED_CASES[case]
    if fields.get("text", "") is None:
        del fields["text"]
        got = plan(ipb.GenerateRequest(**fields), MODEL)
    else:
        got = mapped(**fields)
    assert check(got), case


def test_every_honoured_leaf_field_has_its_case() -> None:
    covered = {case.split(" ")[0].rsplit(".", 1)[-1] for case in HONOURED_CASES}
    containers = {"sampling", "decoding", "stopping", "response", "kv", "ids", "choices", "top_n"}
    leaves = {f for fields in HONOURED.values() for f in fields} - containers
    assert leaves <= covered, sorted(leaves - covered)


@pytest.mark.parametrize(("fields", "path"), [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"sampling": ipb.RandomSampling(top_p=1.5)}, "sampling.top_p"),
    ({"sampling": ipb.RandomSampling(min_p=2.0)}, "sampling.min_p"),
    ({"decoding": ipb.DecodingParameters(repetition_penalty=-1.0)}, "decoding.repetition_penalty"),
    ({"decoding": ipb.DecodingParameters(presence_penalty=5.0)}, "decoding.presence_penalty"),
    ({"stopping": ipb.StoppingCriteria(min_new_tokens=30, max_new_tokens=10)}, "stopping.min_new_tokens"),
    ({"response": ipb.ResponseOptions(output_logprobs=True, output_candidates=ipb.CandidateTokens(top_n=99))},
     "response.output_candidates"),
    ({"request_id": "x" * 10_000}, "request_id"),
])
def test_bad_values_are_refused_by_their_vllm_path(fields: dict[str, Any], path: str) -> None:
    assert path in refused(**fields)


def test_bad_fields_are_listed_together() -> None:
    got = refused(sampling=ipb.RandomSampling(top_p=2.0), kv=ipb.KVCacheParameters(cache_salt="s"))
    assert set(got) == {"sampling.top_p", "kv.cache_salt"}


def test_lora_adapters_by_lora_name_or_model_and_unknown_ones_not_found() -> None:
    adapters = ("sql", "chat")
    assert plan(ipb.GenerateRequest(text="hi", lora_name="chat"), MODEL, lora_adapters=adapters).lora_name == "chat"
    assert plan(ipb.GenerateRequest(text="hi", model="sql"), MODEL, lora_adapters=adapters).lora_name == "sql"
    assert plan(ipb.GenerateRequest(text="hi", model=MODEL), MODEL, lora_adapters=adapters).lora_name == ""
    for fields, served, message in (({"lora_name": "nope"}, adapters, "LoRA adapter `nope` not found"),
                                    ({"model": "nope"}, adapters, "model `nope` not found"),
                                    ({"lora_name": "sql"}, (), "LoRA adapter `sql` not found"),
                                    ({"model": "sql"}, (), "model `sql` not found")):
        with pytest.raises(ModelNotFound, match=message):
            plan(ipb.GenerateRequest(text="hi", **fields), MODEL, lora_adapters=served)


def test_a_prompt_is_required() -> None:
    with pytest.raises(ValidationError) as caught:
        plan(ipb.GenerateRequest(), MODEL)
    assert [v.field for v in caught.value.violations] == ["prompt"]


def test_model_must_be_the_served_one_or_empty() -> None:
    assert mapped(model="").params.max_tokens == DEFAULT_MAX_NEW_TOKENS
    with pytest.raises(ModelNotFound, match="other"):
        mapped(model="other")


def test_unary_generate_refuses_several_sequences() -> None:
    with pytest.raises(ValidationError) as caught:
        plan(ipb.GenerateRequest(text="x", temperature=1.0, sampling=ipb.RandomSampling(num_sequences=2)), MODEL,
             unary=True)
    assert [v.field for v in caught.value.violations] == ["sampling.num_sequences"]
    streamed = ipb.GenerateRequest(text="x", temperature=1.0, sampling=ipb.RandomSampling(num_sequences=2))
    assert plan(streamed, MODEL).params.n == 2
