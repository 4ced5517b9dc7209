"""The public gRPC API (`tandem.v1`) <-> the frontend library's objects.

GenerateRequest -> prompt + `SamplingParams` (the one place the gRPC API's sampling fields are mapped;
the OpenAI API's is frontend_svc/openai/bodies.py), `CompletionDelta` -> GenerateResponse. What goes to
the engine is converted by shared_runtime/to_pb.py.

Invariants:
- An unset optional SamplingParams field means the documented default (temperature, top_p,
  repetition_penalty 1.0; max_tokens None = fill the context window; skip_special_tokens true);
  n 0 or 1 means one completion.
- Validation errors carry dot paths of the public proto (`sampling_params.top_p`, `prompt`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.v1 import generation_pb2 as pb

from frontend_svc.outputs import CompletionDelta, TokenLogprob
from frontend_svc.processor import ChatPrompt, Prompt
from shared_runtime.contract import SamplingParams
from shared_runtime.from_pb import structured_outputs_from_pb
from shared_runtime.violations import FieldViolation, ValidationError

_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


# ---- public requests -------------------------------------------------------------------------------


def prompt_from_pb(request: pb.GenerateRequest) -> Prompt:
    """The prompt oneof as the processor's `Prompt` (text, token ids or ChatPrompt)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return str(request.text)
    if kind == "token_ids":
        return request.token_ids.ids  # copied by the processor once its length is known to fit
    if kind == "chat":
        return chat_from_pb(request.chat)
    raise ValidationError.single("prompt", "set exactly one of text, token_ids or chat")


def chat_from_pb(chat: pb.Chat) -> ChatPrompt:
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    return ChatPrompt(messages=messages, add_generation_prompt=chat.add_generation_prompt)


def sampling_params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Validated `SamplingParams`; raises `ValidationError` with `sampling_params.*` paths."""
    has = msg.HasField
    try:
        return SamplingParams(
            temperature=msg.temperature if has("temperature") else 1.0,
            top_p=msg.top_p if has("top_p") else 1.0,
            top_k=msg.top_k if has("top_k") else 0,
            min_p=msg.min_p if has("min_p") else 0.0,
            seed=msg.seed if has("seed") else None,
            max_tokens=msg.max_tokens if has("max_tokens") else None,
            min_tokens=msg.min_tokens,
            stop=list(msg.stop),
            stop_token_ids=list(msg.stop_token_ids),
            include_stop_str_in_output=msg.include_stop_str_in_output,
            ignore_eos=msg.ignore_eos,
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty if has("repetition_penalty") else 1.0,
            logprobs=msg.logprobs if has("logprobs") else None,
            prompt_logprobs=msg.prompt_logprobs if has("prompt_logprobs") else None,
            n=max(msg.n, 1),
            skip_special_tokens=msg.skip_special_tokens if has("skip_special_tokens") else True,
            logit_bias=dict(msg.logit_bias),
            allowed_token_ids=list(msg.allowed_token_ids),
            bad_words=list(msg.bad_words),
            structured_outputs=(structured_outputs_from_pb(msg.structured_outputs)
                                if has("structured_outputs") else None),
            stream_interval=msg.stream_interval if has("stream_interval") else None,
        )
    except ValidationError as exc:
        raise ValidationError(v.with_prefix("sampling_params") for v in exc.violations) from None


def merge_violations(*errors: ValidationError | None) -> ValidationError | None:
    """One error holding every violation of `errors` (None when there are none)."""
    violations: list[FieldViolation] = [v for e in errors if e is not None for v in e.violations]
    return ValidationError(violations) if violations else None


# ---- public responses ------------------------------------------------------------------------------


def response_from_delta(delta: CompletionDelta) -> pb.GenerateResponse:
    """One GenerateResponse for one completion's step (the caller handles error deltas)."""
    response = pb.GenerateResponse(
        request_id=delta.request_id, index=delta.index, text=delta.text, token_ids=delta.token_ids)
    if delta.logprobs:
        _logprobs_into(response.logprobs, delta.logprobs)
    if delta.prompt_logprobs:
        _logprobs_into(response.prompt_logprobs, delta.prompt_logprobs)
    if delta.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS.get(delta.finish_reason, pb.FINISH_REASON_ABORT)
        if isinstance(delta.stop_reason, str):
            response.stop_string = delta.stop_reason
        elif delta.stop_reason is not None:
            response.stop_token_id = delta.stop_reason
        if delta.usage is not None:
            usage = response.usage
            usage.prompt_tokens = delta.usage.prompt_tokens
            usage.completion_tokens = delta.usage.completion_tokens
            usage.cached_prompt_tokens = delta.usage.cached_prompt_tokens
    return response


def _logprobs_into(dst: Any, entries: Sequence[TokenLogprob]) -> None:
    add = dst.add
    for entry in entries:
        item = add(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank)
        if entry.text is not None:
            item.text = entry.text
        add_top = item.top_logprobs.add
        for token_id, logprob in entry.top:
            add_top(token_id=token_id, logprob=logprob)
