"""The frontend process: every part wired together, behind the public gRPC API (and, with --http-port, the
OpenAI-compatible HTTP API) on one event loop.

`FrontendServer` owns the tokenizer, the processor, the output processor, the engine client, the
dispatcher (the owner of each request in flight, dispatcher.py), the admission limit, the health
service and the servers. The APIs see it only as a `GenerationBackend` (generation.py): the gRPC
servicer is grpc_api/servicer.py, the HTTP API frontend_svc/openai/.

Invariants:
- Health ("" and `tandem.v1.GenerationService`) is SERVING only while at least one engine is ready and
  the server is not draining; "liveness" stays SERVING until the process exits.
- Admission counts completions, not calls: a Generate call holds n slots of
  `--max-concurrent-requests` (Tokenize and Detokenize hold one while they run) from before its
  prompt is tokenized until it ends, so n = 64 cannot multiply past the limit. A call whose n alone
  exceeds the limit is INVALID_ARGUMENT (it could never run).
- Tokenization, chat rendering and detokenization of whole requests run on a small thread pool, never
  on the event loop, so one large prompt does not stall other calls' streams (the tokenizer releases
  the GIL while encoding; size limits reject what could never fit before any of that work).
- With API keys configured every call but health needs `authorization: Bearer <key>`
  (shared_runtime/security/auth.py); malformed request bytes are INVALID_ARGUMENT (shared_runtime/security/decode_guard.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc as pb_grpc
from tandem.vendor.vllm import control_pb2_grpc, inference_pb2_grpc

from frontend_svc.config import FrontendConfig
from frontend_svc.dispatcher import Dispatcher, MigrationPolicy
from frontend_svc.engines.client import ChannelFactory, EngineClient
from frontend_svc.engines.lora_admin import LoraAdmin
from frontend_svc.engines.router import Router
from frontend_svc.generation import Admission, Generation
from frontend_svc.grpc_api.servicer import GenerationServicer
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.processor import ChatPrompt, PreparedRequest, Processor, Prompt, PromptOptions
from frontend_svc.service_error import UNAVAILABLE, ServiceError
from frontend_svc.telemetry.call import GenerateCall
from frontend_svc.telemetry.service import FrontendTelemetry
from frontend_svc.tokenizer import Tokenizer
from frontend_svc.vllm_grpc import control as vllm_control
from frontend_svc.vllm_grpc import inference as vllm_inference
from frontend_svc.vllm_grpc.inflight import InFlight
from shared_runtime import limits
from shared_runtime.contract import SamplingParams
from shared_runtime.link import MAX_MESSAGE_BYTES, SERVER_PING_OPTIONS
from shared_runtime.security.auth import AuthInterceptor, BearerToken, KeySet
from shared_runtime.security.decode_guard import DecodeGuardInterceptor
from shared_runtime.security.listen import NO_REUSEPORT, add_port, join_host_port, start_health_server
from shared_runtime.security.tls import ServerTls, client_tls, server_tls
from shared_runtime.violations import ValidationError

if TYPE_CHECKING:  # starlette and uvicorn load only with --http-port
    from frontend_svc.openai.serve import HttpServer

T = TypeVar("T")
logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
# Readiness is reported under "" and each generation API's service name.
READY_NAMES = ("", SERVICE_NAME, vllm_inference.SERVICE_NAME)
LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_MAX_MODEL_LEN = 2048
# Calls gRPC has received but not yet handed to the servicer. Past its default limits (1,000 soft,
# 3,000 hard) gRPC cancels a new call itself: in a burst of 10,000 Generate calls 7,000 came back
# CANCELLED (which a client cannot tell from its own cancel, and no retry policy retries) instead of
# reaching admission and its RESOURCE_EXHAUSTED. One limit for both, so none is dropped at random below it.
MAX_PENDING_CALLS = 16_384


def server_options(config: FrontendConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        *SERVER_PING_OPTIONS,
        ("grpc.keepalive_permit_without_calls", 1),
        NO_REUSEPORT,
    ]


def default_tokenizer_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class FrontendServer:
    """The frontend process's parts, wired together; `start()` then `wait_stopped()`."""

    def __init__(self, config: FrontendConfig, tokenizer: Tokenizer | None = None,
                 telemetry: FrontendTelemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or FrontendTelemetry.off()
        if tokenizer is None and config.model is None:
            raise ValueError("no tokenizer: pass --model, or fetch the engines' (frontend_svc/tokenizer_fetch.py)")
        self.tokenizer = tokenizer or Tokenizer.from_pretrained(config.model)  # type: ignore[arg-type]
        hf_config = config.hf_config()
        vocab_size = int(hf_config.get("vocab_size") or self.tokenizer.vocab_size)
        self._model_max_len = int(config.max_model_len or hf_config.get("max_position_embeddings")
                                  or self.tokenizer.model_max_length or DEFAULT_MAX_MODEL_LEN)
        self.processor = Processor(self.tokenizer, max_model_len=self._model_max_len,
                                   vocab_size=vocab_size, model_name=config.model_name)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=self.telemetry.logs_stats,
                                                stream_interval=config.stream_interval,
                                                hand_back=config.max_migrations > 0)
        self.api_keys = KeySet.from_sources(config.api_keys, config.api_key_file, env={})
        self.tls: ServerTls | None = server_tls(config.tls)
        token = BearerToken(config.engine_token_file) if config.engine_token_file else None
        self.engines = EngineClient(config.engines, vocab_size,
                                    router=Router(config.routing, cache_aware=config.cache_aware),
                                    on_change=self._engines_changed, tokenizer_sha256=config.engine_tokenizer_sha256,
                                    dns_refresh_s=config.dns_refresh_s,
                                    channels=ChannelFactory(client_tls(config.engine_tls), token,
                                                            config.engine_ssl_server_name))
        self.lora_admin = LoraAdmin(self.engines, config.model_name)  # run-time LoRA loads, replayed on engines that join
        self.dispatcher = Dispatcher(self.engines, self.output_processor,
                                     on_processed=self.telemetry.observe_step if self.telemetry.logs_stats else None,
                                     migration=MigrationPolicy(config.max_migrations, config.migration_timeout_s),
                                     on_migration=self.telemetry.observe_migration)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.tokenizer_threads or default_tokenizer_threads(),
            thread_name_prefix="tandem-tokenize")
        self.telemetry.watch_engines(self.engines.connections)
        self.health = health.aio.HealthServicer()
        self.draining = False
        self.admission = Admission(config.max_concurrent_requests)
        self.bound_port = 0
        self.health_port = 0
        self._health_server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._server: grpc.aio.Server | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.http: HttpServer | None = None  # the OpenAI-compatible HTTP API, with --http-port
        self.vllm_in_flight = InFlight()  # vllm.Inference calls, for vllm.Control/Abort

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind, start serving (health NOT_SERVING until an engine is ready), connect to engines."""
        for name in READY_NAMES:
            await self.health.set(name, NOT_SERVING)
        await self.health.set(LIVENESS, SERVING)
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if self.api_keys is not None:
            interceptors.append(AuthInterceptor(self.api_keys))
        interceptors.append(DecodeGuardInterceptor())
        server = grpc.aio.server(options=server_options(self.config), interceptors=interceptors)
        pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(self), server)
        inference_pb2_grpc.add_InferenceServicer_to_server(
            vllm_inference.InferenceServicer(self, self.vllm_in_flight), server)
        control_pb2_grpc.add_ControlServicer_to_server(
            vllm_control.ControlServicer(self, self.vllm_in_flight, self.config.tool_call_parser), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection([SERVICE_NAME, vllm_inference.SERVICE_NAME, vllm_control.SERVICE_NAME,
                                             health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        self.bound_port = add_port(server, self.config.host, self.config.port, self.tls)
        if self.config.health_port:
            self._health_server, self.health_port = await start_health_server(
                self.health, self.config.host, self.config.health_port)
        await server.start()
        self._server = server
        if self.config.http_port:
            from frontend_svc.openai.serve import HttpServer  # starlette and uvicorn load only when asked for

            self.http = HttpServer(self, self.config.host, self.config.http_port, self.config.max_message_bytes,
                                   self.config.tls, limits=self.config.http_limits,
                                   tool_call_parser=self.config.tool_call_parser,
                                   trust_request_chat_template=self.config.trust_request_chat_template)
            await self.http.start()
        logger.info("frontend listening on %s (%s%s); engines: %s",
                    join_host_port(self.config.host, self.bound_port), self._security_summary(),
                    f"; plaintext health on port {self.health_port}" if self.health_port else "",
                    ", ".join(self.config.engines))
        await self.engines.start()
        return self.bound_port

    async def drain(self) -> None:
        """SIGTERM: refuse new calls, let running ones finish within the grace period, then stop."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining: %d completions in flight (grace %.0fs)", self.admission.in_use,
                    self.config.drain_grace_s)
        await self._sync_health()
        try:
            await asyncio.wait_for(self.admission.idle.wait(), timeout=self.config.drain_grace_s)
        except asyncio.TimeoutError:
            self.dispatcher.fail_all(UNAVAILABLE, "the server drained before this request finished; retry it",
                                  "DRAINING")
            await asyncio.sleep(0.2)  # let the failed calls send their status
        await self.stop()

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.stop(grace=1.0)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._health_server is not None:
            await self._health_server.stop(grace=None)
        await self.engines.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stopped.set()

    def reload_credentials(self) -> None:
        """SIGHUP: re-read the TLS certificates and the API key file (rotation without a restart)."""
        if self.tls is not None:
            self.tls.reload()
        if self.api_keys is not None:
            self.api_keys.reload()
        if self.http is not None:
            self.http.reload_credentials()

    def _security_summary(self) -> str:
        if self.tls is None:
            transport = "plaintext"
        else:
            transport = "mutual TLS" if self.tls.require_client_auth else "TLS"
        keys = f"{len(self.api_keys)} API key(s)" if self.api_keys is not None else "no API key"
        return f"{transport}, {keys}"

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # ---- what an API layer uses (generation.GenerationBackend) ---------------------------------------
    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_model_len(self) -> int:
        return self.processor.max_model_len

    def check_fits(self, slots: int, field: str) -> None:
        self.admission.check_fits(slots, field)

    @property
    def metrics_registry(self) -> Any:
        return self.telemetry.metrics.registry if self.telemetry.metrics is not None else None

    @property
    def vocab_size(self) -> int:
        return self.processor.vocab_size

    @property
    def num_ready_engines(self) -> int:
        return len(self.engines.ready_engines())

    def ready_engine_infos(self) -> list[tuple[str, epb.EngineInfo]]:
        return [(c.address, c.info) for c in self.engines.ready_engines() if c.info is not None]

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        return self.lora_admin.served()

    def begin_call(self, headers: Sequence[tuple[str, str]], method: str,
                   attributes: dict[str, str] | None) -> GenerateCall:
        return self.telemetry.begin_call(headers, method, attributes)

    def process(self, prompt: Prompt, params: SamplingParams, *, request_id: str | None,
                priority: int, options: PromptOptions | None = None) -> PreparedRequest:
        return self.processor.process(prompt, params, request_id=request_id, priority=priority, options=options)

    # ---- tokenizing and detokenizing outside a generation ----------------------------------------
    def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s ids (blocking: run it through `run_blocking`); ValidationError on `text` when it is
        longer than any prompt could be (checked before encoding)."""
        too_big = limits.text_size_violation(text, self.processor.max_model_len)
        if too_big is not None:
            raise ValidationError([too_big])
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def tokenize_chat(self, chat: ChatPrompt, add_special_tokens: bool = False) -> list[int]:
        """A chat rendered by the template and tokenized (blocking); ValidationError on `chat.messages`."""
        return self.processor.tokenize_chat(chat, add_special_tokens)

    def detokenize_ids(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids` (blocking); ValidationError on `token_ids` unless there are at most
        max_model_len ids (as vLLM's /detokenize, counted before they are copied or scanned), each
        < vocab_size."""
        limit = self.processor.max_model_len
        if len(ids) > limit:
            raise ValidationError.single("token_ids", f"at most max_model_len ({limit}) token ids, got {len(ids)}")
        vocab = self.processor.vocab_size
        if any(i >= vocab for i in ids):
            raise ValidationError.single("token_ids", f"every token id must be < vocab_size ({vocab})")
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def open_generation(self, num_completions: int, call: GenerateCall) -> Generation:
        """Admit a request of `num_completions` (see generation.py for the protocol). Raises ServiceError
        UNAVAILABLE while draining, RESOURCE_EXHAUSTED at the limit, ValidationError (on
        `sampling_params.n`) when it alone exceeds the limit."""
        self._refuse_if_draining()
        self.admission.take(num_completions, "sampling_params.n")
        return Generation(slots=num_completions, call=call, admission=self.admission, dispatcher=self.dispatcher,
                          processor=self.processor, pool=self._pool)

    async def run_blocking(self, fn: Callable[[Any], T], request: Any) -> T:
        """`fn(request)` on the tokenizer pool under one admission slot (Tokenize, Detokenize)."""
        self._refuse_if_draining()
        self.admission.take(1, "")
        job = self._pool.submit(fn, request)
        try:
            return await asyncio.wrap_future(job)
        finally:
            self.admission.give_back(1, job)
            del job  # a failed job's exception holds this frame in its traceback: no cycle through `job`

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise ServiceError(UNAVAILABLE, "the server is draining; retry on another replica", "DRAINING")

    # ---- engine readiness ----------------------------------------------------------------------------
    def _engines_changed(self) -> None:
        ready = self.engines.ready_engines()
        lens = [int(c.info.max_model_len) for c in ready if c.info is not None and c.info.max_model_len]
        self.processor.max_model_len = min([self._model_max_len, *lens])
        task = asyncio.get_running_loop().create_task(self._sync_health())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def serving(self) -> bool:
        """Ready for requests (gRPC readiness and the HTTP /health): an engine is ready, no drain began."""
        return bool(self.engines.ready_engines()) and not self.draining

    async def _sync_health(self) -> None:
        """Health from the state at the time it runs (so out-of-order updates still end right)."""
        serving = self.serving
        for name in READY_NAMES:
            await self.health.set(name, SERVING if serving else NOT_SERVING)
