"""The engine's gRPC server: every service an engine serves, on one port, in front of the busy-loop thread.

- `tandem.engine.v1.EngineCoreService` (engine_core.py): what tandem frontends call - Connect (adds and
  aborts in, one output message per step or per several queued steps out), GetEngineInfo, GetLoad, and the
  scale-out RPCs: `SubscribeKvEvents` streams the prefix cache's changes from the busy loop's
  `KvEventPublisher` (kv_events.py), `GetTokenizer` the model's tokenizer files, read once in a thread at
  start (tokenizer_archive.py); `GetEngineInfo` reports the archive's checksum and whether events are on.
- `vllm.grpc.engine.VllmEngine`, SMG's engine protocol (smg/): so an SMG gateway (or llm-d's router) drives
  the engine directly; its Generate calls are streams of their own in the busy loop.
- `grpc.health.v1` and server reflection.

`EngineServer` owns the server, the busy loop and the health states, and runs the start-up order (the TP
workers were spawned before it; gRPC starts next with health NOT_SERVING; the busy loop builds the core).

Security (docs/security.md): TLS / mutual TLS from `ServerTls` (certificates re-read on change or
SIGHUP); with an engine token every call but health needs `authorization: Bearer <token>`. A request
whose bytes do not decode is INVALID_ARGUMENT (shared_runtime/security/decode_guard.py). The port is
bound exclusively (no SO_REUSEPORT): a second engine on a taken port fails to start.

Health (`grpc.health.v1`): "", `tandem.engine.v1.EngineCoreService` and `vllm.grpc.engine.VllmEngine` are NOT_SERVING until the model is
loaded and the KV cache allocated, and again while draining; `liveness` stays SERVING until the process
exits (so a Kubernetes liveness probe never kills a draining pod).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tandem.engine.v1 import engine_core_pb2 as pb
from tandem.engine.v1 import engine_core_pb2_grpc as pb_grpc
from tandem.vendor.smg import vllm_engine_pb2 as smg_pb

from engine_svc.api.engine_core import EngineCoreServicer
from engine_svc.api.kv_events import DEFAULT_BUFFER, DEFAULT_MAX_SUBSCRIBERS, KvEventPublisher
from engine_svc.api.smg import servicer as smg_servicer
from engine_svc.api.stream_cap import DEFAULT_MAX_TOKENIZER_DOWNLOADS
from engine_svc.api.tokenizer_archive import TokenizerArchive, read_tokenizer_archive
from engine_svc.busy_loop import BusyLoop
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.kv_transfer.setup import advertise
from engine_svc.telemetry import EngineTelemetry
from engine_svc.telemetry.kv_transfer_metrics import KvTransferCollector
from engine_svc.telemetry.metrics import EngineMetrics
from engine_svc.telemetry.stat_logger import StatLogger
from shared_runtime.contract import SchedulerStats
from shared_runtime.heap import settle_heap
from shared_runtime.link import (
    KEEPALIVE_OPTIONS,
    MAX_MESSAGE_BYTES,
    SERVER_PING_OPTIONS,
    engine_receive_limit,
    message_size_options,
)
from shared_runtime.security.auth import AuthInterceptor, KeySet
from shared_runtime.security.decode_guard import DecodeGuardInterceptor
from shared_runtime.security.listen import NO_REUSEPORT, add_port, join_host_port, start_health_server
from shared_runtime.security.tls import ServerTls

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EngineCoreService"].full_name
SMG_SERVICE_NAME = smg_pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name  # smg/servicer.py
READINESS = ("", SERVICE_NAME, SMG_SERVICE_NAME)  # health names that follow whether the engine takes requests
LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
DEFAULT_WAITING_PER_SEQ = 4  # --max-waiting default: 4 x --max-num-seqs


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES,
                   max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """Long-lived streams between frontend and engine sit idle for long stretches: keep them alive with
    pings, and let clients ping without data (both ends take these from `shared_runtime.link`). Messages
    received are capped at `max_receive_bytes` (`engine_receive_limit`: sized to max_model_len)."""
    return [*KEEPALIVE_OPTIONS, *SERVER_PING_OPTIONS, *message_size_options(max_message_bytes, max_receive_bytes),
            NO_REUSEPORT]


def default_max_waiting(max_num_seqs: int) -> int:
    return DEFAULT_WAITING_PER_SEQ * max_num_seqs


class EngineServer:
    """Owns the gRPC server, the busy loop and the health states; `run()` returns the exit code."""

    def __init__(self, config: EngineConfig, *, host: str = "127.0.0.1", port: int = 50051,
                 max_waiting: int | None = None, drain_grace_s: float = 45.0,
                 executor: object | None = None, telemetry: EngineTelemetry | None = None,
                 tls: ServerTls | None = None, tokens: KeySet | None = None, health_port: int = 0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, kv_events: bool = True,
                 kv_events_buffer: int = DEFAULT_BUFFER, max_kv_event_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
                 max_tokenizer_downloads: int = DEFAULT_MAX_TOKENIZER_DOWNLOADS,
                 settle_heap_when_ready: bool = False, stat_logger: StatLogger | None = None) -> None:
        """`max_waiting`: None = 4 x max_num_seqs, a negative value = unbounded. `tokens`: the engine
        tokens a caller must present (None: no token needed). `kv_events`: record the prefix cache's
        changes for SubscribeKvEvents; `kv_events_buffer`: batches a subscriber may fall behind;
        `max_kv_event_subscribers`, `max_tokenizer_downloads`: SubscribeKvEvents and GetTokenizer calls
        open at once (both protocols together; RESOURCE_EXHAUSTED past them).
        `settle_heap_when_ready`: once the engine is built, freeze what start-up allocated out of the
        garbage collector's reach (shared_runtime/heap.py); for a process that only serves (the CLI),
        since a frozen object is never collected. `stat_logger`: the periodic stats line (None: off)."""
        self.config = config
        self.stat_logger = stat_logger
        self.telemetry = telemetry or EngineTelemetry()
        self.host, self.port = host, port
        self.address = join_host_port(host, port)
        if max_waiting is None:
            max_waiting = default_max_waiting(config.max_num_seqs)
        self.max_waiting: int | None = max_waiting if max_waiting >= 0 else None
        self.drain_grace_s = drain_grace_s
        self.executor = executor
        self.tls = tls
        self.tokens = tokens
        self.health_port_requested = health_port
        self.health_port = 0
        self.max_message_bytes = max_message_bytes
        self.kv_events, self.kv_events_buffer = kv_events, kv_events_buffer
        self.max_kv_event_subscribers, self.max_tokenizer_downloads = max_kv_event_subscribers, max_tokenizer_downloads
        self.settle_heap_when_ready = settle_heap_when_ready
        self.exit_code = 0
        self.bound_port = 0
        self.servicer: EngineCoreServicer | None = None
        self._done = asyncio.Event()
        self._draining = False

    async def run(self, ready: asyncio.Event | None = None) -> int:
        """Serve until drained or stopped; returns the exit code. Raises BindError (after stopping the TP
        workers) when the port cannot be bound."""
        loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Future[None]] = set()
        self.health = health.aio.HealthServicer()
        for name in READINESS:
            await self.health.set(name, NOT_SERVING)
        await self.health.set(LIVENESS, SERVING)
        self.servicer = EngineCoreServicer(self.config, loop, self.max_message_bytes, self.max_tokenizer_downloads)
        self.servicer.spans = self.telemetry.spans
        self.servicer.tokenizer = loop.run_in_executor(None, _read_tokenizer_archive, self.config.model)
        publisher = None
        if self.kv_events:
            publisher = KvEventPublisher(self.servicer.engine_id, self.config.block_size, self.kv_events_buffer,
                                         self.max_kv_event_subscribers)
            self.servicer.kv_events = publisher
        interceptors = [AuthInterceptor(self.tokens)] if self.tokens is not None else []
        interceptors.append(DecodeGuardInterceptor())  # undecodable bytes: INVALID_ARGUMENT, not UNKNOWN
        receive = engine_receive_limit(self.config.max_model_len, self.max_message_bytes)
        server = grpc.aio.server(options=server_options(self.max_message_bytes, receive), interceptors=interceptors)
        pb_grpc.add_EngineCoreServiceServicer_to_server(self.servicer, server)
        smg_servicer.add_to_server(smg_servicer.VllmEngineServicer(self.servicer, self._serving), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection([SERVICE_NAME, SMG_SERVICE_NAME, health.SERVICE_NAME,
                                             reflection.SERVICE_NAME], server)
        health_server = None
        try:
            self.bound_port = add_port(server, self.host, self.port, self.tls)
            if self.health_port_requested:
                health_server, self.health_port = await start_health_server(
                    self.health, self.host, self.health_port_requested)
        except Exception:
            if self.executor is not None:
                self.executor.shutdown()  # type: ignore[attr-defined]
            raise
        await server.start()
        transport = "plaintext" if self.tls is None else (
            "mutual TLS" if self.tls.require_client_auth else "TLS")
        logger.info("engine gRPC listening on %s (%s, %s%s; loading model...)",
                    join_host_port(self.host, self.bound_port), transport,
                    "token required" if self.tokens is not None else "no token",
                    f", plaintext health on port {self.health_port}" if self.health_port else "")
        if ready is not None:
            ready.set()

        def threadsafe(fn, *args):
            return lambda *a: loop.call_soon_threadsafe(fn, *args, *a)

        metrics = self.telemetry.metrics
        if self._done.is_set():  # told to stop before the model started loading
            await server.stop(grace=0)
            if health_server is not None:
                await health_server.stop(grace=None)
            if self.executor is not None:
                self.executor.shutdown()  # type: ignore[attr-defined]
            return self.exit_code
        busy = BusyLoop(self._make_core, self.servicer.deliver, max_waiting=self.max_waiting,
                        on_ready=threadsafe(self._on_ready), on_fatal=threadsafe(self._on_fatal),
                        on_drained=threadsafe(self._done.set),
                        on_step=_step_hooks(metrics, self.stat_logger),
                        on_kv_events=threadsafe(publisher.publish) if publisher is not None else None)
        self.servicer.busy = busy
        if metrics is not None:
            metrics.track(lambda: busy.stats, {
                "block_size": str(self.config.block_size), "cache_dtype": self.config.dtype,
                "enable_prefix_caching": str(self.config.enable_prefix_caching)})
            if self.config.enable_lora:
                metrics.track_lora(self.config.max_loras, lambda: busy.stats)
            if publisher is not None:
                metrics.track_kv_events(publisher)
        busy.start()
        if self.stat_logger is not None:
            self.stat_logger.start()
        await self._done.wait()
        if self.stat_logger is not None:
            self.stat_logger.stop()
        await self._shutdown(server, busy)
        if health_server is not None:
            await health_server.stop(grace=None)
        return self.exit_code

    def reload_credentials(self) -> None:
        """SIGHUP: re-read the TLS certificates and the token file."""
        if self.tls is not None:
            self.tls.reload()
        if self.tokens is not None:
            self.tokens.reload()

    def _make_core(self) -> EngineCore:
        core = EngineCore(self.config, executor=self.executor, kv_events=self.kv_events,  # type: ignore[arg-type]
                          compile_processes=True)
        if core.kv_connector is not None:
            assert self.servicer is not None
            token_file = self.tokens.first_key_file() if self.tokens is not None else None
            advertise(core.kv_connector, self.servicer.engine_id, self.host, self.bound_port, token_file,
                      self.tls.files if self.tls is not None else None)
        return core

    def _set_serving(self, serving: bool) -> None:
        """Readiness ("" and the service name); `liveness` is left SERVING until exit."""
        status = SERVING if serving else NOT_SERVING
        for name in READINESS:
            task = asyncio.ensure_future(self.health.set(name, status))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _serving(self) -> bool:
        """Whether the engine takes requests: loaded, not draining, not failed."""
        return (self.servicer is not None and self.servicer.core is not None and not self._draining
                and self.exit_code == 0)

    def _on_ready(self, core: EngineCore) -> None:
        self.servicer.core = core
        if core.loras is not None:  # a load whose workers' read failed leaves the set on the busy loop's thread
            servicer = self.servicer
            core.loras.on_change = lambda: servicer.loop.call_soon_threadsafe(servicer.lora_announcer.changed)
        if core.kv_connector is not None and self.telemetry.metrics is not None:
            self.telemetry.metrics.registry.register(
                KvTransferCollector(self.config.model_name, core.kv_connector))
        logger.info("engine ready: %d KV blocks", core.num_blocks)
        if self.settle_heap_when_ready:  # else a full collection of start-up's ~10^5-10^6 objects pauses a step
            settle_heap()
        if not self._draining:
            self._set_serving(True)

    def _on_fatal(self, exc: BaseException) -> None:
        self.exit_code = 1
        self._set_serving(False)
        self._done.set()

    def begin_drain(self) -> None:
        """SIGTERM: stop taking requests, let in-flight ones finish within the grace period, then exit.

        During the model load the drain is queued: the busy loop takes it as soon as the core is up
        (nothing is in flight then), so the core is always shut down properly."""
        busy = self.servicer.busy if self.servicer is not None else None
        if busy is None:  # not started yet: nothing to drain
            self._done.set()
            return
        logger.info("draining (grace %.0fs)", self.drain_grace_s)
        self._draining = True
        self._set_serving(False)
        busy.drain(self.drain_grace_s)

    def force_exit(self) -> None:
        """A second SIGTERM/SIGINT: stop now (exit code 1), without waiting for the drain."""
        self.exit_code = self.exit_code or 1
        self._done.set()

    async def _shutdown(self, server: grpc.aio.Server, busy: BusyLoop) -> None:
        busy.stop()
        # The busy loop's last deliveries are queued on this event loop before its thread ends, so after
        # the join they reach their streams ahead of the end-of-stream markers.
        await asyncio.get_running_loop().run_in_executor(None, busy.join, 30.0)
        self.servicer.end_all_streams()
        if self.servicer.kv_events is not None:
            self.servicer.kv_events.close()
        self.servicer.lora_announcer.close()
        await server.stop(grace=1.0)
        if busy.core is not None:
            busy.core.shutdown()
        elif self.executor is not None:  # the core never came up: still stop the TP workers
            self.executor.shutdown()  # type: ignore[attr-defined]


def _read_tokenizer_archive(model: str) -> TokenizerArchive | None:
    """The tokenizer archive, or None (logged) when it cannot be read: the engine serves without it."""
    try:
        return read_tokenizer_archive(model)
    except Exception:
        logger.exception("cannot read the tokenizer files of %s; GetTokenizer will answer NOT_FOUND", model)
        return None


def _step_hooks(metrics: EngineMetrics | None, stat_logger: StatLogger | None
                ) -> Callable[[SchedulerStats | None], None] | None:
    """The busy loop's per-step hook: the metrics' and the stats line's, whichever are on."""
    hooks = [h.record_step for h in (metrics, stat_logger) if h is not None]
    if len(hooks) < 2:
        return hooks[0] if hooks else None
    first, second = hooks

    def both(stats: SchedulerStats | None) -> None:
        first(stats)
        second(stats)

    return both
