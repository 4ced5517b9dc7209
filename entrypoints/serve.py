"""`tandem serve`: run an engine and a frontend together on this machine (the embedded default).

  tandem serve --model DIR [engine flags...] [--port 50050] [--engine-port 50051]

Starts `tandem-engine` (on 127.0.0.1:--engine-port, with every flag this command does not know) and
`tandem-frontend` (on --host:--port, and the OpenAI-compatible HTTP API on --host:--http-port, default
8000; 0 turns it off) as two child processes, waits until the frontend's health is
SERVING, prints the address, and then waits. SIGINT/SIGTERM are forwarded to both (each drains and
exits); a second signal is forwarded too (immediate exit). If either child dies, the other is stopped
and the exit status is non-zero. Children die with this process (PR_SET_PDEATHSIG on Linux), so none
is ever orphaned.

Security: --ssl-certfile/--ssl-keyfile/--ssl-ca-certs, --api-key/--api-key-file (or $TANDEM_API_KEY)
go to the frontend, which is the only public port. The engine stays plaintext on loopback (nothing
off the host can reach it) and requires an engine token, so other local users cannot reach it either:
this command makes one (unless --engine-token-file names one) in a private directory (mode 0700, the
file 0600) that only it and its children read, removed when it exits. Keys given with --api-key reach
the frontend through a file in that directory, never its command line (where `ps` would show them);
--api-key itself shows in this command's `ps` line, so prefer --api-key-file or $TANDEM_API_KEY.
With TLS on, the frontend also serves plaintext health (health status only, nothing else) on an extra
port, which is what this command polls for readiness.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared_runtime.security.flags import (
    API_KEY_FLAG_WARNING,
    SERVER,
    add_api_key_args,
    add_engine_token_arg,
    add_tls_args,
)
from shared_runtime.security.http_limits import add_http_limit_args, http_limit_argv
from shared_runtime.security.listen import join_host_port

STOP_TIMEOUT_S = 60.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="the frontend's bind address")
    p.add_argument("--port", type=int, default=50050, help="the frontend's port (the public API)")
    p.add_argument("--engine-port", type=int, default=50051, help="the engine's port, on 127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the frontend's OpenAI-compatible HTTP API (0: off; docs/openai.md)")
    p.add_argument("--max-concurrent-requests", type=int, default=None)
    p.add_argument("--routing", default=None)
    p.add_argument("--tool-call-parser", default=None,
                   help="the model's tool-call format for OpenAI tool_choice 'auto' (hermes; docs/openai.md)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat request's own chat_template (vLLM's flag; only for trusted clients)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="the frontend's --stream-interval: tokens per streamed chunk at least (default 1)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="the frontend's Prometheus port (default 0: off, so nothing else on the host clashes)")
    p.add_argument("--engine-metrics-port", type=int, default=0, help="the engine's Prometheus port (0: off)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for SERVING")
    s = p.add_argument_group("security (the frontend's public port; docs/security.md)")
    add_tls_args(s, side=SERVER, peer="clients")
    add_api_key_args(s)
    add_engine_token_arg(s, SERVER)  # given to both services
    s.add_argument("--health-port", type=int, default=None,
                   help="the frontend's plaintext health port (default with TLS: a free port)")
    add_http_limit_args(p.add_argument_group("the frontend's HTTP API limits (docs/security.md)"))
    return p


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def write_secret(directory: Path, name: str, text: str) -> str:
    """`text` in a new file `directory/name` that only this user can read (0600); returns its path."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def prepare_secrets(args: argparse.Namespace, directory: Path) -> None:
    """Point `args` at files in `directory` (private, made by the caller): a new engine token unless one
    was given, and the --api-key keys (which then leave the children's command lines)."""
    if args.engine_token_file is None:
        args.engine_token_file = write_secret(directory, "engine-token", secrets.token_urlsafe(32) + "\n")
    if args.api_key:
        if args.api_key_file:
            raise ValueError("give the API keys with --api-key or with --api-key-file, not both")
        args.api_key_file = write_secret(directory, "api-keys", "".join(f"{k}\n" for k in args.api_key))
        args.api_key = []


