"""`tandem.v1.GenerationService`: the public gRPC API, on the frontend's shared generation path.

A Generate call is the transport-neutral `Generation` (generation.py: admit -> tokenize off the loop ->
submit -> merged deltas -> close) with gRPC statuses around it; the request is read from and the
responses written to the wire by wire.py, errors mapped to statuses by status.py.

Invariants:
- Every error before the first response is raised before anything is sent, so gRPC answers
  Trailers-Only (client retry policies can retry it). Bad input is INVALID_ARGUMENT with BadRequest
  field violations listing the prompt's and the sampling parameters' problems together; too many calls
  in flight RESOURCE_EXHAUSTED; no ready engine, a broken engine stream or a draining server UNAVAILABLE;
  engine-reported errors keep the engine's code.
- A call that ends for any reason other than finishing (client cancel, deadline, error) aborts its
  unfinished completions in the engine (`Generation.close`, from the `finally` around the stream and
  from the RPC's done callback).
- Tokenize and Detokenize run on the tokenizer pool under one admission slot (`run_blocking`).
"""

from __future__ import annotations

import grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from frontend_svc.generation import GenerationBackend
from frontend_svc.grpc_api import status
from frontend_svc.grpc_api.wire import (
    chat_from_pb,
    merge_violations,
    prompt_from_pb,
    response_from_delta,
    sampling_params_from_pb,
)
from frontend_svc.processor import PreparedRequest, Prompt
from frontend_svc.service_error import NOT_FOUND, ServiceError
from frontend_svc.telemetry.call import GenerateCall, grpc_failure
from frontend_svc.telemetry.service import GENERATE_METHOD
from shared_runtime import limits
from shared_runtime.contract import SamplingParams
from shared_runtime.violations import ValidationError


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, frontend: GenerationBackend) -> None:
        self._f = frontend

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """A coroutine that writes its responses (`context.write`), not an async generator: a response
        then costs one await, not a hop through each generator between it and grpc's send loop. A failure
        is a status set on the call (`status.end`), never an exception kept by grpc with our frames."""
        call = self._f.begin_call(context.invocation_metadata() or (), GENERATE_METHOD, None)
        try:
            failure = await self._generate(request, context, call)
        except BaseException as exc:
            call.fail(*grpc_failure(exc, context))
            raise
        if failure is None:
            call.succeed()
            return
        status.end(context, failure)
        call.fail(*grpc_failure(None, context))

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        call: GenerateCall) -> grpc.Status | None:
        """Runs the request; the status it fails with, or None."""
        f = self._f
        try:
            generation = f.open_generation(max(1, request.sampling_params.n), call)
        except (ValidationError, ServiceError) as exc:
            return status.from_error(exc)
        # The RPC's end releases the request even if this generator stays suspended in a write until
        # garbage collection (a cancel or deadline during a write): the engine must not wait for that.
        context.add_done_callback(lambda _: generation.close())
        try:
            await generation.start(lambda: prepare(f, request))
            write = context.write
            async for deltas in generation.batches():
                for delta in deltas:
                    await write(response_from_delta(delta))
        except (ValidationError, ServiceError) as exc:
            return status.from_error(exc)
        finally:
            generation.close()
        return None

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse | None:
        f = self._f
        try:
            ids = await f.run_blocking(lambda r: tokenize(f, r), request)
        except (ValidationError, ServiceError) as exc:
            status.end(context, status.from_error(exc))
            return None
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=f.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse | None:
        f = self._f
        try:
            text = await f.run_blocking(lambda r: detokenize(f, r), request)
        except (ValidationError, ServiceError) as exc:
            status.end(context, status.from_error(exc))
            return None
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        f = self._f
        tokenizer = f.tokenizer
        info = pb.GetModelInfoResponse(
            model_name=f.model_name, max_model_len=f.max_model_len, vocab_size=f.vocab_size,
            eos_token_ids=tokenizer.eos_token_ids, has_chat_template=tokenizer.has_chat_template,
            num_ready_engines=f.num_ready_engines)
        if tokenizer.bos_token_id is not None:
            info.bos_token_id = tokenizer.bos_token_id
        return info


def prepare(f: GenerationBackend, request: pb.GenerateRequest) -> PreparedRequest:
    """Validate and tokenize (blocking: run through `Generation.start`); raises ValidationError listing the
    request id's, the prompt's and the sampling parameters' problems together."""
    params = prompt = None
    params_error = prompt_error = None
    try:
        params = sampling_params_from_pb(request.sampling_params)
    except ValidationError as exc:
        params_error = exc
    try:
        prompt = prompt_from_pb(request)
    except ValidationError as exc:
        prompt_error = exc
    if params is None or prompt is None:
        if prompt is not None:
            prompt_error = _prompt_violations(f, prompt)
        bad_id = limits.request_id_violation(request.request_id)
        id_error = ValidationError([bad_id]) if bad_id is not None else None
        raise merge_violations(id_error, prompt_error, params_error)  # type: ignore[misc]
    lora_name = served_lora(f, request.lora_name)
    prepared = f.process(prompt, params, request_id=request.request_id or None, priority=request.priority)
    prepared.lora_name = lora_name
    return prepared


def served_lora(f: GenerationBackend, name: str) -> str:
    """`name` when it is "" (the base model) or an adapter the engines serve; else ServiceError NOT_FOUND."""
    if name and name not in f.lora_adapters:
        served = ", ".join(f.lora_adapters) or "none"
        raise ServiceError(NOT_FOUND, f"lora_name: unknown LoRA adapter {name[:128]!r} (served: {served})",
                           "LORA_NOT_FOUND")
    return name


def tokenize(f: GenerationBackend, request: pb.TokenizeRequest) -> list[int]:
    """The Tokenize RPC's work (blocking: on the pool); raises ValidationError."""
    kind = request.WhichOneof("input")
    add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    if kind == "text":
        return f.tokenize_text(request.text, add_special is not False)
    if kind == "chat":
        return f.tokenize_chat(chat_from_pb(request.chat), bool(add_special))
    raise ValidationError.single("input", "set exactly one of text or chat")


def detokenize(f: GenerationBackend, request: pb.DetokenizeRequest) -> str:
    """The Detokenize RPC's work (blocking: on the pool); raises ValidationError."""
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return f.detokenize_ids(request.token_ids, skip)


def _prompt_violations(f: GenerationBackend, prompt: Prompt) -> ValidationError | None:
    """The prompt's own problems (checked with default sampling params)."""
    try:
        f.process(prompt, SamplingParams(max_tokens=None), request_id=None, priority=0)
    except ValidationError as exc:
        own = [v for v in exc.violations if not v.field.startswith("sampling_params")]
        return ValidationError(own) if own else None
    return None
