"""SMG's GenerateRequest -> engine requests (engine_svc/api/smg/request.py): every field honoured or refused.

The descriptor walk fails when SMG's proto gains a field that engine_svc/api/smg/request.py neither maps nor refuses
(update the vendored protos and this test finds it); each refused field, set alone, is refused naming
it; each honoured sampling field, set alone, changes the engine request.
"""

from __future__ import annotations

from typing import Any

import pytest
from tandem.vendor.smg import vllm_engine_pb2 as vpb

from engine_svc.api.smg import request as smg_request
from engine_svc.api.smg.request import HONOURED, REFUSED, Refused, plan_request
from shared_runtime import contract as c

EOS = [7, 9]
MAX_LEN = 64


def plan(**fields: Any) -> smg_request.SmgPlan:
    sampling = fields.pop("sampling_params", vpb.SamplingParams())
    msg = vpb.GenerateRequest(request_id="r1", tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]),
                              sampling_params=sampling, **fields)
    return plan_request(msg, max_model_len=MAX_LEN, eos_token_ids=EOS, arrival_time=1.0)


def refusal(**fields: Any) -> Refused:
    with pytest.raises(Refused) as caught:
        plan(**fields)
    return caught.value


@pytest.mark.parametrize("message", [vpb.GenerateRequest, vpb.TokenizedInput, vpb.SamplingParams],
                         ids=lambda m: m.DESCRIPTOR.name)
def test_every_field_of_the_request_is_honoured_or_refused(message: Any) -> None:
    name = message.DESCRIPTOR.name
    fields = {f.name for f in message.DESCRIPTOR.fields}
    unhandled = fields - HONOURED[name] - REFUSED[name]
    assert not unhandled, f"{name} fields neither honoured nor refused by engine_svc/api/smg/request.py: {sorted(unhandled)}"
    assert not HONOURED[name] & REFUSED[name]
    assert HONOURED[name] | REFUSED[name] == fields, "the tables name fields the proto does not have"


REFUSED_VALUES: dict[str, dict[str, Any]] = {
    "kv_transfer_params": {"kv_transfer_params": vpb.KvTransferParams(remote_host="h", remote_port=1)},
    "mm_inputs": {"mm_inputs": vpb.MultimodalInputs(im_token_id=5)},
    "extra_mm_inputs": {"extra_mm_inputs": [vpb.MultimodalInputs(im_token_id=5)]},
    "media_refs": {"media_refs": vpb.MediaRefs(items=[vpb.MediaRef(url="http://x")])},
}


@pytest.mark.parametrize("field", sorted(REFUSED["GenerateRequest"] - {"text"}))
def test_each_refused_field_is_refused_by_name(field: str) -> None:
    error = refusal(**REFUSED_VALUES[field])
    assert error.field == field and field in str(error)


def test_kv_transfer_params_json_carries_smg_s_pd_legs() -> None:
    """SMG's NIXL-mode prefill leg (its two keys) keeps the blocks; the relayed handoff pulls them."""
    (prefill,) = plan(kv_transfer_params_json='{"do_remote_decode":true,"do_remote_prefill":false}').children
    assert prefill.kv_transfer_params == c.KvTransferParams(do_remote_decode=True)
    handoff = ('{"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":"e1","remote_host":"10.0.0.2",'
               '"remote_port":50051,"remote_request_id":"r1","remote_block_ids":[4,5],"remote_num_tokens":3}')
    (decode,) = plan(kv_transfer_params_json=handoff).children
    assert decode.kv_transfer_params == c.KvTransferParams(
        do_remote_prefill=True, remote_engine_id="e1", remote_host="10.0.0.2", remote_port=50051,
        remote_request_id="r1", remote_block_ids=[4, 5], remote_num_tokens=3)
    assert plan(kv_transfer_params_json='{"do_remote_decode":false}').children[0].kv_transfer_params is None


