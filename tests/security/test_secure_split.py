"""The whole split locked down, as real processes: engine with mutual TLS and an engine token, frontend with
TLS + client certificates + API keys on its public port, and mTLS + the token towards the engine.

- The Python and the Node.js (@grpc/grpc-js) clients generate over TLS with a certificate and a key.
- Reaching the engine directly: no certificate or a rogue one is refused; a good certificate without the
  engine token is UNAUTHENTICATED; health needs neither token nor (on the plaintext health port) TLS.
- A frontend with the wrong engine token never becomes ready.
- SIGHUP re-reads the engine's certificates; a stream open across the reload keeps streaming.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.engine.v1 import engine_core_pb2 as epb
from tandem.engine.v1 import engine_core_pb2_grpc as epb_grpc

from frontend_svc.client import TandemClient, channel_credentials, collect
from tests.e2e.conftest import ENGINE_FLAGS
from tests.security.certs import CertificateAuthority
from tests.support import ROOT, Service, free_port, is_serving, wait_until

pytestmark = pytest.mark.slow

API_KEY = "sk-e2e-31415"
SERVING = health_pb2.HealthCheckResponse.SERVING
ENGINE_NAME = [("grpc.ssl_target_name_override", "tandem-engine")]  # what the engine's certificate names
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


class Secure:
    """Paths and processes of the locked-down split."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = CertificateAuthority(root / "pki", "tandem-ca")
        self.rogue = CertificateAuthority(root / "rogue", "rogue-ca")
        # The engine's certificate names the Service, not an address: frontends verify it with
        # --engine-ssl-server-name (in Kubernetes, pod IPs come and go).
        self.engine_cert = self.ca.issue("tandem-engine", dns_names=("tandem-engine",), ips=(), stem="engine")
        self.frontend_cert = self.ca.issue("tandem-frontend", stem="frontend")
        self.client_cert = self.ca.issue("a-client", client=True, dns_names=(), ips=(), stem="client")
        self.to_engine = self.ca.issue("frontend-to-engine", client=True, dns_names=(), ips=(), stem="to-engine")
        self.rogue_cert = self.rogue.issue("intruder", client=True, dns_names=(), ips=(), stem="intruder")
        self.live = root / "engine-live"  # the engine's certificate files, rotated by a test
        self.live.mkdir()
        shutil.copyfile(self.engine_cert.certfile, self.live / "tls.crt")
        shutil.copyfile(self.engine_cert.keyfile, self.live / "tls.key")
        self.token = root / "engine-token"
        self.token.write_text("tok-e2e-2718\n")
        self.engine: Service | None = None
        self.frontend: Service | None = None

    def engine_argv(self, model: Path, port: int, health_port: int) -> list[str]:
        return [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host", "127.0.0.1",
                "--port", str(port), *ENGINE_FLAGS, "--health-port", str(health_port),
                "--ssl-certfile", str(self.live / "tls.crt"), "--ssl-keyfile", str(self.live / "tls.key"),
                "--ssl-ca-certs", str(self.ca.certfile), "--engine-token-file", str(self.token)]

    def frontend_argv(self, model: Path, engine_port: int, port: int, health_port: int,
                      token: Path | None = None, server_name: str | None = "tandem-engine") -> list[str]:
        return [sys.executable, "-m", "frontend_svc.cli", "--model", str(model),
                "--engine", f"127.0.0.1:{engine_port}", "--host", "127.0.0.1", "--port", str(port),
                "--health-port", str(health_port), "--metrics-port", "0", "--drain-grace-period", "5",
                "--ssl-certfile", str(self.frontend_cert.certfile), "--ssl-keyfile", str(self.frontend_cert.keyfile),
                "--ssl-ca-certs", str(self.ca.certfile), "--api-key", API_KEY,
                "--engine-ssl-ca-certs", str(self.ca.certfile),
                "--engine-ssl-certfile", str(self.to_engine.certfile),
                "--engine-ssl-keyfile", str(self.to_engine.keyfile),
                "--engine-token-file", str(token or self.token),
                *(["--engine-ssl-server-name", server_name] if server_name else [])]

    def client(self, cert: Any | None = None, **extra: Any) -> dict[str, Any]:
        cert = cert or self.client_cert
        return {"ssl_ca_certs": str(self.ca.certfile), "ssl_certfile": str(cert.certfile),
                "ssl_keyfile": str(cert.keyfile), **extra}


