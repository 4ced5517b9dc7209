"""What the two services' command lines share from the `tandem` package (neither imports the other):
the signal wiring (`shared_runtime.signals`), the TLS and engine-token flags (`shared_runtime.security.flags`) and the
link's message-size limit (`shared_runtime.link`). The processes' own signal behaviour is checked end to end in
tests/e2e (drain, a second SIGTERM, SIGHUP reloads)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared_runtime.link import MAX_MESSAGE_BYTES
from shared_runtime.security.flags import tls_files
from shared_runtime.signals import ServiceSignals

ROOT = Path(__file__).resolve().parents[1]


class Calls:
    def __init__(self) -> None:
        self.seen: list[str] = []

    def record(self, name: str) -> None:
        self.seen.append(name)

    async def drain(self) -> None:  # a coroutine, as FrontendServer.drain is
        await asyncio.sleep(0)
        self.record("drain")


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} never happened")


def test_first_signal_drains_a_second_stops_with_exit_code_one_and_sighup_reloads() -> None:
    calls = Calls()

    async def main() -> ServiceSignals:
        signals = ServiceSignals(drain=calls.drain, stop=lambda: calls.record("stop"),
                                 reload=lambda: calls.record("reload"))
        signals.install()
        try:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # never send one nobody handles
                assert signal.getsignal(sig) not in (signal.SIG_DFL, signal.default_int_handler), sig
            os.kill(os.getpid(), signal.SIGHUP)
            await _until(lambda: calls.seen == ["reload"], "reload")
            os.kill(os.getpid(), signal.SIGTERM)
            await _until(lambda: calls.seen[-1:] == ["drain"], "drain")
            assert signals.exit_code == 0  # a drain alone is a clean exit
            os.kill(os.getpid(), signal.SIGINT)
            await _until(lambda: calls.seen[-1:] == ["stop"], "stop")
        finally:
            signals.remove()
        return signals

    signals = asyncio.run(main())
    assert calls.seen == ["reload", "drain", "stop"]
    assert signals.exit_code == 1
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # removed: the test process is left as it was


def test_later_signals_keep_stopping() -> None:
    calls = Calls()
    signals = ServiceSignals(drain=lambda: calls.record("drain"), stop=lambda: calls.record("stop"),
                             reload=lambda: None)
    for _ in range(3):
        signals.on_shutdown_signal()
    assert calls.seen == ["drain", "stop", "stop"] and signals.exit_code == 1


def test_both_services_take_the_same_tls_and_token_flags() -> None:
    from engine_svc.cli import build_parser as engine_parser
    from frontend_svc.cli import build_parser as frontend_parser

    tls = ["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem",
           "--engine-token-file", "token"]
    engine = engine_parser().parse_args(["--model", "m", *tls])
    frontend = frontend_parser().parse_args(["--model", "m", *tls, "--engine-ssl-ca-certs", "engines-ca.pem"])
    for args in (engine, frontend):
        files = tls_files(args)
        assert (files.certfile, files.keyfile, files.ca_certs, files.prefix) == ("c.pem", "k.pem", "ca.pem", "--ssl")
        assert args.engine_token_file == "token"
    to_engines = tls_files(frontend, "--engine-ssl")
    assert (to_engines.certfile, to_engines.ca_certs, to_engines.prefix) == (None, "engines-ca.pem", "--engine-ssl")


def test_the_engine_takes_its_message_limit_from_the_shared_package() -> None:
    from engine_svc.api.server import server_options
    from engine_svc.cli import build_parser

    assert build_parser().parse_args(["--model", "m"]).max_message_bytes == MAX_MESSAGE_BYTES
    options = dict(server_options())
    assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"] == MAX_MESSAGE_BYTES



def test_a_shutdown_before_bind_is_delivered_by_bind() -> None:
    calls = Calls()
    early = ServiceSignals()
    early.on_shutdown_signal()  # during start-up: nothing bound yet
    assert early.stopping and calls.seen == []
    early.bind(drain=lambda: calls.record("drain"), stop=lambda: calls.record("stop"), reload=lambda: None)
    assert calls.seen == ["drain"]
    twice = ServiceSignals()
    twice.on_shutdown_signal()
    twice.on_shutdown_signal()
    twice.bind(drain=lambda: calls.record("drain"), stop=lambda: calls.record("stop"), reload=lambda: None)
    assert calls.seen == ["drain", "stop"] and twice.exit_code == 1


STARTUP_PROBE = """
import sys
from {module} import main
print("imported", flush=True)
sys.exit(main({argv!r}))
"""


def _interrupt_during_start(module: str, argv: list[str], after_s: float, tmp_path: Path) -> tuple[int, str]:
    """Start a service, send SIGINT (a terminal's Ctrl-C) `after_s` after its modules are imported, and
    return (exit code, everything it printed)."""
    log = tmp_path / f"{module}-{after_s}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-u", "-c", STARTUP_PROBE.format(module=module, argv=argv)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=out, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=_as_from_a_terminal)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "imported"
        time.sleep(after_s)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            pytest.fail(f"{module} still ran 60 s after SIGINT; it printed:\n{log.read_text()[-4000:]}")
    return code, log.read_text()


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT at its default and unblocked, as a shell starts a program (the
    test process's own threads and libraries may have ignored or blocked it, and both are inherited)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.parametrize("after_s", [0.0, 0.3, 0.8, 2.0])
def test_ctrl_c_while_the_frontend_starts_ends_it_without_a_traceback(after_s: float, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    """Before the fix, a Ctrl-C while the frontend built its tokenizer cancelled asyncio's main task inside
    grpc's server start: a CancelledError and a KeyboardInterrupt traceback, and grpc's 'invalid state'."""
    code, printed = _interrupt_during_start(
        "frontend_svc.cli", ["--model", str(tiny_model_dir), "--port", "0", "--metrics-port", "0",
                             "--engine", "127.0.0.1:1"], after_s, tmp_path)
    assert "Traceback" not in printed and "invalid state" not in printed, printed
    assert code in (0, 130), (code, printed)


@pytest.mark.parametrize("after_s", [0.0, 1.0, 3.0])
def test_ctrl_c_while_the_engine_starts_ends_it_without_a_traceback(after_s: float, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    code, printed = _interrupt_during_start(
        "engine_svc.cli", ["--model", str(tiny_model_dir), "--port", "0", "--metrics-port", "0",
                           "--kv-cache-memory-bytes", str(8 << 20)], after_s, tmp_path)
    assert "Traceback" not in printed, printed
    assert code in (0, 130), (code, printed)
