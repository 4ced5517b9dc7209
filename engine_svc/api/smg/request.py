"""SMG's `vllm.grpc.engine.GenerateRequest` -> the engine requests it asks for (the contract's structs).

`plan_request(msg, ...)` returns an `SmgPlan`: one `EngineCoreRequest` per sample (n > 1 fans out into
ids `<request_id>-<i>`; n = 1 keeps the id), the stop strings the servicer checks on the text, and how
to answer (stream, logprobs). It raises `Refused(field, why)` for a request tandem cannot serve as
asked; the servicer answers it with INVALID_ARGUMENT naming the field.

Every field of the request is either honoured or refused, never ignored: `HONOURED` and `REFUSED` name
each field of `GenerateRequest`, `TokenizedInput` and `SamplingParams` (tests/engine/test_smg_request.py
fails on a field in neither). Semantics are those of SMG's own vLLM servicer:
- proto3 zeros mean "unset": top_p 0 -> 1, repetition_penalty 0 -> 1, n 0 -> 1, an unset temperature
  is 1, an unset max_tokens fills the context window;
- `constraint` maps onto the contract's `StructuredOutputs` (json_schema -> json, the others by name);
- `truncate_prompt_tokens` keeps the prompt's last k ids (-1: the last max_model_len);
- `stop` strings are matched on the detokenized output (stops.py), `include_stop_str_in_output`,
  `skip_special_tokens` and `spaces_between_special_tokens` shape only that text: the token ids sent
  are the same either way (as vLLM's servicer sends them; the gateway renders the text);
- `grammar_from_first_token`: tandem runs no reasoning parser, so a constraint always starts at the
  first generated token, which is what both values ask of such an engine;
- `data_parallel_rank`: this engine is rank 0 of 1; any other rank is refused;
- `kv_transfer_params_json`: P/D driven by SMG (vLLM's object, NIXL's keys: `_kv_transfer`); the typed
  `kv_transfer_params` (Mooncake's host and port) is refused.
Then the contract's own rules run (`SamplingParams` validates ranges, n, stops, logprobs, sizes), their
field names prefixed with `sampling_params.`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.vendor.smg import vllm_engine_pb2 as vpb

from shared_runtime import contract as c
from shared_runtime import kv_transfer_params, limits
from shared_runtime.violations import ValidationError, describe

# Field -> what tandem does with it (the table the descriptor test walks).
HONOURED: dict[str, frozenset[str]] = {
    "GenerateRequest": frozenset({"request_id", "tokenized", "sampling_params", "stream", "data_parallel_rank",
                                  "kv_transfer_params_json"}),
    "TokenizedInput": frozenset({"original_text", "input_ids"}),  # original_text: for reference only (proto)
    "SamplingParams": frozenset({
        "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "max_tokens", "min_tokens", "stop", "stop_token_ids", "skip_special_tokens",
        "spaces_between_special_tokens", "ignore_eos", "n", "logprobs", "prompt_logprobs", "seed",
        "include_stop_str_in_output", "logit_bias", "truncate_prompt_tokens", "grammar_from_first_token",
        "json_schema", "regex", "grammar", "structural_tag", "json_object", "choice"}),
}
# Refused when set: tandem serves text models; its KV transfer speaks the JSON handoff, not Mooncake's.
REFUSED: dict[str, frozenset[str]] = {
    "GenerateRequest": frozenset({"text", "kv_transfer_params", "mm_inputs", "extra_mm_inputs", "media_refs"}),
    "TokenizedInput": frozenset(),
    "SamplingParams": frozenset(),
}
_REFUSALS = (
    ("text", "text input is not served: send token ids (`tokenized`); the gateway tokenizes"),
    ("kv_transfer_params", "Mooncake's typed KV transfer is not supported: tandem's engines hand KV over with "
                           "kv_transfer_params_json (NIXL's keys)"),
    ("mm_inputs", "multimodal inputs are not supported: tandem serves text models"),
    ("extra_mm_inputs", "multimodal inputs are not supported: tandem serves text models"),
    ("media_refs", "media references are not supported: tandem serves text models"),
)
_MAX_KV_JSON_CHARS_PER_TOKEN = 12  # a block id and its comma, per token (block_size 1 at worst)
_CONSTRAINT_FIELD = {"json_schema": "json", "regex": "regex", "grammar": "grammar",
                     "structural_tag": "structural_tag", "json_object": "json_object", "choice": "choice"}


class Refused(ValueError):
    """A request tandem will not serve as asked; `field` names the request's field."""

    def __init__(self, field: str, why: str, *, message: str | None = None) -> None:
        super().__init__(message or f"{field}: {why}")
        self.field = field


@dataclass(frozen=True)
class SmgPlan:
    """What one Generate call runs and how it answers."""

    request_id: str
    children: list[c.EngineCoreRequest]  # index i is the sample with `index` i
    stop: list[str]  # matched on the text by the servicer
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    stream: bool
    logprobs: int | None
    prompt_logprobs: int | None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.children[0].prompt_token_ids


