"""`tandem.engine.v1.EngineCoreService` on grpc.aio, in front of the busy-loop thread.

Each `Connect` stream gets an id and an asyncio queue. The busy loop delivers one `EngineCoreOutputs`
per step per stream (thread-safe hand-off onto the event loop); the stream's writer converts it to
protobuf here (engine_svc/packing.py), off the busy loop, and coalesces steps that queued up while it was writing - into
messages of at most `COALESCE_TARGET_BYTES` (or the configured maximum message size, if smaller), so a
slow reader gets more, smaller messages, never one its channel refuses (which would end the stream
and every request on it). A single request's output larger than the maximum is replaced by an
INVALID_ARGUMENT error for that request alone.

Security (docs/security.md): TLS / mutual TLS from `ServerTls` (certificates re-read on change or
SIGHUP); with an engine token every call but health needs `authorization: Bearer <token>`. The port is
bound exclusively (no SO_REUSEPORT): a second engine on a taken port fails to start.

Scale-out (scale_out_rpcs.py): `SubscribeKvEvents` streams the prefix cache's changes from the busy loop's
`KvEventPublisher` (kv_publisher.py), `GetTokenizer` the model's tokenizer files, read once in a thread at
start (tokenizer_files.py); `GetEngineInfo` reports the archive's checksum and whether events are on.

SMG's engine protocol (smg_servicer.py): `vllm.grpc.engine.VllmEngine` on the same server, so an SMG gateway
(or llm-d's router) drives the engine directly; its Generate calls are streams of their own in the busy loop.

Health (`grpc.health.v1`): "", `tandem.engine.v1.EngineCoreService` and `vllm.grpc.engine.VllmEngine` are NOT_SERVING until the model is
loaded and the KV cache allocated, and again while draining; `liveness` stays SERVING until the process
exits (so a Kubernetes liveness probe never kills a draining pod).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tandem.engine.v1 import engine_core_pb2 as pb
from tandem.engine.v1 import engine_core_pb2_grpc as pb_grpc
from tandem.vendor.smg import vllm_engine_pb2 as smg_pb

from engine_svc import smg_servicer
from engine_svc.busy_loop import BusyLoop
from engine_svc.config import EngineConfig
from engine_svc.core import EngineCore
from engine_svc.kv_publisher import DEFAULT_BUFFER, KvEventPublisher
from engine_svc.packing import pack_outputs
from engine_svc.scale_out_rpcs import stream_kv_events, stream_tokenizer
from engine_svc.telemetry import EngineTelemetry
from engine_svc.telemetry.tracing import RequestSpans
from engine_svc.tokenizer_files import TokenizerArchive, read_tokenizer_archive
from engine_svc.validation import add_size_problem, request_id_problem
from shared_runtime.contract import EngineCoreOutput, EngineCoreOutputs, EngineError, ErrorCode, FinishReason
from shared_runtime.from_pb import request_from_pb
from shared_runtime.heap import settle_heap
from shared_runtime.link import (
    KEEPALIVE_OPTIONS,
    MAX_MESSAGE_BYTES,
    SERVER_PING_OPTIONS,
    engine_receive_limit,
    message_size_options,
)
from shared_runtime.security.auth import AuthInterceptor, KeySet
from shared_runtime.security.listen import NO_REUSEPORT, add_port, join_host_port, start_health_server
from shared_runtime.security.tls import ServerTls
from shared_runtime.to_pb import stats_to_load_pb

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EngineCoreService"].full_name
SMG_SERVICE_NAME = smg_pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name  # smg_servicer.py
READINESS = ("", SERVICE_NAME, SMG_SERVICE_NAME)  # health names that follow whether the engine takes requests
LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
COALESCE_TARGET_BYTES = 4 * 1024 * 1024
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


class _Malformed(ValueError):
    """Input that makes the whole Connect stream unusable (it ends with INVALID_ARGUMENT)."""


@dataclass
class _Stream:
    queue: asyncio.Queue[EngineCoreOutputs | None]
    malformed: str | None = None  # why the stream's input was unusable: it ends with INVALID_ARGUMENT


class EngineCoreServicer(pb_grpc.EngineCoreServiceServicer):
    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.config = config
        self.loop = loop
        self.max_message_bytes = max_message_bytes
        self.message_budget = min(COALESCE_TARGET_BYTES, max_message_bytes)
        self.engine_id = uuid.uuid4().hex[:12]
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)
        self.busy: BusyLoop | None = None
        self.core: EngineCore | None = None
        self.spans: RequestSpans | None = None  # per-request engine spans (None: tracing off)
        self.kv_events: KvEventPublisher | None = None  # None: --no-enable-kv-cache-events
        self.tokenizer: asyncio.Future[TokenizerArchive | None] | None = None

    # Called from the busy-loop thread.
    def deliver(self, stream_id: int, outputs: EngineCoreOutputs) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None:
            self.loop.call_soon_threadsafe(stream.queue.put_nowait, outputs)

    def open_stream(self) -> tuple[int, asyncio.Queue[EngineCoreOutputs | None]]:
        """A stream of its own for a caller beside Connect (SMG's Generate, smg_servicer.py): the busy loop
        delivers the outputs of the requests it adds under this id to the queue; None marks the end."""
        sid = next(self._ids)
        stream = _Stream(asyncio.Queue())
        self._streams[sid] = stream
        return sid, stream.queue

    def close_stream(self, sid: int) -> None:
        """The caller is done with stream `sid`: whatever of it is still running is aborted."""
        self._streams.pop(sid, None)
        if self.busy is not None:
            self.busy.close_stream(sid)

    async def Connect(self, request_iterator: AsyncIterator[pb.EngineCoreInput],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.EngineCoreOutputs]:
        busy = self.busy
        if busy is None or self.core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        sid = next(self._ids)
        stream = _Stream(asyncio.Queue())
        self._streams[sid] = stream
        reader = asyncio.create_task(self._read_inputs(sid, request_iterator))
        ended: set[str] = set()  # requests this stream ended itself (an output too large to send)
        on_oversized = functools.partial(self._drop_oversized, sid, ended)
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    if stream.malformed is not None:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, stream.malformed)
                    return
                steps = self._take_queued(item, stream.queue)
                if ended:  # outputs queued before the busy loop forgot them: nothing follows their end
                    steps = [_without(step, ended) for step in steps]
                if self.spans is not None:
                    for step in steps:
                        self.spans.observe(step)
                for message in pack_outputs(steps, self.message_budget, self.max_message_bytes, on_oversized):
                    yield message
        finally:
            reader.cancel()
            if self.spans is not None:
                self.spans.end_stream(sid)
            self._streams.pop(sid, None)
            busy.close_stream(sid)  # type: ignore[union-attr]

    @staticmethod
    def _take_queued(first: EngineCoreOutputs, q: asyncio.Queue[EngineCoreOutputs | None]) -> list[EngineCoreOutputs]:
        """`first` and the steps that queued behind it while the previous message was written (in order;
        an end-of-stream marker stays queued)."""
        steps = [first]
        while not q.empty():
            nxt = q.get_nowait()
            if nxt is None:
                q.put_nowait(None)
                break
            steps.append(nxt)
        return steps

    def _drop_oversized(self, sid: int, ended: set[str], request_id: str) -> None:
        """A request's output could not be sent (larger than the maximum message) and became its final,
        error, output: stop it in the engine without a second end, and send nothing more of it."""
        logger.warning("stream %d: a request's output exceeded --max-message-bytes (%d); aborting it",
                       sid, self.max_message_bytes)
        ended.add(request_id)
        if self.busy is not None:
            self.busy.abort(sid, [request_id], already_ended=True)

    async def _read_inputs(self, sid: int, request_iterator: AsyncIterator[pb.EngineCoreInput]) -> None:
        """Feed the stream's adds and aborts to the busy loop. An add too large to copy is rejected alone
        (an error output for it). Input that cannot be used at all (undecodable bytes, a message of no
        known kind, an oversized add whose id cannot be echoed) ends the stream with INVALID_ARGUMENT:
        its requests are aborted and the frontend fails them, rather than being left unable to hear aborts."""
        busy = self.busy
        assert busy is not None and self.core is not None
        max_prompt = self.core.max_model_len
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "add":
                    if not self._admit_size(sid, msg.add, max_prompt):
                        continue
                    request = request_from_pb(msg.add)
                    if self.spans is not None:
                        self.spans.start(sid, request)
                    busy.add(sid, request)
                elif kind == "abort":
                    busy.abort(sid, list(msg.abort.request_ids))
                else:
                    raise _Malformed("an EngineCoreInput must hold an add or an abort")
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        except Exception as exc:
            reason = str(exc) if isinstance(exc, _Malformed) else "the stream's input is not valid EngineCoreInput"
            logger.warning("stream %d: bad input (%s: %s); ending the stream", sid, type(exc).__name__, exc)
            stream = self._streams.get(sid)
            if stream is not None:
                stream.malformed = reason
                stream.queue.put_nowait(None)

    def _admit_size(self, sid: int, add: pb.EngineCoreRequest, max_prompt: int) -> bool:
        """False (and the request's INVALID_ARGUMENT output queued) when `add` is too large to copy."""
        problem = add_size_problem(add, max_prompt)
        if problem is None:
            return True
        if request_id_problem(add.request_id) is not None:
            raise _Malformed(f"an add whose request id cannot be echoed is too large: {problem}")
        stream = self._streams.get(sid)
        if stream is not None:
            error = EngineError(code=ErrorCode.INVALID_ARGUMENT, message=problem)
            out = EngineCoreOutput(request_id=add.request_id, finish_reason=FinishReason.ERROR, error=error)
            stream.queue.put_nowait(EngineCoreOutputs(outputs=[out], timestamp=time.time()))
        return False

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.EngineInfo:
        core = self.core
        if core is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is still loading")
        cfg = self.config
        return pb.EngineInfo(
            model_name=cfg.model_name, max_model_len=core.max_model_len,  # type: ignore[union-attr]
            vocab_size=core.vocab_size, block_size=cfg.block_size, num_blocks=core.num_blocks,  # type: ignore[union-attr]
            tensor_parallel_size=cfg.tensor_parallel_size, dtype=cfg.torch_dtype_name,
            enable_prefix_caching=cfg.enable_prefix_caching, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=int(cfg.max_num_batched_tokens or 0),
            scheduling_policy=cfg.scheduling_policy, device=cfg.device, engine_id=self.engine_id,
            tokenizer_sha256=archive.sha256 if (archive := await self._tokenizer_archive()) else "",
            kv_cache_events=self.kv_events is not None,
        )

    async def _tokenizer_archive(self) -> TokenizerArchive | None:
        return await self.tokenizer if self.tokenizer is not None else None

    async def SubscribeKvEvents(self, request: pb.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[pb.KvEventBatch]:
        async for batch in stream_kv_events(self.kv_events, context):
            yield batch

    async def GetTokenizer(self, request: pb.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenizerChunk]:
        async for chunk in stream_tokenizer(self.tokenizer, self.config.model_name, context):
            yield chunk

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.EngineLoad:
        return stats_to_load_pb(self.busy.stats if self.busy else None)

    def end_all_streams(self) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(None)


class EngineServer:
    """Owns the gRPC server, the busy loop and the health states; `run()` returns the exit code."""

    def __init__(self, config: EngineConfig, *, host: str = "127.0.0.1", port: int = 50051,
                 max_waiting: int | None = None, drain_grace_s: float = 45.0,
                 executor: object | None = None, telemetry: EngineTelemetry | None = None,
                 tls: ServerTls | None = None, tokens: KeySet | None = None, health_port: int = 0,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, kv_events: bool = True,
                 kv_events_buffer: int = DEFAULT_BUFFER, settle_heap_when_ready: bool = False) -> None:
        """`max_waiting`: None = 4 x max_num_seqs, a negative value = unbounded. `tokens`: the engine
        tokens a caller must present (None: no token needed). `kv_events`: record the prefix cache's
        changes for SubscribeKvEvents; `kv_events_buffer`: batches a subscriber may fall behind.
        `settle_heap_when_ready`: once the engine is built, freeze what start-up allocated out of the
        garbage collector's reach (shared_runtime/heap.py); for a process that only serves (the CLI),
        since a frozen object is never collected."""
        self.config = config
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
        self.servicer = EngineCoreServicer(self.config, loop, self.max_message_bytes)
        self.servicer.spans = self.telemetry.spans
        self.servicer.tokenizer = loop.run_in_executor(None, _read_tokenizer_archive, self.config.model)
        publisher = None
        if self.kv_events:
            publisher = KvEventPublisher(self.servicer.engine_id, self.config.block_size, self.kv_events_buffer)
            self.servicer.kv_events = publisher
        interceptors = [AuthInterceptor(self.tokens)] if self.tokens is not None else []
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
                        on_step=metrics.record_step if metrics is not None else None,
                        on_kv_events=threadsafe(publisher.publish) if publisher is not None else None)
        self.servicer.busy = busy
        if metrics is not None:
            metrics.track(lambda: busy.stats)
            if publisher is not None:
                metrics.track_kv_events(publisher)
        busy.start()
        await self._done.wait()
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
        return EngineCore(self.config, executor=self.executor, kv_events=self.kv_events)  # type: ignore[arg-type]

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


def _without(step: EngineCoreOutputs, request_ids: set[str]) -> EngineCoreOutputs:
    """`step` less the outputs of `request_ids`."""
    return EngineCoreOutputs(outputs=[o for o in step.outputs if o.request_id not in request_ids],
                             scheduler_stats=step.scheduler_stats, timestamp=step.timestamp)
