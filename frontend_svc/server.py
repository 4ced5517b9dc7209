"""`tandem.v1.GenerationService` on grpc.aio: the public API in front of the engines.

`FrontendServer` owns the tokenizer, the processor, the output processor, the engine client, the
health service and the gRPC server. Per Generate call: validate (processor) -> admit -> submit to an
engine -> stream the request's deltas as GenerateResponses.

Invariants:
- Every error before the first response is raised before anything is sent, so gRPC answers
  Trailers-Only (client retry policies can retry it). Bad input is INVALID_ARGUMENT with BadRequest
  field violations; too many calls in flight RESOURCE_EXHAUSTED; no ready engine, a broken engine
  stream or a draining server UNAVAILABLE; engine-reported errors keep the engine's code.
- A call that ends for any reason other than finishing (client cancel, deadline, error) aborts its
  unfinished completions in the engine (`finally` around the stream).
- Health ("" and `tandem.v1.GenerationService`) is SERVING only while at least one engine is ready and
  the server is not draining; "liveness" stays SERVING until the process exits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc

from frontend_svc import status
from frontend_svc.config import FrontendConfig
from frontend_svc.convert import (
    chat_from_pb,
    merge_violations,
    prompt_from_pb,
    response_from_delta,
    sampling_params_from_pb,
)
from frontend_svc.engine_client import EngineClient, EngineUnavailable, RequestHandle, StreamError
from frontend_svc.errors import ValidationError
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.processor import PreparedRequest, Processor
from frontend_svc.router import Router
from frontend_svc.sampling_params import SamplingParams
from frontend_svc.telemetry.call import GenerateCall
from frontend_svc.telemetry.service import FrontendTelemetry
from frontend_svc.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_MAX_MODEL_LEN = 2048


def server_options(config: FrontendConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class GenerationServicer(pb_grpc.GenerationServiceServicer):  # type: ignore[misc]
    def __init__(self, frontend: FrontendServer) -> None:
        self._f = frontend

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        call = self._f.telemetry.begin_call(context)
        try:
            async for response in self._generate(request, context, call):
                yield response
        except BaseException as exc:
            call.fail(exc, context)
            raise
        call.succeed()

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                        call: GenerateCall) -> AsyncIterator[pb.GenerateResponse]:
        f = self._f
        if f.draining:
            await status.abort(context, status.error_status(
                grpc.StatusCode.UNAVAILABLE, "the server is draining; retry on another replica", "DRAINING"))
        if f.num_active >= f.config.max_concurrent_requests:
            await status.abort(context, status.error_status(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many requests in flight (limit {f.config.max_concurrent_requests}); retry later",
                "TOO_MANY_REQUESTS"))
        try:
            prepared = call.prepare(f.prepare, request)
        except ValidationError as exc:
            await status.abort(context, status.invalid_argument(exc))
        f.enter()
        handle: RequestHandle | None = None
        left = False

        def release(_: object = None) -> None:
            """Abort what is unfinished in the engine and leave, once. Runs from the finally below and
            from the RPC's done callback: a cancel or deadline during a write may leave this generator
            suspended until garbage collection, and the engine must not wait for that."""
            nonlocal left
            if handle is not None:
                f.engines.abort(handle)  # a no-op once the request is done
            if not left:
                left = True
                f.leave()

        context.add_done_callback(release)
        try:
            try:
                handle = f.engines.submit(prepared, call.engine_requests(f.processor.engine_requests(prepared)))
            except EngineUnavailable as exc:
                await status.abort(context, status.error_status(
                    grpc.StatusCode.UNAVAILABLE, str(exc), "NO_READY_ENGINE"))
            call.routed(handle.connection.address, len(prepared.engine_request_ids))
            async for response in _stream(handle, context, call):
                yield response
        finally:
            release()

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        f = self._f
        kind = request.WhichOneof("input")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
        try:
            if kind == "text":
                ids = f.tokenizer.encode(request.text, add_special_tokens=add_special is not False)
            elif kind == "chat":
                ids = f.tokenize_chat(request.chat, bool(add_special))
            else:
                raise ValidationError.single("input", "set exactly one of text or chat")
        except ValidationError as exc:
            await status.abort(context, status.invalid_argument(exc))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=f.processor.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        f = self._f
        ids = list(request.token_ids)
        vocab = f.processor.vocab_size
        if any(i >= vocab for i in ids):
            await status.abort(context, status.invalid_argument(ValidationError.single(
                "token_ids", f"every token id must be < vocab_size ({vocab})")))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=f.tokenizer.decode(ids, skip_special_tokens=skip))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.GetModelInfoResponse:
        f = self._f
        info = pb.GetModelInfoResponse(
            model_name=f.config.model_name, max_model_len=f.processor.max_model_len,
            vocab_size=f.processor.vocab_size, eos_token_ids=f.tokenizer.eos_token_ids,
            has_chat_template=f.tokenizer.has_chat_template,
            num_ready_engines=len(f.engines.ready_engines()))
        if f.tokenizer.bos_token_id is not None:
            info.bos_token_id = f.tokenizer.bos_token_id
        return info


async def _stream(handle: RequestHandle, context: grpc.aio.ServicerContext,
                  call: GenerateCall) -> AsyncIterator[pb.GenerateResponse]:
    """The request's responses until all n completions finished; errors end the call with a status."""
    remaining = len(handle.prepared.engine_request_ids)
    queue = handle.queue
    while remaining:
        item = await queue.get()
        if isinstance(item, StreamError):
            await status.abort(context, status.error_status(
                status.code_from_number(item.code), item.message, "ENGINE_UNAVAILABLE"))
        if item.error is not None:
            await status.abort(context, status.error_status(
                status.code_from_number(item.error.code), item.error.message, "ENGINE_ERROR"))
        if item.finish_reason is not None:
            remaining -= 1
        call.on_delta(item)
        yield response_from_delta(item)


