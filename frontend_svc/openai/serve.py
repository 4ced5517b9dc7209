"""The HTTP server: uvicorn on the frontend's own event loop, beside the gRPC server (docs/openai.md).

`HttpServer.start()` binds the port itself (exclusively: a port that is taken is a `BindError`, as for
gRPC), then runs `uvicorn.Server` as a task on the running loop. uvicorn's own signal handling is off
(the frontend's CLI owns SIGTERM/SIGINT/SIGHUP), and so is its lifespan protocol. `stop()` stops
accepting connections, lets in-flight responses finish for up to `grace` seconds, then cancels them
(each cancelled stream aborts its requests in the engine).

Drain order (frontend_svc/cli.py): SIGTERM -> `FrontendServer.drain()` (health and /health go 503, new
requests on either API get UNAVAILABLE / 503, in-flight ones finish) -> `FrontendServer.stop()` ->
`HttpServer.stop()`.

TLS: with `--ssl-certfile/--ssl-keyfile` the HTTP port serves HTTPS with the same certificate (and
with `--ssl-ca-certs` requires client certificates from that CA, like the gRPC port). `HttpTls`
re-reads the files when they change (checked at each new handshake, at most once a second) or on
`reload()` (SIGHUP): new connections get the new certificate, open ones keep theirs. The handshake is
started per connection by the edge protocol (edge.py), after the connection cap admitted it.

Limits (`HttpLimits`, docs/security.md): header bytes and fields (431), idle, header-read and body
timeouts, a connection cap with a small backlog, TCP_NODELAY; see edge.py. Messages a client can
trigger once per connection (a malformed request, a failed accept) are logged at most once per 10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Generator

import uvicorn

from frontend_svc.generation import GenerationBackend
from frontend_svc.openai.app import OpenAIApi
from frontend_svc.openai.edge import EdgeConfig
from shared_runtime.security.http_limits import ConnectionGuard, HttpLimits, fd_budget, rate_limit_logs
from shared_runtime.security.listen import BindError, join_host_port
from shared_runtime.security.tls import ReloadingCredentials, TlsFiles

logger = logging.getLogger(__name__)
_RECHECK_S = 1.0
# What a client can make the server log once per connection: kept to one line per 10 s each.
_CLIENT_TRIGGERED = {
    "uvicorn.error": ("Invalid HTTP request received.", "Unsupported upgrade request.",
                      "No supported WebSocket library detected."),
    "asyncio": ("socket.accept() out of system resource", "Error on transport creation for incoming connection"),
}


class HttpTls(ReloadingCredentials[ssl.SSLContext]):
    """A server `SSLContext` whose certificate is swapped in for new handshakes when the files change."""

    what = "HTTP TLS certificates"

    def __init__(self, files: TlsFiles) -> None:
        files.check_server()
        super().__init__(files)
        self._next_check = 0.0
        self.context = self._build()  # the listener's context: it only hands each handshake `current`
        self.context.sni_callback = self._on_handshake

    def _build(self) -> ssl.SSLContext:
        ctx = self.files.server_context()
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def _on_handshake(self, sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, ctx: ssl.SSLContext) -> None:
        now = time.monotonic()
        if now >= self._next_check:  # a stat of the files at most once a second, not per handshake
            self._next_check = now + _RECHECK_S
            self.check()
        sock.context = self.current


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (the frontend's CLI installs its own on the loop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class HttpServer:
    """The OpenAI API of one frontend (`GenerationBackend`) on `host:port`; request bodies of at most
    `max_body_bytes`."""

    def __init__(self, frontend: GenerationBackend, host: str, port: int, max_body_bytes: int,
                 tls: TlsFiles | None = None, limits: HttpLimits | None = None,
                 tool_call_parser: str | None = None, trust_request_chat_template: bool = False) -> None:
        self.host, self.port = host, port
        self.tls = HttpTls(tls) if tls is not None and tls.enabled else None
        self.api = OpenAIApi(frontend, max_body_bytes, tool_call_parser, trust_request_chat_template)
        self.limits = limits or HttpLimits()
        self.guard = ConnectionGuard(fd_budget(self.limits.max_connections), f"HTTP port {port}")
        self.bound_port = 0
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        sock = bind(self.host, self.port, self.limits.backlog)
        self.bound_port = int(sock.getsockname()[1])
        self.guard.what = f"HTTP port {self.bound_port}"
        for name, messages in _CLIENT_TRIGGERED.items():
            rate_limit_logs(name, messages)
        config = EdgeConfig(self.api.asgi(), limits=self.limits, guard=self.guard,
                            tls_context=self.tls.context if self.tls is not None else None,
                            lifespan="off", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=None, server_header=False, ws="none")
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise BindError(f"the HTTP server on {join_host_port(self.host, self.bound_port)} did not start")
            await asyncio.sleep(0.01)
        logger.info("OpenAI-compatible HTTP API on %s://%s", "https" if self.tls else "http",
                    join_host_port(self.host, self.bound_port))
        return self.bound_port

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting; in-flight responses get `grace` seconds, then are cancelled."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=grace)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            for task in list(self._server.server_state.tasks):
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, timeout=2.0)
        self._server = None

    def reload_credentials(self) -> None:
        if self.tls is not None:
            self.tls.reload()


def bind(host: str, port: int, backlog: int = HttpLimits.backlog) -> socket.socket:
    """A listening TCP socket on host:port, not shared (no SO_REUSEPORT); BindError names the address."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=backlog, reuse_port=False)
    except OSError as exc:
        raise BindError(f"cannot listen on {join_host_port(host, port)} (HTTP): the port is in use or the "
                        f"address is not on this host ({exc.strerror or exc})") from None
    sock.setblocking(False)
    return sock