def _frontend_security_args(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "api_key_file", "engine_token_file",
                 "health_port"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


def child_commands(args: argparse.Namespace, engine_args: list[str]) -> tuple[list[str], list[str]]:
    """(engine argv, frontend argv), both run with this interpreter (after `prepare_secrets`)."""
    if args.api_key:
        raise ValueError("prepare_secrets() first: API keys never go on a child's command line")
    engine = [sys.executable, "-m", "engine_svc.cli", "--model", args.model,
              "--host", "127.0.0.1", "--port", str(args.engine_port),
              "--metrics-port", str(args.engine_metrics_port), *engine_args]
    if args.engine_token_file:
        engine += ["--engine-token-file", args.engine_token_file]
    if args.ssl_certfile and not args.health_port:  # readiness is polled in plaintext: it needs its own port
        args.health_port = _free_port()
    frontend = [sys.executable, "-m", "frontend_svc.cli", "--model", args.model,
                "--engine", f"127.0.0.1:{args.engine_port}", "--host", args.host, "--port", str(args.port),
                "--metrics-port", str(args.metrics_port), "--http-port", str(args.http_port)]
    if args.max_concurrent_requests is not None:
        frontend += ["--max-concurrent-requests", str(args.max_concurrent_requests)]
    if args.routing is not None:
        frontend += ["--routing", args.routing]
    if args.tool_call_parser is not None:
        frontend += ["--tool-call-parser", args.tool_call_parser]
    if args.trust_request_chat_template:
        frontend.append("--trust-request-chat-template")
    if args.stream_interval is not None:
        frontend += ["--stream-interval", str(args.stream_interval)]
    frontend += _frontend_security_args(args) + http_limit_argv(args)
    return engine, frontend


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux); elsewhere a no-op."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    # Own session: a terminal's Ctrl-C reaches only this process, which forwards it exactly once.
    return subprocess.Popen(argv, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def wait_serving(address: str, children: list[subprocess.Popen[bytes]], timeout: float,
                 stopping: list[int]) -> bool:
    """Poll the frontend's health until SERVING; False if a child died, a signal came or time ran out."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and not stopping:
            if any(c.poll() is not None for c in children):
                return False
            try:
                answer = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.25)
    return False


def main(argv: list[str] | None = None) -> int:
    args, engine_args = build_parser().parse_known_args(argv)
    if args.api_key:
        print(f"tandem serve: warning: {API_KEY_FLAG_WARNING}", file=sys.stderr)
    private = Path(tempfile.mkdtemp(prefix="tandem-serve-"))  # mode 0700
    try:
        prepare_secrets(args, private)
        return _serve(args, engine_args)
    except ValueError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _serve(args: argparse.Namespace, engine_args: list[str]) -> int:
    engine_cmd, frontend_cmd = child_commands(args, engine_args)
    signals: list[int] = []
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: object) -> None:
        signals.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM if len(signals) == 1 else signal.SIGINT)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    children.append(spawn(engine_cmd))
    children.append(spawn(frontend_cmd))
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    address = join_host_port(host, args.health_port or args.port)  # plaintext health
    failed = False
    if wait_serving(address, children, args.startup_timeout, signals):
        http = f", the OpenAI API on {args.host}:{args.http_port}" if args.http_port else ""
        print(f"tandem is serving tandem.v1.GenerationService on {args.host}:{args.port}{http} "
              f"(engine on 127.0.0.1:{args.engine_port}); Ctrl-C stops it", flush=True)
    elif not signals:
        print("tandem serve: the services did not become ready; stopping", file=sys.stderr)
        failed = True
        forward(signal.SIGTERM, None)
    while not signals and all(c.poll() is None for c in children):
        time.sleep(0.2)
    if not signals:  # a child died on its own: stop the other
        print("tandem serve: a service exited unexpectedly; stopping the other", file=sys.stderr)
        failed = True
        forward(signal.SIGTERM, None)
    return _reap(children, failed)


def _reap(children: list[subprocess.Popen[bytes]], failed: bool) -> int:
    """Wait for both children (killing stragglers); 0 only if both exited cleanly and none failed."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    codes = []
    for child in children:
        try:
            codes.append(child.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            child.kill()
            codes.append(child.wait())
    if failed:
        return next((c for c in codes if c), 1)
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
