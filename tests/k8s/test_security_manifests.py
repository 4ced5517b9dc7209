"""The security side of the manifests (docs/security.md): NetworkPolicies, Secrets (never ConfigMaps), the
engine bound to its pod IP, and the mutual-TLS component (k8s/extras/mtls, rendered as k8s/overlays/gpu-mtls)
wired end to end: certificates -> Secrets -> mounts -> flags -> probes."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.k8s.test_manifests import (
    ENGINE_FLAGS,
    FRONTEND_FLAGS,
    K8S_VERSION,
    KUSTOMIZATIONS,
    MIN_K8S_VERSION,
    by_kind,
    component,
    container_port,
    deployment_flags,
    labels_match,
    main_container,
    render,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

MTLS = "overlays/gpu-mtls"
CERT_MANAGER_KINDS = {"Certificate", "Issuer"}
SECRET_WORDS = re.compile(r"(token(?!s)|secret|password|passwd|api[_-]?key|private[_-]?key)", re.IGNORECASE)


def deployment(docs: list[dict[str, Any]], comp: str) -> dict[str, Any]:
    return next(d for d in by_kind(docs, "Deployment").values() if component(d) == comp)


def secret_mounts(deploy: dict[str, Any]) -> dict[str, str]:
    """mountPath -> Secret name, for the main container's Secret volumes."""
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    out = {}
    for mount in main_container(deploy)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "secret" in volume:
            assert mount.get("readOnly") is True, f"{mount['mountPath']} must be read-only"
            out[mount["mountPath"]] = volume["secret"]["secretName"]
    return out


def secret_of_file(deploy: dict[str, Any], path: str) -> str:
    """The Secret a file path lies in (fails when it is not in a Secret volume)."""
    for mount_path, secret in secret_mounts(deploy).items():
        if path.startswith(mount_path.rstrip("/") + "/"):
            return secret
    raise AssertionError(f"{path} is not in a Secret volume of {deploy['metadata']['name']}")


def test_the_flag_lists_are_the_services_own_flags() -> None:
    """test_manifests' accepted-flag lists must not drift from the real command lines."""
    from engine_svc.cli import build_parser as engine_parser
    from frontend_svc.cli import build_parser as frontend_parser

    def options(parser: Any) -> set[str]:
        return {o[2:] for action in parser._actions for o in action.option_strings if o.startswith("--")}

    assert options(engine_parser()) >= ENGINE_FLAGS
    assert options(frontend_parser()) >= FRONTEND_FLAGS


