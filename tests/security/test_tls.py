"""TLS and mutual TLS on the public API over real sockets (a real FrontendServer, a fake engine):
who gets in, health and reflection under TLS, the plaintext health-only port, and certificate rotation
without dropping open streams."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from frontend_svc.client import TandemClient, channel_credentials
from frontend_svc.config import ConfigError, FrontendConfig
from shared_runtime.security.tls import TlsFiles
from tests.security.certs import CertificateAuthority
from tests.security.secure_stack import Stack, Victim
from tests.support import LoopThread

SERVING = health_pb2.HealthCheckResponse.SERVING


def generate_code(address: str, **security: Any) -> grpc.StatusCode:
    with TandemClient(address, **security) as client:
        try:
            list(client.generate(token_ids=[5, 6], max_tokens=2, timeout=5))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def mtls(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path, pki: dict[str, Any]) -> Iterator[Stack]:
    server = pki["server"]
    stack = Stack(loop, tokenizer, tiny_model_dir, health_port=0,
                  tls=TlsFiles(str(server.certfile), str(server.keyfile), str(pki["ca"].certfile)))
    security = client_security(pki)
    credentials = channel_credentials(security["ssl_ca_certs"], security["ssl_certfile"], security["ssl_keyfile"])
    with grpc.secure_channel(stack.address, credentials) as channel:
        stack.wait_serving(channel)
    yield stack
    stack.close()


def client_security(pki: dict[str, Any], client: str | None = "client") -> dict[str, Any]:
    security: dict[str, Any] = {"ssl_ca_certs": str(pki["ca"].certfile)}
    if client is not None:
        security.update(ssl_certfile=str(pki[client].certfile), ssl_keyfile=str(pki[client].keyfile))
    return security


def test_mutual_tls_admits_only_clients_with_a_certificate_from_the_ca(mtls: Stack, pki: dict[str, Any]) -> None:
    assert generate_code(mtls.address, **client_security(pki)) == grpc.StatusCode.OK
    assert generate_code(mtls.address, **client_security(pki, None)) == grpc.StatusCode.UNAVAILABLE
    assert generate_code(mtls.address, **client_security(pki, "rogue_client")) == grpc.StatusCode.UNAVAILABLE
    assert generate_code(mtls.address) == grpc.StatusCode.UNAVAILABLE  # plaintext
    # A client that does not trust the server's CA refuses the server.
    assert generate_code(mtls.address, ssl_ca_certs=str(pki["rogue_ca"].certfile),
                         ssl_certfile=str(pki["client"].certfile),
                         ssl_keyfile=str(pki["client"].keyfile)) == grpc.StatusCode.UNAVAILABLE


def test_health_and_reflection_work_under_tls(mtls: Stack, pki: dict[str, Any]) -> None:
    security = client_security(pki)
    credentials = channel_credentials(security["ssl_ca_certs"], security["ssl_certfile"], security["ssl_keyfile"])
    with grpc.secure_channel(mtls.address, credentials) as channel:
        mtls.wait_serving(channel)
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=5)))
        assert "tandem.v1.GenerationService" in {s.name for s in answer.list_services_response.service}


def test_the_plaintext_health_port_serves_health_only(loop: LoopThread, tokenizer: Any, tiny_model_dir: Path,
                                                       pki: dict[str, Any]) -> None:
    from shared_runtime.security.listen import join_host_port
    from tests.support import free_port

    server = pki["server"]
    stack = Stack(loop, tokenizer, tiny_model_dir, health_port=free_port(),
                  tls=TlsFiles(str(server.certfile), str(server.keyfile), str(pki["ca"].certfile)))
    try:
        health_address = join_host_port("127.0.0.1", stack.frontend.health_port)
        with grpc.insecure_channel(health_address) as channel:
            stack.wait_serving(channel)  # kubelet's probes: no certificate
            liveness = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert liveness.status == SERVING
        assert generate_code(health_address) == grpc.StatusCode.UNIMPLEMENTED  # nothing else there
    finally:
        stack.close()


def test_a_rotated_certificate_reaches_new_connections_while_open_streams_keep_streaming(
        loop: LoopThread, tokenizer: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    old_ca, new_ca = CertificateAuthority(tmp_path / "old", "old-ca"), CertificateAuthority(tmp_path / "new", "new-ca")
    live = tmp_path / "live"
    live.mkdir()

    def install(ca: CertificateAuthority) -> None:  # what cert-manager does: new files in place
        issued = ca.issue("tandem-frontend")
        shutil.copyfile(issued.certfile, live / "tls.crt")
        shutil.copyfile(issued.keyfile, live / "tls.key")

    install(old_ca)
    stack = Stack(loop, tokenizer, tiny_model_dir,
                  tls=TlsFiles(str(live / "tls.crt"), str(live / "tls.key")))
    try:
        with TandemClient(stack.address, ssl_ca_certs=str(old_ca.certfile)) as client:
            stack.wait_serving(client.channel)
            victim = Victim(client.generate(token_ids=[5, 6, 7], timeout=60))  # an open stream, old cert
            victim.wait_started()
            time.sleep(0.01)  # a distinct mtime
            install(new_ca)
            assert generate_code(stack.address, ssl_ca_certs=str(new_ca.certfile)) == grpc.StatusCode.OK
            assert generate_code(stack.address, ssl_ca_certs=str(old_ca.certfile)) == grpc.StatusCode.UNAVAILABLE
            seen = len(victim.arrivals)
            time.sleep(0.3)
            assert victim.error is None and len(victim.arrivals) > seen  # still streaming on the old cert
            victim.stop()
        assert stack.frontend.tls is not None and stack.frontend.tls.num_reloads == 1
    finally:
        stack.close()


def test_reload_keeps_the_current_certificate_when_the_new_files_are_bad(
        loop: LoopThread, tokenizer: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path, "ca")
    issued = ca.issue("tandem-frontend")
    stack = Stack(loop, tokenizer, tiny_model_dir, tls=TlsFiles(str(issued.certfile), str(issued.keyfile)))
    try:
        with grpc.secure_channel(stack.address, channel_credentials(str(ca.certfile))) as channel:
            stack.wait_serving(channel)
        good_key = issued.keyfile.read_bytes()
        issued.keyfile.write_text("")  # half-written rotation
        assert stack.frontend.tls is not None and not stack.frontend.tls.reload()
        assert generate_code(stack.address, ssl_ca_certs=str(ca.certfile)) == grpc.StatusCode.OK
        issued.keyfile.write_bytes(good_key[: len(good_key) // 2])  # torn
        assert not stack.frontend.tls.reload()
        issued.keyfile.write_bytes(ca.issue("someone-else").keyfile.read_bytes())  # not this certificate's key
        assert not stack.frontend.tls.reload()
        assert stack.frontend.tls.num_reloads == 0
        assert generate_code(stack.address, ssl_ca_certs=str(ca.certfile)) == grpc.StatusCode.OK
    finally:
        stack.close()


def test_tls_flags_are_validated(tiny_model_dir: Path, pki: dict[str, Any], tmp_path: Path) -> None:
    server = pki["server"]
    with pytest.raises(ConfigError, match="--ssl-certfile and --ssl-keyfile go together"):
        FrontendConfig(model=str(tiny_model_dir), tls=TlsFiles(str(server.certfile)))
    with pytest.raises(ConfigError, match=r"--ssl-keyfile .* cannot be read"):
        FrontendConfig(model=str(tiny_model_dir), tls=TlsFiles(str(server.certfile), str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="--engine-ssl-certfile and --engine-ssl-keyfile go together"):
        FrontendConfig(model=str(tiny_model_dir),
                       engine_tls=TlsFiles(certfile=str(server.certfile), prefix="--engine-ssl"))
    with pytest.raises(ConfigError, match="--engine-ssl-server-name needs TLS to the engines"):
        FrontendConfig(model=str(tiny_model_dir), engine_ssl_server_name="tandem-engine")


def test_tandem_generate_talks_to_a_mutual_tls_frontend(mtls: Stack, pki: dict[str, Any],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from entrypoints import generate as generate_cli

    security = client_security(pki)
    argv = ["hello there", "--server", mtls.address, "--max-tokens", "3", "--timeout", "10",
            "--ssl-ca-certs", security["ssl_ca_certs"], "--ssl-certfile", security["ssl_certfile"],
            "--ssl-keyfile", security["ssl_keyfile"]]
    assert generate_cli.main(argv) == 0
    assert "3 tokens" in capsys.readouterr().err
    assert generate_cli.main(argv[:7]) == 1  # no certificate: refused
