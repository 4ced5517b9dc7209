"""`vllm.Inference` (Generate, GenerateStream) on the frontend's shared generation path.

A call is the transport-neutral `Generation` (generation.py) with vLLM's request mapping (request.py),
its response shapes (response.py) and tandem's gRPC statuses (grpc_api/status.py: INVALID_ARGUMENT with
`BadRequest` field violations naming vLLM's request paths, RESOURCE_EXHAUSTED at the admission limit,
UNAVAILABLE without a ready engine or while draining) around it.

Invariants:
- Every error before the first response is raised before anything is sent (Trailers-Only).
- A stream that ends for any reason other than finishing - the client cancels, its deadline passes, its
  connection drops - aborts the request's unfinished sequences in the engine (`Generation.close`, from
  the RPC's done callback). vLLM documents that a dropped stream does not abort (only Control.Abort
  does); tandem aborts on stream loss as well, so a vanished client never holds KV blocks.
- `Control.Abort` with a call's request id ends its unfinished sequences with finish reason ABORTED:
  the stream sends each one's final output and closes with OK (`InFlight`); the unary Generate
  answers the folded output with ABORTED.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import grpc
from tandem.vendor.vllm import inference_pb2 as ipb
from tandem.vendor.vllm import inference_pb2_grpc as ipb_grpc

from frontend_svc.generation import Generation, GenerationBackend
from frontend_svc.grpc_api import status
from frontend_svc.processor import PreparedRequest
from frontend_svc.service_error import ServiceError
from frontend_svc.telemetry.call import GenerateCall, grpc_failure
from frontend_svc.vllm_grpc.inflight import InFlight
from frontend_svc.vllm_grpc.request import InferencePlan, ModelNotFound, plan, renamed
from frontend_svc.vllm_grpc.response import ResponseWriter, fold
from shared_runtime.violations import ValidationError

SERVICE_NAME = ipb.DESCRIPTOR.services_by_name["Inference"].full_name
STREAM_METHOD = f"{SERVICE_NAME}/GenerateStream"
UNARY_METHOD = f"{SERVICE_NAME}/Generate"


class InferenceServicer(ipb_grpc.InferenceServicer):
    def __init__(self, frontend: GenerationBackend, in_flight: InFlight) -> None:
        self._f = frontend
        self._in_flight = in_flight

    async def GenerateStream(self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes its responses (`context.write`): the prompt info, then each sequence's outputs."""
        call = self._f.begin_call(context.invocation_metadata() or (), STREAM_METHOD, None)
        try:
            write = context.write
            async with aclosing(self._run(request, context, call, unary=False)) as responses:
                async for response in responses:
                    await write(response)
        except _Failed as failed:
            _end(context, call, failed)
            return
        except BaseException as exc:
            call.fail(*grpc_failure(exc, context))
            raise
        call.succeed()

    async def Generate(self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext) -> ipb.GenerateResponse:
        call = self._f.begin_call(context.invocation_metadata() or (), UNARY_METHOD, None)
        try:
            async with aclosing(self._run(request, context, call, unary=True)) as responses:
                response = fold([r async for r in responses])
        except _Failed as failed:
            _end(context, call, failed)
            return ipb.GenerateResponse()
        except BaseException as exc:
            call.fail(*grpc_failure(exc, context))
            raise
        call.succeed()
        return response

    async def _run(self, request: ipb.GenerateRequest, context: grpc.aio.ServicerContext, call: GenerateCall, *,
                   unary: bool) -> AsyncGenerator[ipb.GenerateResponse, None]:
        """The call's responses; raises _Failed with the status of bad input or a failure."""
        f = self._f
        try:
            mapped = plan(request, f.model_name, unary=unary, defaults=f.tokenizer.sampling_defaults,
                          lora_adapters=f.lora_adapters)
            generation = f.open_generation(mapped.params.n, call)
        except ModelNotFound as exc:
            raise _Failed(status.error_status(grpc.StatusCode.NOT_FOUND, str(exc))) from None
        except (ValidationError, ServiceError) as exc:
            raise _Failed(status.from_error(_named(exc))) from None
        entry = self._in_flight.add(mapped.request_id, generation)

        def ended(_: object) -> None:  # the RPC's end releases the request even if this generator is stuck
            self._in_flight.remove(entry)
            generation.close()
        context.add_done_callback(ended)
        try:
            prepared = await generation.start(lambda: _prepare(f, mapped))
            if entry.aborted:  # Control.Abort came while the prompt was being tokenized
                generation.abort()
            self._in_flight.started(entry, prepared.request_id)
            writer = ResponseWriter(mapped.shape, mapped.params.stop_token_ids)
            async for response in _responses(generation, prepared, writer):
                yield response
        except (ValidationError, ServiceError) as exc:
            raise _Failed(status.from_error(_named(exc))) from None
        finally:
            self._in_flight.remove(entry)
            generation.close()


class _Failed(Exception):
    """The status a call ends with, raised out of `_run` to the RPC method, which sets it on the call
    (`status.end`) and drops this exception: grpc never keeps it (nor the frames its traceback holds)."""

    def __init__(self, st: grpc.Status) -> None:
        super().__init__(st.details)
        self.status = st


def _end(context: grpc.aio.ServicerContext, call: GenerateCall, failed: _Failed) -> None:
    status.end(context, failed.status)
    call.fail(*grpc_failure(None, context))


async def _responses(generation: Generation, prepared: PreparedRequest,
                     writer: ResponseWriter) -> AsyncGenerator[ipb.GenerateResponse, None]:
    """vLLM's stream: the prompt info first (at once, or with the first output when it carries prompt
    logprobs), then one response per delta."""
    wants_prompt_logprobs = writer.shape.prompt_logprobs
    if not wants_prompt_logprobs:
        yield writer.prompt_info(prepared.prompt_token_ids, None)
    outputs = writer.outputs
    async for deltas in generation.batches():
        for delta in deltas:
            if wants_prompt_logprobs:
                wants_prompt_logprobs = False
                yield writer.prompt_info(prepared.prompt_token_ids, delta.prompt_logprobs)
            yield outputs(delta)


def _prepare(f: GenerationBackend, mapped: InferencePlan) -> PreparedRequest:
    """Tokenize and validate (blocking: on the pool); ValidationError named by vLLM's request paths."""
    try:
        prepared = f.process(mapped.prompt, mapped.params, request_id=mapped.request_id, priority=mapped.priority,
                             options=mapped.options)
    except ValidationError as exc:
        raise renamed(exc) from None
    prepared.lora_name = mapped.lora_name
    return prepared


def _named(exc: ValidationError | ServiceError) -> ValidationError | ServiceError:
    """A ValidationError with vLLM's field paths (`sampling_params.n` of admission is `sampling.num_sequences`)."""
    return renamed(exc) if isinstance(exc, ValidationError) else exc
