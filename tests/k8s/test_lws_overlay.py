"""k8s/overlays/gpu-multinode: one engine over two pods as a LeaderWorkerSet.

What is validated, and how: every native object strictly with kubernetes-validate (as the other overlays);
the LeaderWorkerSet's own fields against the schema of the LWS CRD (vendored, trimmed, under schemas/:
kubernetes-validate knows no CRDs), made strict (unknown fields rejected); its leader and worker pod
templates strictly as core PodTemplates. Not validated offline: what the LWS controller and its webhook
do at admission (defaulting, the env vars it injects, which the tests supply as LWS documents them).
Semantics: the leader is node 0 of `tandem-engine` with the gpu overlay's serving args, the worker is
`--headless` with the LWS env vars mapped to --nnodes/--node-rank/--master-addr, both parse with the
engine's own parser and carry equal fingerprints (the join check would welcome them), the GPUs add up,
only leaders are behind the engine Service, and the group's pods may reach each other.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.test_manifests import (
    K8S_VERSION,
    by_kind,
    container_env,
    expand,
    labels_match,
    render,
    resolved_args,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

OVERLAY = "overlays/gpu-multinode"
LWS_SCHEMA = Path(__file__).with_name("schemas") / "leaderworkerset-v1.json"
LEADER_ADDRESS = "tandem-engine-0.tandem-engine.test-ns"  # what LWS injects: the leader pod's DNS name


def strict(schema: Any) -> Any:
    """The schema with unknown fields rejected wherever it lists properties (as the API server's pruning
    would drop them silently, and kubernetes-validate's strict mode refuses them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def lws_errors(doc: dict[str, Any]) -> list[str]:
    vendored = json.loads(LWS_SCHEMA.read_text())
    assert doc["apiVersion"] == f"{vendored['group']}/{vendored['version']}" and doc["kind"] == vendored["kind"]
    validator = jsonschema.Draft7Validator(strict(vendored["schema"]))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


def lws() -> dict[str, Any]:
    return by_kind(render(OVERLAY), "LeaderWorkerSet")["tandem-engine"]


def template(role: str) -> dict[str, Any]:
    return lws()["spec"]["leaderWorkerTemplate"][f"{role}Template"]


def pod_args(role: str, worker_index: int) -> list[str]:
    """The engine container's args as the kubelet expands them, with the env LWS injects."""
    docs = render(OVERLAY)
    spec = template(role)["spec"]
    container = spec["containers"][0]
    env = {**container_env(container, docs), "LWS_LEADER_ADDRESS": LEADER_ADDRESS,
           "LWS_GROUP_SIZE": str(lws()["spec"]["leaderWorkerTemplate"]["size"]),
           "LWS_WORKER_INDEX": str(worker_index)}
    return [expand(arg, env) for arg in container["args"]]


def parse(args: list[str]) -> Any:
    from engine_svc.cli import build_parser

    return build_parser().parse_args(args)


def test_native_objects_validate_strictly_and_replace_the_engine_deployment() -> None:
    docs = render(OVERLAY)
    for doc in docs:
        if doc["kind"] != "LeaderWorkerSet":
            assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert "tandem-engine" not in by_kind(docs, "Deployment"), "the LeaderWorkerSet replaces the engine Deployment"


def test_the_leaderworkerset_validates_against_the_vendored_crd_schema_and_its_pods_as_core_pods() -> None:
    doc = lws()
    assert lws_errors(doc) == []
    for role in ("leader", "worker"):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role},
                        "template": template(role)}
        assert kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
    broken = copy.deepcopy(doc)
    broken["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    broken["spec"]["leaderWorkerTemplate"]["sizes"] = 2
    errors = lws_errors(broken)
    assert any("Sometimes" in e for e in errors) and any("sizes" in e for e in errors), errors
    bad_pod = copy.deepcopy(template("worker"))
    bad_pod["spec"]["containers"][0]["argz"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"},
                                      "template": bad_pod}, K8S_VERSION, strict=True)


def test_the_leader_is_node_0_serving_as_the_gpu_overlay_does() -> None:
    args = pod_args("leader", 0)
    leader = parse(args)
    assert not leader.headless
    assert (leader.nnodes, leader.node_rank, leader.master_addr, leader.master_port) == (2, 0, LEADER_ADDRESS, 29500)
    varying = ("--nnodes=", "--node-rank=", "--master-addr=", "--master-port=", "--tensor-parallel-size=",
               "--pipeline-parallel-size=")
    gpu = render("overlays/gpu")
    serving = resolved_args(by_kind(gpu, "Deployment")["tandem-engine"], gpu)
    assert [a for a in args if not a.startswith(varying)] == [a for a in serving if not a.startswith(varying)]


def test_the_worker_is_headless_with_the_leaders_fingerprint() -> None:
    from engine_svc.config import EngineConfig
    from engine_svc.executor.fingerprint import FINGERPRINT_FIELDS

    leader, worker = parse(pod_args("leader", 0)), parse(pod_args("worker", 1))
    assert worker.headless and worker.node_rank == 1 and worker.master_addr == LEADER_ADDRESS
    assert parse(pod_args("worker", 7)).node_rank == 7, "--node-rank follows LWS_WORKER_INDEX"
    for name in FINGERPRINT_FIELDS:
        assert getattr(worker, name, None) == getattr(leader, name, None), name
    config = EngineConfig(**{n: getattr(leader, n) for n in ("model", "tensor_parallel_size", "pipeline_parallel_size",
                                                              "nnodes", "master_port")})
    gpus = int(template("worker")["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert config.world_size == config.nnodes * gpus, "TP x PP must equal the group's GPUs"
    assert int(template("leader")["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    assert "readinessProbe" not in template("worker")["spec"]["containers"][0], "a headless pod serves nothing"


def test_only_leaders_are_behind_the_engine_service_and_the_group_reaches_itself() -> None:
    docs = render(OVERLAY)
    leader, worker = (template(r)["metadata"]["labels"] for r in ("leader", "worker"))
    service = by_kind(docs, "Service")["tandem-engine"]
    assert labels_match({"matchLabels": service["spec"]["selector"]}, leader)
    assert not labels_match({"matchLabels": service["spec"]["selector"]}, worker)
    group = by_kind(docs, "NetworkPolicy")["tandem-engine-group"]
    assert labels_match(group["spec"]["podSelector"], leader) and labels_match(group["spec"]["podSelector"], worker)
    peers = group["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert labels_match(peers, leader) and labels_match(peers, worker)
    assert lws()["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