def child_ids(request_id: str, n: int) -> list[str]:
    """Engine request ids of the n samples (the id itself for one)."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


def plan_request(msg: vpb.GenerateRequest, *, max_model_len: int, eos_token_ids: Sequence[int],
                 arrival_time: float) -> SmgPlan:
    """The engine requests `msg` asks for; raises `Refused` naming the first field tandem cannot honour."""
    for name, why in _REFUSALS:
        if _is_set(msg, name):
            raise Refused(name, why)
    if msg.WhichOneof("input") != "tokenized":
        raise Refused("tokenized", "the request has no input: send token ids")
    ids = msg.tokenized.input_ids
    if not ids:
        raise Refused("tokenized.input_ids", "the prompt must hold at least one token id")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise Refused("data_parallel_rank", f"this engine is data-parallel rank 0 of 1, got {msg.data_parallel_rank}")
    p = msg.sampling_params
    prompt = _truncated(ids, p, max_model_len)
    if len(prompt) > max_model_len:
        raise Refused("tokenized.input_ids", f"the prompt has {len(prompt)} tokens, more than max_model_len "
                                             f"({max_model_len})")
    params = _sampling_params(p)
    kv = _kv_transfer(msg, max_model_len, params.n)
    request_id = msg.request_id
    children = [c.EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt),
                                    sampling_params=params.engine_params(seed_offset=i),
                                    eos_token_ids=list(eos_token_ids), arrival_time=arrival_time,
                                    kv_transfer_params=kv)
                for i, rid in enumerate(child_ids(request_id, params.n))]
    return SmgPlan(request_id=request_id, children=children, stop=list(params.stop),
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   skip_special_tokens=params.skip_special_tokens, stream=msg.stream,
                   logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs)


def _kv_transfer(msg: vpb.GenerateRequest, max_model_len: int, n: int) -> c.KvTransferParams | None:
    """P/D driven by SMG: `kv_transfer_params_json` is vLLM's object (NIXL's keys): the prefill leg's
    `do_remote_decode`, the decode leg's handoff (shared_runtime/kv_transfer_params.py). One sample only:
    SMG relays a handoff for n = 1 (the blocks are one consumer's)."""
    if not msg.HasField("kv_transfer_params_json"):
        return None
    text = msg.kv_transfer_params_json
    if len(text) > _MAX_KV_JSON_CHARS_PER_TOKEN * max_model_len + 4096:
        raise Refused("kv_transfer_params_json", f"{len(text)} characters: longer than any handoff for a "
                                                 f"{max_model_len}-token context")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise Refused("kv_transfer_params_json", "is not JSON") from None
    try:
        params = kv_transfer_params.parse(value, max_model_len)
    except ValidationError as exc:
        raise Refused("kv_transfer_params_json", describe(exc.violations)) from None
    if params is not None and n != 1:
        raise Refused("kv_transfer_params_json", f"a disaggregated request makes one sample (n is {n})")
    return params


def _is_set(msg: vpb.GenerateRequest, name: str) -> bool:
    field = msg.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        return len(getattr(msg, name)) > 0
    return msg.HasField(name)


def _truncated(ids: Sequence[int], p: vpb.SamplingParams, max_model_len: int) -> Sequence[int]:
    if not p.HasField("truncate_prompt_tokens"):
        return ids
    keep = p.truncate_prompt_tokens
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise Refused("sampling_params.truncate_prompt_tokens", f"must be -1 or at least 1, got {keep}")
    return ids[-keep:]


def _sampling_params(p: vpb.SamplingParams) -> c.SamplingParams:
    """The contract's SamplingParams (validated by its constructor) with SMG's unset-means-default rules."""
    if len(p.stop_token_ids) > limits.MAX_TOKEN_IDS or len(p.logit_bias) > limits.MAX_LOGIT_BIAS:
        field = "stop_token_ids" if len(p.stop_token_ids) > limits.MAX_TOKEN_IDS else "logit_bias"
        raise Refused(f"sampling_params.{field}", "too many entries")
    try:
        return c.SamplingParams(
            temperature=p.temperature if p.HasField("temperature") else 1.0,
            top_p=p.top_p if p.top_p != 0.0 else 1.0,
            top_k=p.top_k, min_p=p.min_p,
            frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
            repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0,
            max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
            min_tokens=p.min_tokens,
            stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
            skip_special_tokens=p.skip_special_tokens, ignore_eos=p.ignore_eos,
            n=p.n if p.n > 0 else 1,
            logprobs=p.logprobs if p.HasField("logprobs") else None,
            prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
            seed=p.seed if p.HasField("seed") else None,
            include_stop_str_in_output=p.include_stop_str_in_output,
            logit_bias=dict(p.logit_bias),
            structured_outputs=_constraint(p),
        )
    except ValidationError as exc:
        violations = [v.with_prefix("sampling_params") for v in exc.violations]
        raise Refused(violations[0].field, "", message=describe(violations)) from None


def _constraint(p: vpb.SamplingParams) -> c.StructuredOutputs | None:
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return c.StructuredOutputs(choice=list(p.choice.choices))
    if kind == "json_object":
        if not p.json_object:
            raise Refused("sampling_params.json_object", "must be true when set")
        return c.StructuredOutputs(json_object=True)
    return c.StructuredOutputs(**{_CONSTRAINT_FIELD[kind]: getattr(p, kind)})
