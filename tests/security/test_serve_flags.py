"""`tandem serve` passes the security flags to the right child: TLS and API keys to the (public) frontend,
the engine token to both, the engine stays on plaintext loopback; with TLS it polls a plaintext health port.
No secret is ever on a child's command line: the keys and the token travel in private files."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from entrypoints import serve as serve_cli


def commands(*argv: str, private: Path | None = None) -> tuple[list[str], list[str], object]:
    args, engine_args = serve_cli.build_parser().parse_known_args(["--model", "m", *argv])
    if private is not None:
        serve_cli.prepare_secrets(args, private)
    engine, frontend = serve_cli.child_commands(args, engine_args)
    return engine, frontend, args


def test_security_flags_reach_the_frontend_and_the_token_both(tmp_path: Path) -> None:
    engine, frontend, args = commands("--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem",
                                      "--api-key", "k1", "--api-key", "k2", "--engine-token-file", "tok",
                                      "--dtype", "float32", private=tmp_path)
    joined = " ".join(frontend)
    for flag in ("--ssl-certfile c.pem", "--ssl-keyfile k.pem", "--ssl-ca-certs ca.pem", "--engine-token-file tok"):
        assert flag in joined
    assert "k1" not in joined and "k2" not in joined and "--api-key " not in joined + " "
    key_file = Path(frontend[frontend.index("--api-key-file") + 1])
    assert key_file.read_text().split() == ["k1", "k2"] and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert "--ssl-certfile" not in engine and "--api-key" not in " ".join(engine)
    assert engine[engine.index("--host") + 1] == "127.0.0.1" and engine[engine.index("--engine-token-file") + 1] == "tok"
    assert "--dtype" in engine  # unknown flags still go to the engine
    health_port = args.health_port  # type: ignore[attr-defined]
    assert health_port and frontend[frontend.index("--health-port") + 1] == str(health_port)


def test_an_engine_token_is_made_when_none_is_given(tmp_path: Path) -> None:
    engine, frontend, _args = commands(private=tmp_path)
    token = engine[engine.index("--engine-token-file") + 1]
    assert frontend[frontend.index("--engine-token-file") + 1] == token
    assert Path(token).parent == tmp_path and stat.S_IMODE(Path(token).stat().st_mode) == 0o600
    assert len(Path(token).read_text().strip()) >= 32
    other = tmp_path / "other"
    other.mkdir()
    engine2, _frontend2, _ = commands(private=other)
    assert Path(engine2[engine2.index("--engine-token-file") + 1]).read_text() != Path(token).read_text()


def test_keys_on_a_child_command_line_are_refused() -> None:
    with pytest.raises(ValueError, match="prepare_secrets"):
        commands("--api-key", "k1")  # child_commands before prepare_secrets


def test_plaintext_serve_adds_no_tls_flags(tmp_path: Path) -> None:
    _engine, frontend, args = commands(private=tmp_path)
    assert "--health-port" not in frontend and "--ssl-certfile" not in frontend
    assert args.health_port is None  # type: ignore[attr-defined]


def test_http_limits_reach_the_frontend(tmp_path: Path) -> None:
    engine, frontend, _args = commands("--http-max-connections", "100", "--http-timeout-keep-alive", "2.5",
                                       private=tmp_path)
    joined = " ".join(frontend)
    assert "--http-max-connections 100" in joined and "--http-timeout-keep-alive 2.5" in joined
    assert "--http-max-connections" not in engine


def test_tls_with_health_port_zero_still_gets_a_plaintext_health_port(tmp_path: Path) -> None:
    """`--health-port 0` means "none given": under TLS, readiness is polled in plaintext on its own port
    (polling the TLS port in plaintext would wait out the whole start-up timeout)."""
    _engine, frontend, args = commands("--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--health-port", "0",
                                       private=tmp_path)
    health_port = args.health_port  # type: ignore[attr-defined]
    assert health_port > 0 and frontend[frontend.index("--health-port") + 1] == str(health_port)


def test_a_key_on_the_command_line_is_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k2\n")
    assert serve_cli.main(["--model", "m", "--api-key", "k1", "--api-key-file", str(keys)]) == 2
    err = capsys.readouterr().err
    assert "--api-key-file" in err and "ps" in err and "not both" in err
    from frontend_svc import cli

    assert cli.main(["--model", str(tmp_path / "missing"), "--api-key", "k1"]) == 2  # a config error, after the warning
    assert any("--api-key-file" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
