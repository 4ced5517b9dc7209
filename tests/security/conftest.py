"""Security test fixtures: throw-away certificates (the tokenizer and the loop thread are tests/conftest.py's)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.security.certs import CertificateAuthority


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two CAs; server and client certificates from the first, a rogue client certificate from the second."""
    root = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(root, "tandem-ca"), CertificateAuthority(root, "rogue-ca")
    return {
        "ca": ca, "rogue_ca": rogue,
        "server": ca.issue("tandem-server", dns_names=("localhost", "tandem-engine.ns.svc.cluster.local")),
        "client": ca.issue("tandem-frontend", client=True, dns_names=(), ips=()),
        "rogue_client": rogue.issue("intruder", client=True, dns_names=(), ips=()),
    }
