"""`tandem serve` passes the security flags to the right child: TLS and API keys to the (public) frontend,
the engine token to both, the engine stays on plaintext loopback; with TLS it polls a plaintext health port."""

from __future__ import annotations

from engine_svc import serve_cli


def commands(*argv: str) -> tuple[list[str], list[str], object]:
    args, engine_args = serve_cli.build_parser().parse_known_args(["--model", "m", *argv])
    engine, frontend = serve_cli.child_commands(args, engine_args)
    return engine, frontend, args


def test_security_flags_reach_the_frontend_and_the_token_both() -> None:
    engine, frontend, args = commands("--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem",
                                      "--api-key", "k1", "--api-key", "k2", "--engine-token-file", "tok",
                                      "--dtype", "float32")
    joined = " ".join(frontend)
    for flag in ("--ssl-certfile c.pem", "--ssl-keyfile k.pem", "--ssl-ca-certs ca.pem", "--api-key k1",
                 "--api-key k2", "--engine-token-file tok"):
        assert flag in joined
    assert "--ssl-certfile" not in engine and "--api-key" not in engine
    assert engine[engine.index("--host") + 1] == "127.0.0.1" and "--engine-token-file" in engine
    assert "--dtype" in engine  # unknown flags still go to the engine
    health_port = args.health_port  # type: ignore[attr-defined]
    assert health_port and frontend[frontend.index("--health-port") + 1] == str(health_port)


def test_plaintext_serve_adds_nothing() -> None:
    _engine, frontend, args = commands()
    assert "--health-port" not in frontend and "--ssl-certfile" not in frontend
    assert args.health_port is None  # type: ignore[attr-defined]


def test_tls_with_health_port_zero_still_gets_a_plaintext_health_port() -> None:
    """`--health-port 0` means "none given": under TLS, readiness is polled in plaintext on its own port
    (polling the TLS port in plaintext would wait out the whole start-up timeout)."""
    _engine, frontend, args = commands("--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--health-port", "0")
    health_port = args.health_port  # type: ignore[attr-defined]
    assert health_port > 0 and frontend[frontend.index("--health-port") + 1] == str(health_port)
