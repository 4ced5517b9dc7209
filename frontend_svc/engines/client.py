"""The frontend's side of `tandem.engine.v1.EngineCoreService`: one `Connect` stream per engine, and routing.

This module is transport and routing only: it never looks inside a request's output. `EngineClient`
keeps an `EngineConnection` per engine address (static `host:port` targets, and every A record of
`dns:///name:port` targets, re-resolved every few seconds), picks a ready engine for a new request
(`choose`, through the `Router`), and hands every message an engine sends, and every stream that breaks,
to its `StreamListener`: the dispatcher (dispatcher.py), which owns the requests in flight.

Invariants:
- An engine is *ready* (routable) only while its `Connect` stream is open, its `GetEngineInfo`
  vocab_size equals the frontend's model vocabulary, and its health (watched, when it serves
  grpc.health.v1) is not NOT_SERVING: a draining engine gets no new requests but finishes its own.
- A connection's `requests` are the requests the dispatcher sent on it that are not done; how many engine
  requests it has in flight is derived from them, never counted separately.
- When a stream breaks, the engine aborts that stream's requests itself; the listener hears of it once
  (`on_stream_down`), then the frontend reconnects with exponential backoff (reset after a session that
  reached ready).
- Everything runs on one asyncio loop; the per-step path does no logging or string formatting.
- Coalescing when behind, never holding: a reader task reads each engine stream ahead (at most
  `READ_AHEAD` messages; the stream's receive window stays 64 KiB, no BDP probing, so gRPC flow control
  pushes back on the engine, which then packs the steps that queue into one message), and the messages
  that arrived while the previous ones were processed go to the listener together. The next batch is
  taken once the readers handed output from this one have sent it (`DrainGate`, drain_gate.py). A
  frontend that keeps up finds one message at a time; nothing waits for a timer or for more output.
- With a router that routes by cache (`cache-aware`), each ready connection follows its engine's KV-cache
  events into `kv_index` (kv_index.py); the index is emptied the moment the session ends, so a dead or
  restarted engine's old cache never attracts requests.
- Channels come from a `ChannelFactory`: plaintext, or TLS with credentials read afresh for every
  channel (so a rotated client certificate is used from the next reconnect), and with the engine token
  (`authorization: Bearer ...`) added to every call when one is configured. Addresses resolved from a
  `dns:///name:port` target are verified against `name` (the certificate's DNS name), not the pod IP.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from frontend_svc.engines.drain_gate import DrainGate
from frontend_svc.engines.kv_index import KvBlockIndex, follow_kv_events
from frontend_svc.engines.lora_watch import follow_lora_adapters
from frontend_svc.engines.router import Router
from frontend_svc.pd_flow import in_pool
from shared_runtime.link import KEEPALIVE_OPTIONS, message_size_options
from shared_runtime.security.auth import BearerToken, bearer_token_interceptors
from shared_runtime.security.tls import ClientTls

logger = logging.getLogger(__name__)

ENGINE_SERVICE = epb.DESCRIPTOR.services_by_name["EngineCoreService"].full_name
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 2.0
INFO_TIMEOUT_S = 5.0
LOAD_POLL_S = 1.0
READ_AHEAD = 8  # engine messages read but not yet processed, per stream (EngineConnection._read_ahead)
# No BDP probing: the engine stream's receive window stays HTTP/2's 64 KiB instead of growing to megabytes,
# so an engine ahead of this frontend is held back after a few messages and packs the steps that queue
# meanwhile into its next message (engine_svc/api/server.py) instead of sending each step alone into a deep
# buffer that grpc.aio reads back one message per event-loop turn (bench/frontend_capacity.py;
# tests/frontend/test_engine_backpressure.py).
CHANNEL_OPTIONS = [*KEEPALIVE_OPTIONS, *message_size_options(), ("grpc.enable_retries", 0),
                   ("grpc.http2.bdp_probe", 0)]


class ChannelFactory:
    """Makes the channel of one engine session: TLS or plaintext, with the engine token if any."""

    def __init__(self, tls: ClientTls | None = None, token: BearerToken | None = None,
                 server_name: str | None = None) -> None:
        """`server_name`: the name every engine certificate must carry (default: the target's host)."""
        self.tls = tls
        self._server_name = server_name
        self._interceptors = bearer_token_interceptors(token) if token is not None else None

    def __call__(self, address: str, server_name: str | None = None) -> grpc.aio.Channel:
        options: list[tuple[str, Any]] = list(CHANNEL_OPTIONS)
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=self._interceptors)
        server_name = self._server_name or server_name
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        return grpc.aio.secure_channel(address, self.tls.credentials(), options=options,
                                       interceptors=self._interceptors)


class EngineUnavailable(Exception):
    """No engine is ready to take a request."""