class FrontendServer:
    """The frontend process's parts, wired together; `start()` then `wait_stopped()`."""

    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer | None = None,
                 telemetry: FrontendTelemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or FrontendTelemetry.off()
        self.tokenizer = tokenizer or Tokenizer.from_pretrained(config.model)
        hf_config = config.hf_config()
        vocab_size = int(hf_config.get("vocab_size") or self.tokenizer.vocab_size)
        self._model_max_len = int(config.max_model_len or hf_config.get("max_position_embeddings")
                                  or self.tokenizer.model_max_length or DEFAULT_MAX_MODEL_LEN)
        self.processor = Processor(self.tokenizer, max_model_len=self._model_max_len,
                                   vocab_size=vocab_size, model_name=config.model_name)
        self.output_processor: OutputProcessor = self.telemetry.output_processor(self.tokenizer)
        self.engines = EngineClient(config.engines, self.output_processor, vocab_size,
                                    router=Router(config.routing), on_change=self._engines_changed,
                                    dns_refresh_s=config.dns_refresh_s)
        self.telemetry.watch_engines(self.engines.connections)
        self.health = health.aio.HealthServicer()
        self.draining = False
        self.num_active = 0
        self.bound_port = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._background: set[asyncio.Task[None]] = set()

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind, start serving (health NOT_SERVING until an engine is ready), connect to engines."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, NOT_SERVING)
        await self.health.set(LIVENESS, SERVING)
        server = grpc.aio.server(options=server_options(self.config))
        pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        self.bound_port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        await server.start()
        self._server = server
        logger.info("frontend listening on %s:%d; engines: %s", self.config.host, self.bound_port,
                    ", ".join(self.config.engines))
        await self.engines.start()
        return self.bound_port

    async def drain(self) -> None:
        """SIGTERM: refuse new calls, let running ones finish within the grace period, then stop."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d calls in flight (grace %.0fs)", self.num_active, self.config.drain_grace_s)
        await self._sync_health()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=self.config.drain_grace_s)
        except asyncio.TimeoutError:
            self.engines.fail_all(grpc.StatusCode.UNAVAILABLE.value[0],
                                  "the server drained before this request finished; retry it")
            await asyncio.sleep(0.2)  # let the failed calls send their status
        await self.stop()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)
        await self.engines.close()
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # ---- used by the servicer ----------------------------------------------------------------------
    def prepare(self, request: pb.GenerateRequest) -> PreparedRequest:
        """Validate and tokenize; raises ValidationError listing prompt and sampling problems together."""
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
                prompt_error = _prompt_violations(self.processor, prompt)
            raise merge_violations(prompt_error, params_error)  # type: ignore[misc]
        return self.processor.process(prompt, params, request_id=request.request_id or None,
                                      priority=request.priority)

    def tokenize_chat(self, chat: pb.Chat, add_special_tokens: bool) -> list[int]:
        return self.processor.tokenize_chat(chat_from_pb(chat), add_special_tokens)

    def enter(self) -> None:
        self.num_active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.num_active -= 1
        if self.num_active == 0:
            self._idle.set()

    # ---- engine readiness ----------------------------------------------------------------------------
    def _engines_changed(self) -> None:
        ready = self.engines.ready_engines()
        lens = [int(c.info.max_model_len) for c in ready if c.info is not None and c.info.max_model_len]
        self.processor.max_model_len = min([self._model_max_len, *lens])
        task = asyncio.get_running_loop().create_task(self._sync_health())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _sync_health(self) -> None:
        """Health from the state at the time it runs (so out-of-order updates still end right)."""
        serving = bool(self.engines.ready_engines()) and not self.draining
        for name in ("", SERVICE_NAME):
            await self.health.set(name, SERVING if serving else NOT_SERVING)


def _prompt_violations(processor: Processor, prompt: object) -> ValidationError | None:
    """The prompt's own problems (checked with default sampling params)."""
    try:
        processor.process(prompt, SamplingParams(max_tokens=None))  # type: ignore[arg-type]
    except ValidationError as exc:
        own = [v for v in exc.violations if not v.field.startswith("sampling_params")]
        return ValidationError(own) if own else None
    return None