@pytest.mark.parametrize("name", [*KUSTOMIZATIONS, MTLS])
def test_only_frontends_reach_the_engine_and_only_monitoring_the_metrics(name: str) -> None:
    docs = render(name)
    policies = by_kind(docs, "NetworkPolicy")
    assert set(policies) == {"tandem-engine", "tandem-frontend"}
    frontend_labels = deployment(docs, "frontend")["spec"]["template"]["metadata"]["labels"]
    for comp in ("engine", "frontend"):
        deploy = deployment(docs, comp)
        policy = policies[f"tandem-{comp}"]["spec"]
        assert labels_match(policy["podSelector"], deploy["spec"]["template"]["metadata"]["labels"])
        assert policy["policyTypes"] == ["Ingress"]
        container = main_container(deploy)
        by_port: dict[str, list[Any]] = {}
        for rule in policy["ingress"]:
            for port in rule["ports"]:
                container_port(container, port["port"])  # a named port the container has
                by_port.setdefault(port["port"], []).append(rule.get("from"))
        assert by_port["metrics"] == [[{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]]
        if comp == "engine":
            [peers] = by_port["grpc"]
            assert peers is not None and len(peers) == 1 and set(peers[0]) == {"podSelector"}
            assert labels_match(peers[0]["podSelector"], frontend_labels)
            assert set(by_port) <= {"grpc", "metrics", "health"}


@pytest.mark.parametrize("name", [*KUSTOMIZATIONS, MTLS])
def test_secrets_come_from_secrets_never_configmaps(name: str) -> None:
    docs = render(name)
    for configmap in by_kind(docs, "ConfigMap").values():
        for key, value in configmap.get("data", {}).items():
            assert not SECRET_WORDS.search(key), f"ConfigMap {configmap['metadata']['name']} holds {key}"
            assert not SECRET_WORDS.search(str(value)), f"ConfigMap {configmap['metadata']['name']}: {key}"
    assert not by_kind(docs, "Secret"), "Secrets are created by the operator or cert-manager, not committed"
    engine, frontend = deployment(docs, "engine"), deployment(docs, "frontend")
    engine_flags, frontend_flags = deployment_flags(docs, "engine"), deployment_flags(docs, "frontend")
    token = secret_of_file(engine, engine_flags["engine-token-file"] or "")
    assert secret_of_file(frontend, frontend_flags["engine-token-file"] or "") == token == "tandem-engine-token"
    assert secret_of_file(frontend, frontend_flags["api-key-file"] or "") == "tandem-api-keys"
    for deploy in (engine, frontend):
        args = " ".join(main_container(deploy)["args"])
        assert "--api-key=" not in args, "keys never on the command line (visible in the pod spec)"


@pytest.mark.parametrize("name", [*KUSTOMIZATIONS, MTLS])
def test_the_engine_listens_on_its_pod_ip(name: str) -> None:
    docs = render(name)
    container = main_container(deployment(docs, "engine"))
    assert "--host=$(POD_IP)" in container["args"]
    pod_ip = next(v for v in container["env"] if v["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


# ---- mutual TLS between the tiers ----------------------------------------------------------------------


@pytest.mark.parametrize("version", [K8S_VERSION, MIN_K8S_VERSION])
def test_mtls_overlay_native_objects_validate_strictly(version: str) -> None:
    docs = render(MTLS)
    assert {d["kind"] for d in docs} >= CERT_MANAGER_KINDS
    for doc in docs:
        if doc["kind"] in CERT_MANAGER_KINDS:
            assert doc["apiVersion"] == "cert-manager.io/v1"
            continue
        assert kubernetes_validate.validate(doc, version, strict=True) == version.rsplit(".", 1)[0]


def test_mtls_certificates_reach_the_flags_of_both_tiers() -> None:
    docs = render(MTLS)
    certificates = {c["spec"]["secretName"]: c["spec"] for c in by_kind(docs, "Certificate").values()}
    issuers = by_kind(docs, "Issuer")
    engine, frontend = deployment(docs, "engine"), deployment(docs, "frontend")
    engine_flags, frontend_flags = deployment_flags(docs, "engine"), deployment_flags(docs, "frontend")

    server_secret = secret_of_file(engine, engine_flags["ssl-certfile"] or "")
    assert secret_of_file(engine, engine_flags["ssl-keyfile"] or "") == server_secret
    assert secret_of_file(engine, engine_flags["ssl-ca-certs"] or "") == server_secret  # CA given: mTLS
    server = certificates[server_secret]
    assert "server auth" in server["usages"]
    assert frontend_flags["engine-ssl-server-name"] in server["dnsNames"]

    client_secret = secret_of_file(frontend, frontend_flags["engine-ssl-certfile"] or "")
    assert secret_of_file(frontend, frontend_flags["engine-ssl-keyfile"] or "") == client_secret
    assert secret_of_file(frontend, frontend_flags["engine-ssl-ca-certs"] or "") == client_secret
    client = certificates[client_secret]
    assert "client auth" in client["usages"]

    assert server["issuerRef"] == client["issuerRef"], "one CA for both tiers"
    ca_issuer = issuers[server["issuerRef"]["name"]]["spec"]["ca"]
    assert certificates[ca_issuer["secretName"]]["isCA"] is True
    for spec in (server, client):
        assert spec["privateKey"]["rotationPolicy"] == "Always"
        assert spec["renewBefore"] < spec["duration"]


def test_mtls_probes_use_the_plaintext_health_port() -> None:
    docs = render(MTLS)
    engine = main_container(deployment(docs, "engine"))
    health_port = int(deployment_flags(docs, "engine")["health-port"] or 0)
    assert health_port and container_port(engine, "health") == health_port
    assert health_port != container_port(engine, "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["grpc"]["port"] == health_port
    assert engine["livenessProbe"]["grpc"]["service"] == "liveness"
    mounts = secret_mounts(deployment(docs, "engine"))
    assert "tandem-engine-token" in mounts.values() and "tandem-engine-tls" in mounts.values()
