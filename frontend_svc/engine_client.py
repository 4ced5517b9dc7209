"""The frontend's side of `tandem.engine.v1.EngineCoreService`: one `Connect` stream per engine.

`EngineClient` keeps an `EngineConnection` per engine address (static `host:port` targets, and every A
record of `dns:///name:port` targets, re-resolved every few seconds), routes each new request to a ready
engine, and feeds every `EngineCoreOutputs` an engine sends through the shared `OutputProcessor` into
per-request asyncio queues (`RequestHandle.queue`).

Invariants:
- An engine is *ready* (routable) only while its `Connect` stream is open, its `GetEngineInfo`
  vocab_size equals the frontend's model vocabulary, and its health (watched, when it serves
  grpc.health.v1) is not NOT_SERVING: a draining engine gets no new requests but finishes its own.
- All n completions of one client request go to the same engine (they share the prompt's KV blocks).
- Every request handed out by `submit` ends exactly once: each completion's finished delta, or one
  `StreamError` (UNAVAILABLE when its engine's stream broke, or what `fail_all` says).
- When a stream breaks, the engine aborts that stream's requests itself; the frontend reconnects with
  exponential backoff (reset after a session that reached ready).
- Everything runs on one asyncio loop; the per-step path does no logging or string formatting.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from frontend_svc.convert import engine_abort_to_pb, engine_request_to_pb
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.outputs import CompletionDelta
from frontend_svc.processor import PreparedRequest
from frontend_svc.router import Router

logger = logging.getLogger(__name__)

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
ENGINE_SERVICE = epb.DESCRIPTOR.services_by_name["EngineCoreService"].full_name
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 2.0
INFO_TIMEOUT_S = 5.0
LOAD_POLL_S = 1.0
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
]


class EngineUnavailable(Exception):
    """No engine is ready to take a request."""


@dataclass(frozen=True)
class StreamError:
    """A request ended without finishing: `code` is a gRPC status number."""

    code: int
    message: str


class RequestHandle:
    """One client request in flight on one engine; its deltas (or one StreamError) arrive on `queue`."""

    __slots__ = ("connection", "num_unfinished", "prepared", "queue")

    def __init__(self, prepared: PreparedRequest, connection: EngineConnection) -> None:
        self.prepared = prepared
        self.connection = connection
        self.num_unfinished = len(prepared.engine_request_ids)
        self.queue: asyncio.Queue[CompletionDelta | StreamError] = asyncio.Queue()

    @property
    def done(self) -> bool:
        return self.num_unfinished == 0


class State(enum.Enum):
    CONNECTING = "connecting"
    READY = "ready"
    MISMATCH = "mismatch"  # reachable, but serves a different vocabulary: never routed to
    CLOSED = "closed"


class EngineConnection:
    """The link to one engine address: a session loop of GetEngineInfo -> Connect -> read outputs.

    Load estimate (what the router compares): the engine's last reported running + waiting plus the
    requests sent to it since that report, but never less than this frontend's own unfinished
    requests on it. Idle connections poll `GetLoad` to see other frontends' load.
    """

    def __init__(self, address: str, client: EngineClient) -> None:
        self.address = address
        self.state = State.CONNECTING
        self.info: epb.EngineInfo | None = None
        self.requests: set[RequestHandle] = set()
        self.num_in_flight = 0  # unfinished engine requests this frontend sent here
        self._reported_load = 0
        self._sent_since_report = 0
        self._client = client
        self._outbox: asyncio.Queue[epb.EngineCoreInput] | None = None
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None
        self._retiring = False
        self._was_ready = False
        self._health_ok = True  # the engine's own health says SERVING (or it has no health service)

    # ---- what the router and client read ----------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state is State.READY and self._health_ok and not self._retiring

    @property
    def load(self) -> int:
        return max(self._reported_load + self._sent_since_report, self.num_in_flight)

    @property
    def block_size(self) -> int:
        return int(self.info.block_size) if self.info is not None else 0

    def note_sent(self, count: int) -> None:
        self.num_in_flight += count
        self._sent_since_report += count

    def note_stats(self, stats: Any) -> None:
        self._reported_load = int(stats.num_running) + int(stats.num_waiting)
        self._sent_since_report = 0

    def send(self, message: epb.EngineCoreInput) -> None:
        """Queue a message on the open stream (dropped when there is none: the engine already
        aborted everything of a broken stream)."""
        outbox = self._outbox
        if outbox is not None:
            outbox.put_nowait(message)

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine {self.address}")

    @property
    def retiring(self) -> bool:
        return self._retiring

    def retire(self) -> None:
        """Stop routing here (the address left DNS); the client closes it once its last request ended."""
        self._retiring = True

    async def close(self) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._end_session("the frontend closed the connection")

    async def _run(self) -> None:
        backoff = BACKOFF_INITIAL_S
        while self.state is not State.CLOSED:
            self._was_ready = False
            try:
                await self._session()
                reason = "the engine ended the stream"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure means: reconnect
                logger.exception("engine %s: session failed", self.address)
                reason = f"{type(exc).__name__}: {exc}"
            self._end_session(reason)
            if self._was_ready:
                backoff = BACKOFF_INITIAL_S
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _session(self) -> None:
        channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        try:
            stub = epb_grpc.EngineCoreServiceStub(channel)
            info = await stub.GetEngineInfo(epb.GetEngineInfoRequest(), timeout=INFO_TIMEOUT_S)
            if not self._client.accepts(self, info):
                self.state = State.MISMATCH
                await asyncio.sleep(BACKOFF_MAX_S * 5)
                return
            serving = await _is_serving(channel)  # a draining engine must not be routable, even briefly
            outbox: asyncio.Queue[epb.EngineCoreInput] = asyncio.Queue()
            call = stub.Connect(_drain(outbox))
            self.info, self._outbox, self._call = info, outbox, call
            self.state, self._was_ready = State.READY, True
            self._reported_load = self._sent_since_report = 0
            self._health_ok = serving
            logger.info("engine %s ready (engine_id %s, max_model_len %d)",
                        self.address, info.engine_id, info.max_model_len)
            self._client.connection_changed()
            loop = asyncio.get_running_loop()
            helpers = [loop.create_task(self._poll_load(stub)), loop.create_task(self._watch_health(channel))]
            try:
                on_outputs = self._client.on_outputs
                async for message in call:
                    on_outputs(self, message)
            finally:
                for helper in helpers:
                    helper.cancel()
        finally:
            await channel.close(grace=None)

    async def _poll_load(self, stub: epb_grpc.EngineCoreServiceStub) -> None:
        """While nothing of ours runs there (so no stats arrive), ask for the engine's load."""
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            if self.num_in_flight == 0:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    self.note_stats(await stub.GetLoad(epb.GetLoadRequest(), timeout=LOAD_POLL_S))

    async def _watch_health(self, channel: grpc.aio.Channel) -> None:
        """Follow the engine's health: NOT_SERVING (e.g. draining) takes it out of routing."""
        request = health_pb2.HealthCheckRequest(service=ENGINE_SERVICE)
        with contextlib.suppress(grpc.aio.AioRpcError):  # no health service: stay routable
            async for answer in health_pb2_grpc.HealthStub(channel).Watch(request):
                serving = answer.status != health_pb2.HealthCheckResponse.NOT_SERVING
                if serving != self._health_ok:
                    self._health_ok = serving
                    logger.info("engine %s health: %s", self.address, "SERVING" if serving else "NOT_SERVING")
                    self._client.connection_changed()

    def _end_session(self, reason: str) -> None:
        was_ready = self.state is State.READY
        if was_ready:
            self.state = State.CONNECTING
            logger.warning("engine %s went away: %s", self.address, reason)
        self._outbox = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._client.connection_down(self, f"engine {self.address} became unavailable ({reason})", was_ready)