class Carried(Protocol):
    """A request sent on a connection, as the connection sees it (`output_processor.RequestState`)."""

    @property
    def num_unfinished(self) -> int:
        """Its engine requests still running."""


class StreamListener(Protocol):
    """Who hears what the engines' streams carry (the dispatcher)."""

    def on_outputs(self, connection: EngineConnection, *messages: epb.EngineCoreOutputs) -> Awaitable[None]:
        """Consecutive engine messages of one stream, in order."""

    def on_stream_down(self, connection: EngineConnection, message: str) -> None:
        """The stream broke: every request on it is gone from the engine (`message` says why)."""


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

    def __init__(self, address: str, client: EngineClient, server_name: str | None = None) -> None:
        self.address = address
        self.server_name = server_name  # the name its TLS certificate must carry (None: the address's host)
        self.state = State.CONNECTING
        self.info: epb.EngineInfo | None = None
        self.stub: epb_grpc.EngineCoreServiceStub | None = None  # while a session is open (LoRA admin calls)
        self.requests: set[Carried] = set()  # sent here and not done (kept by the dispatcher)
        self.gate = DrainGate()  # the next batch of engine messages waits for the readers of the last
        self.kv_index = KvBlockIndex()  # the engine's cached blocks (followed only for cache-aware routing)
        self._reported_load = 0
        self._sent_since_report = 0
        self._active_adapters: frozenset[str] = frozenset()  # LoRA adapters running or waiting there
        self._client = client
        self._outbox: asyncio.Queue[epb.EngineCoreInput] | None = None
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None
        self._retiring = False
        self._was_ready = False
        self._health_ok = True  # the engine's own health says SERVING (or it has no health service)
        self._last_failure: str | None = None  # why the last attempt to connect failed (logged once)

    # ---- what the router and client read ----------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state is State.READY and self._health_ok and not self._retiring

    @property
    def num_in_flight(self) -> int:
        """Unfinished engine requests this frontend sent here."""
        return sum(request.num_unfinished for request in self.requests)

    @property
    def load(self) -> int:
        return max(self._reported_load + self._sent_since_report, self.num_in_flight)

    @property
    def block_size(self) -> int:
        return int(self.info.block_size) if self.info is not None else 0

    @property
    def max_num_seqs(self) -> int:
        return int(self.info.max_num_seqs) if self.info is not None else 0

    def lora_fingerprint(self, name: str) -> str | None:
        """The content fingerprint the engine announced for adapter `name`: None when it does not serve
        it, "" when it serves it without announcing one (an older engine)."""
        info = self.info
        if info is None or name not in info.lora_adapters:
            return None
        return next((a.fingerprint for a in info.lora_adapter_infos if a.lora_name == name), "")

    @property
    def active_adapters(self) -> frozenset[str]:
        """The LoRA adapters with requests running or waiting on the engine, as of its last stats."""
        return self._active_adapters

    def note_sent(self, count: int) -> None:
        self._sent_since_report += count

    def note_stats(self, stats: Any) -> None:
        self._reported_load = int(stats.num_running) + int(stats.num_waiting)
        self._sent_since_report = 0
        if not self._reported_load:
            self._active_adapters = frozenset()
        elif isinstance(stats, epb.SchedulerStats):  # EngineLoad (GetLoad) does not say
            self._active_adapters = frozenset((*stats.running_lora_adapters, *stats.waiting_lora_adapters))

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
            if not self._was_ready and reason != self._last_failure:  # say why, once per new reason
                logger.warning("engine %s: cannot connect: %s", self.address, reason)
            self._last_failure = None if self._was_ready else reason
            if self._was_ready:
                backoff = BACKOFF_INITIAL_S
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _session(self) -> None:
        channel = self._client.channels(self.address, self.server_name)
        try:
            stub = epb_grpc.EngineCoreServiceStub(channel)
            info = await stub.GetEngineInfo(epb.GetEngineInfoRequest(), timeout=INFO_TIMEOUT_S)
            if not self._client.accepts(self, info):
                self.state = State.MISMATCH
                await asyncio.sleep(BACKOFF_MAX_S * 5)
                return
            serving = await _is_serving(channel)  # a draining engine must not be routable, even briefly
            if self._client.prepare_session is not None:  # e.g. LoRA adapters loaded at run time (lora_admin.py);
                await self._client.prepare_session(stub, info)  # nothing awaits between it and READY below
            outbox: asyncio.Queue[epb.EngineCoreInput] = asyncio.Queue()
            call = stub.Connect(_drain(outbox))
            self.info, self._outbox, self._call, self.stub = info, outbox, call, stub
            self.state, self._was_ready = State.READY, True
            self._reported_load = self._sent_since_report = 0
            self._health_ok = serving
            logger.info("engine %s ready (engine_id %s, max_model_len %d)",
                        self.address, info.engine_id, info.max_model_len)
            self._client.connection_changed()
            loop = asyncio.get_running_loop()
            helpers = [loop.create_task(self._poll_load(stub)), loop.create_task(self._watch_health(channel)),
                       loop.create_task(follow_lora_adapters(stub, info, self.address))]
            if self._client.router.uses_kv_events and info.kv_cache_events:
                helpers.append(loop.create_task(follow_kv_events(stub, self.kv_index, self.address, self.note_stats)))
            try:
                await self._process_stream(call)
            finally:
                for helper in helpers:
                    helper.cancel()
        finally:
            await channel.close(grace=None)

    async def _process_stream(self, call: Any) -> None:
        """Process the engine's messages until the stream ends (returns) or breaks (raises what the read
        raised): whatever was read before the end is processed first. The messages queued while the
        previous batch was processed, and its readers took their output (`DrainGate`), form the next
        batch (`EngineClient.on_outputs`)."""
        queue: asyncio.Queue[Any] = asyncio.Queue(READ_AHEAD)
        reader = asyncio.get_running_loop().create_task(_read_ahead(call, queue))
        on_outputs = self._client.on_outputs
        try:
            while True:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                end = batch.pop() if not isinstance(batch[-1], epb.EngineCoreOutputs) else None
                if batch:
                    await on_outputs(self, *batch)
                    await self.gate.drained()
                if end is _STREAM_END:
                    return
                if end is not None:
                    raise end
        finally:
            reader.cancel()

    async def _poll_load(self, stub: epb_grpc.EngineCoreServiceStub) -> None:
        """While nothing of ours runs there (so no stats arrive), ask for the engine's load."""
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            if not self.requests:
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
        self._outbox, self.stub = None, None
        self.kv_index.clear()
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
    return bool(answer.status != health_pb2.HealthCheckResponse.NOT_SERVING)