@pytest.mark.parametrize("text, why", [
    ("[1]", "must be an object"), ("{", "is not JSON"), ("[" * 4000, "is not JSON"),
    ('{"do_remote_decode":true,"transfer_id":"x"}', "transfer_id"),
    ('{"do_remote_prefill":true,"remote_host":"h","remote_port":1}', "remote_request_id"),
    ('{"do_remote_decode":true,"remote_block_ids":' + str(list(range(20_000))) + "}", "longer than any handoff"),
])
def test_bad_kv_transfer_params_json_is_refused_naming_it(text: str, why: str) -> None:
    error = refusal(kv_transfer_params_json=text)
    assert error.field == "kv_transfer_params_json" and why in str(error), str(error)


def test_a_handoff_serves_one_sample() -> None:
    error = refusal(kv_transfer_params_json='{"do_remote_decode":true}', sampling_params=vpb.SamplingParams(n=2))
    assert error.field == "kv_transfer_params_json" and "n is 2" in str(error)


def test_text_input_is_refused() -> None:
    msg = vpb.GenerateRequest(request_id="r", text="hello")
    with pytest.raises(Refused) as caught:
        plan_request(msg, max_model_len=MAX_LEN, eos_token_ids=EOS, arrival_time=0.0)
    assert caught.value.field == "text" and "token ids" in str(caught.value)


def test_defaults_follow_smg_s_vllm_servicer() -> None:
    p = plan()
    (child,) = p.children
    sp = child.sampling_params
    assert child.request_id == "r1" and child.prompt_token_ids == [1, 2, 3] and child.eos_token_ids == EOS
    assert (sp.temperature, sp.top_p, sp.repetition_penalty, sp.max_tokens, sp.top_k) == (1.0, 1.0, 1.0, None, 0)
    assert (p.stream, p.logprobs, p.prompt_logprobs, p.stop) == (False, None, None, [])


def so(p: smg_request.SmgPlan) -> c.StructuredOutputs:
    return p.children[0].sampling_params.structured_outputs or c.StructuredOutputs()


HONOURED_VALUES: dict[str, tuple[dict[str, Any], Any]] = {
    # field: (SamplingParams kwargs, how the plan shows it)
    "temperature": ({"temperature": 0.5}, lambda p: p.children[0].sampling_params.temperature == 0.5),
    "top_p": ({"top_p": 0.5}, lambda p: p.children[0].sampling_params.top_p == 0.5),
    "top_k": ({"top_k": 5}, lambda p: p.children[0].sampling_params.top_k == 5),
    "min_p": ({"min_p": 0.25}, lambda p: p.children[0].sampling_params.min_p == 0.25),
    "frequency_penalty": ({"frequency_penalty": 0.5}, lambda p: p.children[0].sampling_params.frequency_penalty == 0.5),
    "presence_penalty": ({"presence_penalty": 0.5}, lambda p: p.children[0].sampling_params.presence_penalty == 0.5),
    "repetition_penalty": ({"repetition_penalty": 1.5},
                           lambda p: p.children[0].sampling_params.repetition_penalty == 1.5),
    "max_tokens": ({"max_tokens": 5}, lambda p: p.children[0].sampling_params.max_tokens == 5),
    "min_tokens": ({"min_tokens": 2}, lambda p: p.children[0].sampling_params.min_tokens == 2),
    "stop": ({"stop": ["x"]}, lambda p: p.stop == ["x"]),
    "stop_token_ids": ({"stop_token_ids": [4]}, lambda p: p.children[0].sampling_params.stop_token_ids == [4]),
    "skip_special_tokens": ({"skip_special_tokens": True}, lambda p: p.skip_special_tokens),
    "ignore_eos": ({"ignore_eos": True}, lambda p: p.children[0].sampling_params.ignore_eos),
    "n": ({"n": 3}, lambda p: [ch.request_id for ch in p.children] == ["r1-0", "r1-1", "r1-2"]),
    "logprobs": ({"logprobs": 2}, lambda p: p.logprobs == 2 and p.children[0].sampling_params.logprobs == 2),
    "prompt_logprobs": ({"prompt_logprobs": 1},
                        lambda p: p.prompt_logprobs == 1 and p.children[0].sampling_params.prompt_logprobs == 1),
    "seed": ({"seed": 11}, lambda p: p.children[0].sampling_params.seed == 11),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True}, lambda p: p.include_stop_str_in_output),
    "logit_bias": ({"logit_bias": {5: 2.0}}, lambda p: p.children[0].sampling_params.logit_bias == {5: 2.0}),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 2}, lambda p: p.prompt_token_ids == [2, 3]),
    "json_schema": ({"json_schema": '{"type": "object"}'},
                    lambda p: so(p).json == '{"type": "object"}'),
    "regex": ({"regex": "a+"}, lambda p: so(p).regex == "a+"),
    "grammar": ({"grammar": 'root ::= "a"'},
                lambda p: so(p).grammar == 'root ::= "a"'),
    "structural_tag": ({"structural_tag": "{}"},
                       lambda p: so(p).structural_tag == "{}"),
    "json_object": ({"json_object": True}, lambda p: so(p).json_object),
    "choice": ({"choice": vpb.ChoiceConstraint(choices=["a", "b"])},
               lambda p: so(p).choice == ["a", "b"]),
}
# Honoured without changing the engine request: text-only or no-op for this engine (engine_svc/api/smg/request.py says why).
TEXT_ONLY = {"spaces_between_special_tokens", "grammar_from_first_token"}