async def _is_serving(channel: grpc.aio.Channel) -> bool:
    """The engine's readiness now; an engine without a health service counts as serving."""
    request = health_pb2.HealthCheckRequest(service=ENGINE_SERVICE)
    try:
        answer = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=INFO_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        return exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND)
    return answer.status != health_pb2.HealthCheckResponse.NOT_SERVING


async def _drain(outbox: asyncio.Queue[epb.EngineCoreInput]) -> AsyncIterator[epb.EngineCoreInput]:
    """The request side of a Connect stream: whatever is queued, in order, forever."""
    while True:
        yield await outbox.get()


class EngineClient:
    """Routes requests over the engines' streams and turns their outputs into per-request deltas."""

    def __init__(
        self,
        targets: Sequence[str],
        output_processor: OutputProcessor,
        vocab_size: int,
        *,
        router: Router | None = None,
        on_change: Callable[[], None] = lambda: None,
        dns_refresh_s: float = 5.0,
    ) -> None:
        self.targets = tuple(targets)
        self.vocab_size = vocab_size
        self.router = router or Router()
        self._output_processor = output_processor
        self._on_change = on_change
        self._dns_refresh_s = dns_refresh_s
        self._connections: dict[str, EngineConnection] = {}
        self._retired: set[EngineConnection] = set()  # left the target set; closed once idle
        self._resolved: dict[str, list[str]] = {}  # target -> its last good addresses
        self._background: set[asyncio.Task[None]] = set()
        self._handles: dict[str, RequestHandle] = {}  # engine request id -> its client request
        self._refresher: asyncio.Task[None] | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._refresh_addresses()
        if any(is_dns_target(t) for t in self.targets):
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for connection in [*self._connections.values(), *self._retired]:
            await connection.close()
        self._connections.clear()
        self._retired.clear()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._dns_refresh_s)
            try:
                await self._refresh_addresses()
            except Exception:  # a failed refresh keeps the current set
                logger.exception("engine address refresh failed")

    async def _refresh_addresses(self) -> None:
        loop = asyncio.get_running_loop()
        wanted: set[str] = set()
        for target in self.targets:
            try:
                self._resolved[target] = await loop.run_in_executor(None, resolve_target, target)
            except OSError as exc:
                logger.warning("cannot resolve engine target %s (keeping its last addresses): %s", target, exc)
            wanted.update(self._resolved.get(target, ()))
        for address in sorted(wanted - self._connections.keys()):
            connection = EngineConnection(address, self)
            self._connections[address] = connection
            connection.start()
            logger.info("engine %s added", address)
        for address in sorted(self._connections.keys() - wanted):
            logger.info("engine %s left the target set; retiring it", address)
            connection = self._connections.pop(address)
            connection.retire()
            self._retired.add(connection)
            self._close_if_idle(connection)
        self.connection_changed()

    # ---- what the server uses ----------------------------------------------------------------------
    def ready_engines(self) -> list[EngineConnection]:
        return [c for c in self._connections.values() if c.ready]

    def connections(self) -> list[EngineConnection]:
        return list(self._connections.values())

    def submit(self, prepared: PreparedRequest, engine_requests: Sequence[dict[str, Any]]) -> RequestHandle:
        """Send the request's n engine requests to one ready engine; raise EngineUnavailable if none."""
        connection = self.router.choose(self.ready_engines(), prepared.prompt_token_ids)
        if connection is None:
            raise EngineUnavailable("no engine is ready to serve requests; retry shortly")
        handle = RequestHandle(prepared, connection)
        self._output_processor.add_request(prepared)
        for fields in engine_requests:
            self._handles[fields["request_id"]] = handle
        connection.requests.add(handle)
        connection.note_sent(len(engine_requests))
        for fields in engine_requests:
            connection.send(engine_request_to_pb(fields))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request's unfinished completions, here and in the engine (no-op once done)."""
        if handle.done:
            return
        engine_ids = self._forget_request(handle)
        if engine_ids:
            handle.connection.send(engine_abort_to_pb(engine_ids))

    def fail_all(self, code: int, message: str) -> None:
        """End every open request with `code` and abort it in its engine (e.g. a drain's end)."""
        for connection in [*self._connections.values(), *self._retired]:  # retired ones may still hold requests
            for handle in list(connection.requests):
                self.abort(handle)
                handle.queue.put_nowait(StreamError(code, message))

    # ---- called by connections -----------------------------------------------------------------------
    def accepts(self, connection: EngineConnection, info: epb.EngineInfo) -> bool:
        if info.vocab_size == self.vocab_size:
            return True
        if connection.state is not State.MISMATCH:
            logger.error("engine %s serves vocab_size %d but this frontend's model has %d: not routing to "
                         "it (frontend and engine must serve the same model)",
                         connection.address, info.vocab_size, self.vocab_size)
        return False

    def connection_changed(self) -> None:
        self._on_change()

    def connection_down(self, connection: EngineConnection, message: str, was_ready: bool) -> None:
        """The stream broke: every request on it ends with UNAVAILABLE (the engine aborted them)."""
        for handle in list(connection.requests):
            self._forget_request(handle)
            handle.queue.put_nowait(StreamError(UNAVAILABLE, message))
        connection.num_in_flight = 0
        self._close_if_idle(connection)
        if was_ready:
            self.connection_changed()

    def on_outputs(self, connection: EngineConnection, message: epb.EngineCoreOutputs) -> None:
        """One engine step's outputs for this stream: deltas to their queues, stop-string aborts out."""
        if message.HasField("scheduler_stats"):
            connection.note_stats(message.scheduler_stats)
        processed = self._output_processor.process_outputs(message)
        handles = self._handles
        for delta in processed.deltas:
            handle = handles.get(delta.engine_request_id)
            if handle is None:
                continue
            handle.queue.put_nowait(delta)
            if delta.finish_reason is not None:
                self._forget_completion(handle, delta.engine_request_id)
        if processed.reqs_to_abort:
            connection.send(engine_abort_to_pb(processed.reqs_to_abort))

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def _forget_completion(self, handle: RequestHandle, engine_id: str) -> None:
        del self._handles[engine_id]
        handle.num_unfinished -= 1
        connection = handle.connection
        connection.num_in_flight -= 1
        if handle.num_unfinished == 0:
            connection.requests.discard(handle)
            self._close_if_idle(connection)

    def _close_if_idle(self, connection: EngineConnection) -> None:
        if connection.retiring and not connection.requests and connection in self._retired:
            self._retired.discard(connection)
            task = asyncio.get_running_loop().create_task(connection.close())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _forget_request(self, handle: RequestHandle) -> list[str]:
        """Finish a request's open completions in the output processor; return their engine ids."""
        engine_ids = self._output_processor.abort_request(handle.prepared)
        for engine_id in engine_ids:
            if engine_id in self._handles:
                self._forget_completion(handle, engine_id)
        return engine_ids


def is_dns_target(target: str) -> bool:
    return target.startswith("dns:")


def resolve_target(target: str) -> list[str]:
    """The `host:port` addresses of a target: itself, or every A/AAAA record of `dns:///name:port`."""
    if not is_dns_target(target):
        return [target]
    rest = target[len("dns:"):]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else rest[2:]  # drop the authority
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise OSError(f"engine target {target!r} must look like dns:///name:port")
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    addresses = {_join(str(info[4][0]), int(port)) for info in infos}
    return sorted(addresses)


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
