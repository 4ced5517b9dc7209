"""Prefill/decode disaggregation locked down: engines with mutual TLS and an engine token pull K/V from each
other over TLS. Each engine presents its own certificate (server and client usage, naming the engines'
Service, not an address) to the producer it pulls from, verified against `kv_ssl_server_name`, with the
engine token. A frontend (mTLS and the token towards the engines, `--routing pd`) sends requests through
both: the consumer pulled every prompt's blocks (no pull failed, nothing was recomputed), and the tokens
are the ones the producer alone gives."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frontend_svc.client import TandemClient, collect
from tests.e2e.conftest import ENGINE_FLAGS
from tests.security.certs import CertificateAuthority
from tests.support import Service, free_port, metric_value, wait_until

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
PROMPTS = [[1, *range(50 + 9 * i, 90 + 9 * i)] for i in range(3)]  # 41 tokens: two full blocks each


class LockedPd:
    def __init__(self, model: Path, root: Path) -> None:
        ca = CertificateAuthority(root / "pki", "tandem-ca")
        engine_cert = ca.issue("tandem-engine", dns_names=("tandem-engine",), ips=(), stem="engine",
                               server_and_client=True)
        to_engine = ca.issue("frontend-to-engine", client=True, dns_names=(), ips=(), stem="to-engine")
        token = root / "engine-token"
        token.write_text("tok-pd-1618\n")
        self.consumer_metrics = free_port()
        self.services: list[Service] = []

        def engine(role: str, *flags: str) -> tuple[Service, str]:
            port, health = free_port(), free_port()
            kv = json.dumps({"kv_connector": "GrpcConnector", "kv_role": role, "kv_ssl_server_name": "tandem-engine"})
            argv = [sys.executable, "-m", "engine_svc.cli", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(port), *ENGINE_FLAGS, "--health-port", str(health), "--kv-transfer-config", kv,
                    "--ssl-certfile", str(engine_cert.certfile), "--ssl-keyfile", str(engine_cert.keyfile),
                    "--ssl-ca-certs", str(ca.certfile), "--engine-token-file", str(token), *flags]
            return Service("engine", argv, port, root), f"127.0.0.1:{health}"

        def frontend(engines: list[Service], routing: str) -> tuple[Service, str]:
            port, health = free_port(), free_port()
            argv = [sys.executable, "-m", "frontend_svc.cli", "--model", str(model),
                    "--engine", ",".join(e.address for e in engines), "--host", "127.0.0.1", "--port", str(port),
                    "--health-port", str(health), "--metrics-port", "0", "--routing", routing,
                    "--engine-ssl-ca-certs", str(ca.certfile), "--engine-ssl-certfile", str(to_engine.certfile),
                    "--engine-ssl-keyfile", str(to_engine.keyfile), "--engine-ssl-server-name", "tandem-engine",
                    "--engine-token-file", str(token)]
            return Service("frontend", argv, port, root), f"127.0.0.1:{health}"

        # No prefix cache on the producer: the oracle's runs there must not warm the disaggregated prefills.
        self.producer, producer_health = engine("kv_producer", "--no-enable-prefix-caching")
        self.consumer, consumer_health = engine("kv_consumer", "--metrics-port", str(self.consumer_metrics))
        for service, health in ((self.producer, producer_health), (self.consumer, consumer_health)):
            self.services.append(service.start())
            service.wait_serving(health_address=health)
        self.pd, pd_health = frontend([self.producer, self.consumer], "pd")
        self.alone, alone_health = frontend([self.producer], "least-load")
        for service, health in ((self.pd, pd_health), (self.alone, alone_health)):
            self.services.append(service.start())
            service.wait_serving(health_address=health)

    def counter(self, name: str) -> float:
        return metric_value(self.consumer_metrics, name)

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop()


@pytest.fixture(scope="module")
def locked(make_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LockedPd]:
    cluster = LockedPd(make_model("llama"), tmp_path_factory.mktemp("pd-tls"))
    try:
        yield cluster
    finally:
        cluster.close()


def test_engines_pull_kv_from_each_other_over_mutual_tls(locked: LockedPd) -> None:
    def run(address: str) -> list[list[int]]:
        with TandemClient(address) as client:
            return [collect(client.generate(token_ids=p, timeout=60, **GREEDY))[0]["token_ids"] for p in PROMPTS]

    alone = run(locked.alone.address)
    wait_until(lambda: TandemClient(locked.pd.address).model_info(timeout=5).num_ready_engines == 2, 30,
               "the P/D frontend sees both engines")
    disaggregated = run(locked.pd.address)
    assert disaggregated == alone
    assert locked.counter("tandem_kv_transfer_pull_failures_total") == 0
    assert locked.counter("tandem_kv_transfer_blocks_pulled_total") >= 2 * len(PROMPTS)