def test_every_honoured_sampling_field_has_its_check() -> None:
    assert set(HONOURED_VALUES) | TEXT_ONLY == HONOURED["SamplingParams"]


@pytest.mark.parametrize("field", sorted(HONOURED_VALUES))
def test_each_honoured_sampling_field_reaches_the_engine_request(field: str) -> None:
    kwargs, shows = HONOURED_VALUES[field]
    assert shows(plan(sampling_params=vpb.SamplingParams(**kwargs))), field
    assert not shows(plan()), f"{field}: the default already looks set"


def test_n_samples_differ_in_seed_and_keep_the_same_prompt() -> None:
    p = plan(sampling_params=vpb.SamplingParams(n=2, seed=5, temperature=0.7))
    assert [ch.sampling_params.seed for ch in p.children] == [5, 6]
    assert all(ch.prompt_token_ids == [1, 2, 3] for ch in p.children)


@pytest.mark.parametrize("sampling, field", [
    (vpb.SamplingParams(top_p=1.5), "sampling_params.top_p"),
    (vpb.SamplingParams(logprobs=-1), "sampling_params.logprobs"),
    (vpb.SamplingParams(n=2, temperature=0.0), "sampling_params.n"),
    (vpb.SamplingParams(stop=[""]), "sampling_params.stop"),
    (vpb.SamplingParams(truncate_prompt_tokens=0), "sampling_params.truncate_prompt_tokens"),
    (vpb.SamplingParams(choice=vpb.ChoiceConstraint()), "sampling_params.structured_outputs.choice"),
])
def test_bad_values_are_refused_with_the_contract_s_rules(sampling: vpb.SamplingParams, field: str) -> None:
    error = refusal(sampling_params=sampling)
    assert error.field == field and field in str(error)


def test_prompt_bounds() -> None:
    assert refusal(data_parallel_rank=1).field == "data_parallel_rank"
    msg = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=list(range(MAX_LEN + 1))))
    with pytest.raises(Refused, match="max_model_len"):
        plan_request(msg, max_model_len=MAX_LEN, eos_token_ids=EOS, arrival_time=0.0)
    empty = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput())
    with pytest.raises(Refused, match="at least one token"):
        plan_request(empty, max_model_len=MAX_LEN, eos_token_ids=EOS, arrival_time=0.0)
    assert plan(data_parallel_rank=0).children[0].prompt_token_ids == [1, 2, 3]


def test_the_engine_request_passes_the_engine_s_own_rules() -> None:
    p = plan(sampling_params=vpb.SamplingParams(temperature=0.3, logprobs=3, stop_token_ids=[4], n=2, seed=1))
    for child in p.children:
        assert isinstance(child, c.EngineCoreRequest) and child.sampling_params.violations(512) == []