async def _drain(outbox: asyncio.Queue[epb.EngineCoreInput]) -> AsyncIterator[epb.EngineCoreInput]:
    """The request side of a Connect stream: whatever is queued, in order, forever."""
    while True:
        yield await outbox.get()


class EngineClient:
    """The engines a frontend talks to: their connections, readiness and the choice of one per request."""

    def __init__(
        self,
        targets: Sequence[str],
        vocab_size: int,
        *,
        router: Router | None = None,
        on_change: Callable[[], None] = lambda: None,
        dns_refresh_s: float = 5.0,
        channels: ChannelFactory | None = None,
        tokenizer_sha256: str | None = None,
    ) -> None:
        """`tokenizer_sha256`: the checksum of the tokenizer archive this frontend fetched from the engines
        (None: it read --model); an engine serving another tokenizer is never routed to. The `listener`
        (the dispatcher) is attached before `start`."""
        self.targets = tuple(targets)
        self.tokenizer_sha256 = tokenizer_sha256
        self.channels = channels or ChannelFactory()
        self.vocab_size = vocab_size
        self.router = router or Router()
        self.listener: StreamListener | None = None
        self._on_change = on_change
        self._dns_refresh_s = dns_refresh_s
        self._connections: dict[str, EngineConnection] = {}
        self._retired: set[EngineConnection] = set()  # left the target set; closed once idle
        self._resolved: dict[str, list[str]] = {}  # target -> its last good addresses
        self._background: set[asyncio.Task[None]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None  # set (and replaced) at every readiness change
        # Awaited with (stub, info) before an engine becomes ready; raising fails the session (retried).
        self.prepare_session: Callable[[Any, epb.EngineInfo], Awaitable[None]] | None = None

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
        wanted: dict[str, str | None] = {}  # address -> the name its certificate must carry
        for target in self.targets:
            try:
                self._resolved[target] = await loop.run_in_executor(None, resolve_target, target)
            except OSError as exc:
                logger.warning("cannot resolve engine target %s (keeping its last addresses): %s", target, exc)
            name = dns_target_host(target) if is_dns_target(target) else None
            wanted.update(dict.fromkeys(self._resolved.get(target, ()), name))
        for address in sorted(wanted.keys() - self._connections.keys()):
            connection = EngineConnection(address, self, wanted[address])
            self._connections[address] = connection
            connection.start()
            logger.info("engine %s added", address)
        for address in sorted(self._connections.keys() - wanted.keys()):
            logger.info("engine %s left the target set; retiring it", address)
            connection = self._connections.pop(address)
            connection.retire()
            self._retired.add(connection)
            self.release(connection)
        self.connection_changed()

    # ---- what the dispatcher and the server use ----------------------------------------------------
    def ready_engines(self) -> list[EngineConnection]:
        return [c for c in self._connections.values() if c.ready]

    def ready_in(self, pool: str | None, avoid: EngineConnection | None = None) -> list[EngineConnection]:
        """The ready engines of `pool` (all of them for None), less `avoid`."""
        return [c for c in self.ready_engines() if c is not avoid
                and (pool is None or (c.info is not None and in_pool(c.info.kv_role, pool)))]

    def connections(self) -> list[EngineConnection]:
        return list(self._connections.values())

    def choose(self, prompt_token_ids: Sequence[int], avoid: EngineConnection | None = None,
               pool: str | None = None, lora_name: str = "") -> EngineConnection:
        """The ready engine a new request goes to (all n completions of a request go to one engine: they
        share the prompt's KV blocks), never `avoid`, only from `pool` (pd_flow.PREFILL / DECODE: engines
        whose kv_role serves it) when given, one serving LoRA adapter `lora_name` when any does;
        EngineUnavailable when there is none."""
        connection = self.router.choose(self.ready_in(pool, avoid), prompt_token_ids, lora_name)
        if connection is None:
            raise EngineUnavailable("no engine is ready to serve requests; retry shortly")
        return connection

    async def wait_for_ready_engine(self, timeout: float, avoid: EngineConnection | None = None) -> bool:
        """Wait until an engine other than `avoid` is ready (True), or `timeout` seconds pass without one
        (False)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not [c for c in self.ready_engines() if c is not avoid]:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    def release(self, connection: EngineConnection, request: Carried | None = None) -> None:
        """`request` is done with `connection`; a retired connection closes once it carries nothing."""
        if request is not None:
            connection.requests.discard(request)
        if connection.retiring and not connection.requests and connection in self._retired:
            self._retired.discard(connection)
            task = asyncio.get_running_loop().create_task(connection.close())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # ---- called by connections -----------------------------------------------------------------------
    def accepts(self, connection: EngineConnection, info: epb.EngineInfo) -> bool:
        if self.tokenizer_sha256 is not None and info.tokenizer_sha256 != self.tokenizer_sha256:
            if connection.state is not State.MISMATCH:
                logger.error("engine %s serves tokenizer files with sha256 %s, not the %s this frontend fetched "
                             "at start: not routing to it (every engine must serve the same model files)",
                             connection.address, info.tokenizer_sha256 or "(none)", self.tokenizer_sha256)
            return False
        if info.vocab_size == self.vocab_size:
            return True
        if connection.state is not State.MISMATCH:
            logger.error("engine %s serves vocab_size %d but this frontend's model has %d: not routing to "
                         "it (frontend and engine must serve the same model)",
                         connection.address, info.vocab_size, self.vocab_size)
        return False

    def connection_changed(self) -> None:
        if self._changed is not None:  # wake whoever waits for a ready engine
            self._changed.set()
            self._changed = None
        self._on_change()

    def connection_down(self, connection: EngineConnection, message: str, was_ready: bool) -> None:
        """The stream broke: its requests are gone from the engine, and the listener ends them."""
        if self.listener is not None and connection.requests:
            self.listener.on_stream_down(connection, message)
        self.release(connection)
        if was_ready:
            self.connection_changed()

    async def on_outputs(self, connection: EngineConnection, *messages: epb.EngineCoreOutputs) -> None:
        """Consecutive engine messages of one stream: the load they report noted, then to the listener."""
        for message in messages:
            if message.HasField("scheduler_stats"):
                connection.note_stats(message.scheduler_stats)
        if self.listener is not None:
            await self.listener.on_outputs(connection, *messages)


_STREAM_END = object()


async def _read_ahead(call: Any, queue: asyncio.Queue[Any]) -> None:
    """Read the engine's messages into `queue` (which bounds how far ahead); then `_STREAM_END`, or the
    exception that broke the stream."""
    try:
        async for message in call:
            await queue.put(message)
    except Exception as exc:  # the processing side raises it, after what was read before it (cancellation,
        # a BaseException, passes through)
        await queue.put(exc)
        return
    await queue.put(_STREAM_END)


def is_dns_target(target: str) -> bool:
    return target.startswith("dns:")


def _dns_host_port(target: str) -> tuple[str, str]:
    rest = target[len("dns:"):]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else rest[2:]  # drop the authority
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise OSError(f"engine target {target!r} must look like dns:///name:port")
    return host, port


def dns_target_host(target: str) -> str | None:
    """The name of a `dns:///name:port` target (what the engines' TLS certificate must carry)."""
    try:
        return _dns_host_port(target)[0].strip("[]")
    except OSError:
        return None


def resolve_target(target: str) -> list[str]:
    """The `host:port` addresses of a target: itself, or every A/AAAA record of `dns:///name:port`."""
    if not is_dns_target(target):
        return [target]
    host, port = _dns_host_port(target)
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    addresses = {_join(str(info[4][0]), int(port)) for info in infos}
    return sorted(addresses)


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