def start(service: Service, health_address: str) -> Service:
    """Start `service`; wait until its plaintext health port says SERVING (its main port needs TLS)."""
    return service.start().wait_serving(health_address=health_address)


@pytest.fixture(scope="module")
def secure(make_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Secure, dict[str, int]]]:
    model = make_model("llama")
    s = Secure(tmp_path_factory.mktemp("secure"))
    ports = {name: free_port() for name in ("engine", "engine_health", "frontend", "frontend_health")}
    logs = s.root
    s.engine = start(Service("engine", s.engine_argv(model, ports["engine"], ports["engine_health"]),
                             ports["engine"], logs), f"127.0.0.1:{ports['engine_health']}")
    s.frontend = start(Service("frontend", s.frontend_argv(model, ports["engine"], ports["frontend"],
                                                           ports["frontend_health"]), ports["frontend"], logs),
                       f"127.0.0.1:{ports['frontend_health']}")
    ports["model"] = 0
    s.model = model  # type: ignore[attr-defined]
    try:
        yield s, ports
    finally:
        s.frontend.stop()
        s.engine.stop()


def test_python_client_over_mutual_tls_with_an_api_key(secure: tuple[Secure, dict[str, int]]) -> None:
    s, ports = secure
    address = f"127.0.0.1:{ports['frontend']}"
    with TandemClient(address, **s.client(api_key=API_KEY)) as client:
        out = collect(client.generate(token_ids=[5, 6, 7, 8], timeout=30, **GREEDY))[0]
        assert len(out["token_ids"]) == GREEDY["max_tokens"]
    with TandemClient(address, **s.client()) as client:  # no key
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(token_ids=[5, 6], max_tokens=2, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with TandemClient(address, **s.client(s.rogue_cert, api_key=API_KEY)) as client:  # untrusted certificate
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate(token_ids=[5, 6], max_tokens=2, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_node_client_connects_over_tls(secure: tuple[Secure, dict[str, int]]) -> None:
    s, ports = secure
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: install Node.js 18+ and run `make install`")
    address = f"127.0.0.1:{ports['frontend']}"
    prompt = [5, 6, 7, 8, 9]
    env = {**os.environ, "TANDEM_SSL_CA_CERTS": str(s.ca.certfile), "TANDEM_SSL_CERTFILE": str(s.client_cert.certfile),
           "TANDEM_SSL_KEYFILE": str(s.client_cert.keyfile), "TANDEM_API_KEY": API_KEY}
    script = Path(__file__).resolve().parents[1] / "e2e" / "node" / "generate.js"
    done = subprocess.run([node, str(script), address, json.dumps([{"token_ids": prompt, "sampling_params": GREEDY}])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    [got] = json.loads(done.stdout)
    assert got["ok"], got
    with TandemClient(address, **s.client(api_key=API_KEY)) as client:
        want = collect(client.generate(token_ids=prompt, timeout=30, **GREEDY))[0]
    assert got["token_ids"] == want["token_ids"] and got["text"] == want["text"]
    env.pop("TANDEM_API_KEY")
    done = subprocess.run([node, str(script), address, json.dumps([{"token_ids": prompt, "sampling_params": GREEDY}])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    [denied] = json.loads(done.stdout)
    assert denied["code_name"] == "UNAUTHENTICATED"


def _engine_info_code(address: str, credentials: grpc.ChannelCredentials | None,
                      metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    channel = grpc.secure_channel(address, credentials, options=ENGINE_NAME) if credentials \
        else grpc.insecure_channel(address)
    with channel:
        try:
            epb_grpc.EngineCoreServiceStub(channel).GetEngineInfo(epb.GetEngineInfoRequest(), timeout=5,
                                                                   metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_only_frontends_get_into_the_engine(secure: tuple[Secure, dict[str, int]]) -> None:
    s, ports = secure
    address = f"127.0.0.1:{ports['engine']}"
    ca = str(s.ca.certfile)
    good = channel_credentials(ca, str(s.to_engine.certfile), str(s.to_engine.keyfile))
    token = (("authorization", "Bearer tok-e2e-2718"),)
    assert _engine_info_code(address, None, token) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert _engine_info_code(address, channel_credentials(ca), token) == grpc.StatusCode.UNAVAILABLE  # no cert
    rogue = channel_credentials(ca, str(s.rogue_cert.certfile), str(s.rogue_cert.keyfile))
    assert _engine_info_code(address, rogue, token) == grpc.StatusCode.UNAVAILABLE
    assert _engine_info_code(address, good) == grpc.StatusCode.UNAUTHENTICATED  # certificate, no token
    assert _engine_info_code(address, good, (("authorization", "Bearer guess"),)) == grpc.StatusCode.UNAUTHENTICATED
    assert _engine_info_code(address, good, token) == grpc.StatusCode.OK
    with grpc.secure_channel(address, good, options=ENGINE_NAME) as channel:  # health: no token needed
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == SERVING
    assert is_serving(f"127.0.0.1:{ports['engine_health']}")  # and no TLS on the probe port
    assert "tok-e2e-2718" not in s.engine.log() + s.frontend.log()  # type: ignore[union-attr]


@pytest.mark.parametrize(("token", "server_name", "why"), [
    ("wrong", "tandem-engine", "UNAUTHENTICATED"),  # a certificate but not the token
    (None, None, "UNAVAILABLE"),  # the engine's certificate does not name 127.0.0.1
])
def test_a_frontend_the_engine_refuses_never_becomes_ready(secure: tuple[Secure, dict[str, int]], token: str | None,
                                                           server_name: str | None, why: str) -> None:
    s, ports = secure
    token_file = None
    if token is not None:
        token_file = s.root / "wrong-token"
        token_file.write_text("not-the-token\n")
    port, health_port = free_port(), free_port()
    argv = s.frontend_argv(s.model, ports["engine"], port, health_port, token=token_file,  # type: ignore[attr-defined]
                           server_name=server_name)
    other = Service("frontend-refused", argv, port, s.root).start()
    try:
        wait_until(lambda: f"cannot connect: {why}" in other.log(), 60, "the connection refused")
        assert not is_serving(f"127.0.0.1:{health_port}")
    finally:
        other.stop()


def test_sighup_reloads_the_engine_certificate_without_dropping_streams(
        secure: tuple[Secure, dict[str, int]]) -> None:
    s, ports = secure
    address = f"127.0.0.1:{ports['frontend']}"
    assert s.engine is not None and s.engine.proc is not None
    with TandemClient(address, **s.client(api_key=API_KEY)) as client:
        stream = client.generate(token_ids=[5, 6, 7], ignore_eos=True, max_tokens=150, timeout=60)
        first = next(stream)
        renewed = s.ca.issue("tandem-engine-renewed", dns_names=("tandem-engine",), ips=(), stem="engine-renewed")
        before = s.engine.log().count("TLS certificates reloaded")
        shutil.copyfile(renewed.certfile, s.live / "tls.crt")
        shutil.copyfile(renewed.keyfile, s.live / "tls.key")
        s.engine.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: s.engine.log().count("TLS certificates reloaded") > before, 15,  # type: ignore[union-attr]
                   "the engine reloaded its certificate")
        rest = list(stream)
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 150
        assert s.engine.proc.poll() is None
    # A new connection to the engine is served the renewed certificate.
    good = channel_credentials(str(s.ca.certfile), str(s.to_engine.certfile), str(s.to_engine.keyfile))
    with grpc.secure_channel(f"127.0.0.1:{ports['engine']}", good, options=ENGINE_NAME) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == SERVING
        assert _peer_common_name(f"127.0.0.1:{ports['engine']}") == "tandem-engine-renewed"


def _peer_common_name(address: str) -> str:
    """The CN of the certificate a server presents now (read with the standard ssl module)."""
    import ssl

    from cryptography import x509

    host, port = address.rsplit(":", 1)
    pem = ssl.get_server_certificate((host, int(port)))
    cert = x509.load_pem_x509_certificate(pem.encode())
    return str(cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value)
