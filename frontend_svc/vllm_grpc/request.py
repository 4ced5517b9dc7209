"""vLLM's `vllm.GenerateRequest` (the `vllm.Inference` API) -> what the generation path takes.

Every field of the request and of the messages inside it is either honoured with vLLM's semantics or
refused with INVALID_ARGUMENT naming it (`HONOURED` / `REFUSED`, which tests/frontend/test_vllm_grpc_request.py
checks against the vendored descriptors, so a field added to vLLM's proto fails that test until it is mapped).

vLLM's gRPC defaults, where they differ from tandem's own API (its Rust server's request conversion):
- `temperature` unset -> "the model-specific default or 0": the model's generation_config.json
  `temperature` when it has one (vLLM's model defaults), else 0 (greedy);
- `stopping.max_new_tokens` 0 -> 20 (the proto's "Default (0) is currently 20");
- proto3 zeros mean "default": `top_k`, `top_p`, `min_p` and `repetition_penalty` 0 -> the model's
  generation_config.json value when it has one, else no top-k, 1, 0 and 1; `num_sequences` 0 -> 1;
- `response.output_text` and `response.skip_special_tokens` unset -> true;
- `truncate_prompt_tokens` N > 0 keeps the last N prompt tokens;
- `model` empty -> the served model; a served LoRA adapter's name -> that adapter; another name -> NOT_FOUND
  (`ModelNotFound`); `lora_name` (when set, it wins over `model`) must name a served adapter, else NOT_FOUND.

Where tandem goes beyond vLLM: `sampling.num_sequences` > 1 streams every sequence with its `index`
(vLLM's server refuses it); the unary `Generate` answers one sequence, so it refuses n > 1 by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.vendor.vllm import inference_pb2 as ipb

from frontend_svc.processor import Prompt, PromptOptions
from shared_runtime import limits
from shared_runtime.contract import SamplingParams, StructuredOutputs
from shared_runtime.violations import FieldViolation, ValidationError

DEFAULT_MAX_NEW_TOKENS = 20  # vLLM's gRPC default for stopping.max_new_tokens == 0

# Message name -> the fields mapped here (with vLLM's meaning) / refused when set.
HONOURED: dict[str, frozenset[str]] = {
    "GenerateRequest": frozenset({
        "request_id", "model", "text", "token_ids", "temperature", "sampling", "decoding", "stopping",
        "response", "truncate_prompt_tokens", "priority", "kv", "lora_name"}),
    "RandomSampling": frozenset({"num_sequences", "top_k", "top_p", "min_p", "seed"}),
    "DecodingParameters": frozenset({
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
        "json", "regex", "choice", "grammar", "json_object", "structural_tag"}),
    "StoppingCriteria": frozenset({
        "max_new_tokens", "min_new_tokens", "stop_token_ids", "stop_strings", "include_stop_strings",
        "ignore_eos"}),
    "ResponseOptions": frozenset({
        "prompt_token_ids", "prompt_logprobs", "prompt_candidates", "output_text", "output_token_ids",
        "output_logprobs", "output_candidates", "skip_special_tokens"}),
    "CandidateTokens": frozenset({"top_n"}),
    "KVCacheParameters": frozenset(),
    "TokenIds": frozenset({"ids"}),
    "StringChoices": frozenset({"choices"}),
}
REFUSED: dict[str, dict[str, str]] = {
    "GenerateRequest": {
        "session_id": "sessions (streaming input) are not supported by this server",
        "media": "multimodal inputs are not supported by this server",
    },
    "KVCacheParameters": {
        "bypass_prefix_cache": "bypassing the prefix cache is not supported by this server",
        "cache_salt": "cache salts are not supported by this server",
        "kv_transfer_params": "KV transfer (disaggregated prefill) is not supported by this server",
        "ec_transfer_params": "encoder-cache transfer is not supported by this server",
    },
    "CandidateTokens": {
        "token_ids": "candidates by token id are not supported; use top_n",
        "all": "candidates over the whole vocabulary are not supported; use top_n (at most "
               f"{limits.MAX_LOGPROBS})",
    },
    "RandomSampling": {}, "DecodingParameters": {}, "StoppingCriteria": {}, "ResponseOptions": {},
    "TokenIds": {}, "StringChoices": {},
}

# `SamplingParams` field -> where the vLLM request sets it (for naming a bad value).
_PATHS = {
    "temperature": "temperature", "n": "sampling.num_sequences", "top_k": "sampling.top_k",
    "top_p": "sampling.top_p", "min_p": "sampling.min_p", "seed": "sampling.seed",
    "presence_penalty": "decoding.presence_penalty", "frequency_penalty": "decoding.frequency_penalty",
    "repetition_penalty": "decoding.repetition_penalty", "logit_bias": "decoding.logit_bias",
    "allowed_token_ids": "decoding.allowed_token_ids", "structured_outputs": "decoding.structured_output",
    "max_tokens": "stopping.max_new_tokens", "min_tokens": "stopping.min_new_tokens",
    "stop_token_ids": "stopping.stop_token_ids", "stop": "stopping.stop_strings",
    "logprobs": "response.output_candidates", "prompt_logprobs": "response.prompt_candidates",
    # the processor's names for the prompt
    "text": "text", "token_ids": "token_ids.ids", "token_ids.ids": "token_ids.ids",
}


class ModelNotFound(Exception):
    """`model` names a model this server does not serve (vLLM answers NOT_FOUND)."""


@dataclass(frozen=True)
class ResponseShape:
    """What each response carries (vLLM's ResponseOptions, defaults applied)."""

    prompt_token_ids: bool = False
    prompt_logprobs: bool = False
    output_text: bool = True
    output_token_ids: bool = False
    output_logprobs: bool = False


@dataclass(frozen=True)
class InferencePlan:
    """A request as the generation path takes it."""

    request_id: str | None  # None: the frontend assigns one
    prompt: Prompt
    params: SamplingParams
    options: PromptOptions
    priority: int
    shape: ResponseShape
    lora_name: str = ""  # the LoRA adapter to run under ("" = the base model)


def field_path(name: str) -> str:
    """The vLLM request path of a `SamplingParams` / processor field (`top_p` -> `sampling.top_p`)."""
    bare = name.removeprefix("sampling_params.")
    return _PATHS.get(bare, bare)


def renamed(error: ValidationError) -> ValidationError:
    """`error` with its fields named as in vLLM's request."""
    return ValidationError(FieldViolation(field_path(v.field), v.description) for v in error.violations)


def plan(request: ipb.GenerateRequest, served_model: str, *, unary: bool = False,
         defaults: Mapping[str, float] | None = None, lora_adapters: Sequence[str] = ()) -> InferencePlan:
    """Map a request (ValidationError listing every bad or refused field, by its vLLM path;
    ModelNotFound for another model's or adapter's name); `defaults`: the model's sampling defaults
    (generation_config); `lora_adapters`: the LoRA adapters the engines serve."""
    if request.model and request.model != served_model and request.model not in lora_adapters:
        raise ModelNotFound(f"model `{request.model}` not found")
    if request.lora_name and request.lora_name not in lora_adapters:
        raise ModelNotFound(f"LoRA adapter `{request.lora_name}` not found")
    lora_name = request.lora_name or (request.model if request.model in lora_adapters else "")
    bad = refused_fields(request)
    if unary and request.sampling.num_sequences > 1:
        bad.append(FieldViolation("sampling.num_sequences", "Generate answers one sequence; use "
                                                            "GenerateStream for num_sequences > 1"))
    bad_id = limits.request_id_violation(request.request_id)
    if bad_id is not None:
        bad.append(bad_id)
    prompt: Prompt | None = None
    kind = request.WhichOneof("prompt")
    if kind == "text":
        prompt = str(request.text)
    elif kind == "token_ids":
        prompt = request.token_ids.ids
    else:
        bad.append(FieldViolation("prompt", "set one of text or token_ids"))
    params: SamplingParams | None = None
    try:
        params = sampling_params(request, defaults or {})
    except ValidationError as exc:
        bad.extend(renamed(exc).violations)
    if bad or prompt is None or params is None:
        raise ValidationError(bad)
    options = PromptOptions(truncate_prompt_tokens=request.truncate_prompt_tokens or None, truncation_side="left")
    return InferencePlan(request.request_id or None, prompt, params, options, request.priority,
                         response_shape(request.response), lora_name)


def refused_fields(request: ipb.GenerateRequest) -> list[FieldViolation]:
    """A violation for each refused field the request sets to something vLLM would act on (empty strings
    and lists, false flags and an empty token-id selector are vLLM's "unset")."""
    why = REFUSED["GenerateRequest"]
    bad = [FieldViolation(name, why[name]) for name in ("session_id", "media") if getattr(request, name)]
    kv, why = request.kv, REFUSED["KVCacheParameters"]
    bad += [FieldViolation(f"kv.{name}", why[name]) for name in ("bypass_prefix_cache", "cache_salt")
            if getattr(kv, name)]
    bad += [FieldViolation(f"kv.{name}", why[name]) for name in ("kv_transfer_params", "ec_transfer_params")
            if kv.HasField(name)]
    why = REFUSED["CandidateTokens"]
    for name in ("prompt_candidates", "output_candidates"):
        select = getattr(request.response, name)
        kind = select.WhichOneof("select")
        if (kind == "token_ids" and select.token_ids.ids) or (kind == "all" and select.all):
            bad.append(FieldViolation(f"response.{name}.{kind}", why[kind]))
    return bad


def sampling_params(request: ipb.GenerateRequest, defaults: Mapping[str, float] | None = None) -> SamplingParams:
    """vLLM's gRPC sampling defaults applied, the model's (`defaults`) first (module docstring); raises
    ValidationError (bare names)."""
    sampling, decoding, stopping, response = request.sampling, request.decoding, request.stopping, request.response
    model = defaults or {}
    return SamplingParams(
        temperature=request.temperature if request.HasField("temperature") else model.get("temperature", 0.0),
        n=sampling.num_sequences or 1,
        top_k=sampling.top_k or int(model.get("top_k", 0)),
        top_p=sampling.top_p or model.get("top_p", 1.0),
        min_p=sampling.min_p or model.get("min_p", 0.0),
        seed=(sampling.seed % (1 << 64)) if sampling.HasField("seed") else None,
        presence_penalty=decoding.presence_penalty,
        frequency_penalty=decoding.frequency_penalty,
        repetition_penalty=decoding.repetition_penalty or model.get("repetition_penalty", 1.0),
        logit_bias=dict(decoding.logit_bias),
        allowed_token_ids=list(decoding.allowed_token_ids),
        structured_outputs=structured_outputs(decoding),
        max_tokens=stopping.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        min_tokens=stopping.min_new_tokens,
        stop_token_ids=list(stopping.stop_token_ids),
        stop=list(stopping.stop_strings),
        include_stop_str_in_output=stopping.include_stop_strings,
        ignore_eos=stopping.ignore_eos,
        logprobs=_top_n(response.output_candidates) if response.output_logprobs else None,
        prompt_logprobs=_top_n(response.prompt_candidates) if response.prompt_logprobs else None,
        skip_special_tokens=response.skip_special_tokens if response.HasField("skip_special_tokens") else True,
    )


def _top_n(candidates: ipb.CandidateTokens) -> int:
    """How many alternatives per position: `top_n`, else 0 (only the chosen token: vLLM's default)."""
    return int(candidates.top_n) if candidates.WhichOneof("select") == "top_n" else 0


def structured_outputs(decoding: ipb.DecodingParameters) -> StructuredOutputs | None:
    """The structured_output oneof (`json_object: false` is none, as vLLM reads it)."""
    kind = decoding.WhichOneof("structured_output")
    if kind is None or (kind == "json_object" and not decoding.json_object):
        return None
    if kind == "choice":
        return StructuredOutputs(choice=list(decoding.choice.choices))
    return StructuredOutputs(**{kind: getattr(decoding, kind)})


def response_shape(options: ipb.ResponseOptions) -> ResponseShape:
    return ResponseShape(
        prompt_token_ids=options.prompt_token_ids, prompt_logprobs=options.prompt_logprobs,
        output_text=options.output_text if options.HasField("output_text") else True,
        output_token_ids=options.output_token_ids, output_logprobs=options.output_logprobs)
