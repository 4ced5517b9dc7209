"""Offline checks of the Kubernetes manifests: schema validation plus the semantics that matter.

Every kustomization (base, each overlay, extras) is rendered with `kubectl kustomize` and
validated in strict mode against a fixed Kubernetes version using the schemas bundled with
kubernetes-validate (no network). The semantic tests resolve container args the way the kubelet
does (``$(VAR)`` from env / envFrom ConfigMaps) and check drain timings, probes, ports, selectors
and that every flag is one the services accept.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
K8S_VERSION = "1.30.0"
MIN_K8S_VERSION = "1.27.0"  # gRPC probes are GA from 1.27
KUSTOMIZATIONS = ["base", "overlays/gpu", "overlays/cpu-dev"]
# Engines behind SMG run without the engine token (SMG sends no gRPC credentials), against the security rules
# the KUSTOMIZATIONS are held to: validated on its own, and by its own test below.
SMG_OVERLAY = "overlays/gpu-smg"
# Two engine Deployments (the P/D pools): validated on its own, and by its own test below.
PD_OVERLAY = "overlays/gpu-pd"
OVERLAYS = ["overlays/gpu", "overlays/cpu-dev"]
CRD_KINDS = {"ScaledObject", "ServiceMonitor"}  # third-party kinds kept out of validated sets

ENGINE_SERVICE = "tandem.engine.v1.EngineCoreService"
FRONTEND_SERVICE = "tandem.v1.GenerationService"
LIVENESS_SERVICE = "liveness"
DEFAULT_DRAIN_S = 45
BUFFER_S = 10
NAMESPACE_PLACEHOLDER = "test-ns"

ENGINE_FLAGS = {
    "model", "dtype", "device", "tensor-parallel-size", "pipeline-parallel-size", "block-size", "max-num-seqs",
    "max-num-batched-tokens", "max-model-len", "gpu-memory-utilization", "kv-cache-memory-bytes",
    "num-gpu-blocks-override", "enable-prefix-caching", "no-enable-prefix-caching",
    "scheduling-policy", "attention-backend", "enforce-eager", "seed", "host", "port",
    "metrics-port", "max-waiting", "drain-grace-period",
    "engine-token-file", "ssl-certfile", "ssl-keyfile", "ssl-ca-certs", "health-port",
}  # fmt: skip
FRONTEND_FLAGS = {
    "model", "engine", "host", "port", "metrics-port", "max-concurrent-requests", "routing", "cache-threshold",
    "balance-abs-threshold", "balance-rel-threshold", "tokenizer-fetch-timeout",
    "engine-token-file", "api-key-file", "ssl-certfile", "ssl-keyfile", "ssl-ca-certs", "health-port",
    "engine-ssl-certfile", "engine-ssl-keyfile", "engine-ssl-ca-certs", "engine-ssl-server-name",
}  # fmt: skip
BOOLEAN_FLAGS = {"enable-prefix-caching", "no-enable-prefix-caching", "enforce-eager"}


KUBECTL = shutil.which("kubectl")
KUBECTL_MISSING = (
    "kubectl is not installed: the k8s tests render every kustomization with `kubectl kustomize` "
    "(install kubectl >= 1.27; it bundles kustomize)"
)


@functools.cache
def _render_cached(name: str) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.fail(KUBECTL_MISSING, pytrace=False)
    done = subprocess.run([KUBECTL, "kustomize", str(K8S / name)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize k8s/{name} failed:\n{done.stderr}"
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def render(name: str) -> list[dict[str, Any]]:
    """Rendered documents of k8s/<name> (a fresh copy; tests may not share mutations)."""
    return copy.deepcopy(_render_cached(name))


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def component(deploy: dict[str, Any]) -> str:
    return deploy["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def main_container(deploy: dict[str, Any]) -> dict[str, Any]:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one serving container per pod"
    return containers[0]


def all_containers(deploy: dict[str, Any]) -> list[dict[str, Any]]:
    spec = deploy["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def container_env(container: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it (envFrom first, then env in order)."""
    configmaps = by_kind(docs, "ConfigMap")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        assert name in configmaps, f"envFrom references missing ConfigMap {name}"
        env.update({k: str(v) for k, v in configmaps[name]["data"].items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = NAMESPACE_PLACEHOLDER
        else:
            env[var["name"]] = "<from-" + next(iter(var["valueFrom"])) + ">"
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: defined variables are replaced, others left verbatim."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def resolved_args(deploy: dict[str, Any], docs: list[dict[str, Any]]) -> list[str]:
    container = main_container(deploy)
    env = container_env(container, docs)
    return [expand(arg, env) for arg in container.get("args", [])]


def parse_flags(args: list[str]) -> dict[str, str | None]:
    """``--name=value`` / ``--name`` tokens into a dict; anything else is a test failure."""
    flags: dict[str, str | None] = {}
    for arg in args:
        assert arg.startswith("--"), f"positional or unexpanded argument {arg!r}"
        name, sep, value = arg[2:].partition("=")
        assert name not in flags, f"flag --{name} given twice"
        flags[name] = value if sep else None
    return flags


def deployment_flags(docs: list[dict[str, Any]], comp: str) -> dict[str, str | None]:
    deploy = next(d for d in by_kind(docs, "Deployment").values() if component(d) == comp)
    return parse_flags(resolved_args(deploy, docs))


def container_port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def pre_stop_seconds(container: dict[str, Any]) -> int:
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are used"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


# ---------------------------------------------------------------------------------------------
# Schema validation


def test_bundled_schema_version_is_available_offline() -> None:
    assert {K8S_VERSION, MIN_K8S_VERSION} <= set(kubernetes_validate.utils.all_versions())


@pytest.mark.parametrize("version", [K8S_VERSION, MIN_K8S_VERSION])
@pytest.mark.parametrize("name", [*KUSTOMIZATIONS, SMG_OVERLAY, PD_OVERLAY, "extras"])
def test_rendered_documents_validate_strictly(name: str, version: str) -> None:
    docs = render(name)
    assert docs
    for doc in docs:
        assert doc["kind"] not in CRD_KINDS, f"CRD {doc['kind']} must stay out of {name}"
        assert kubernetes_validate.validate(doc, version, strict=True) == version.rsplit(".", 1)[0]


def test_strict_validation_rejects_unknown_fields() -> None:
    deploy = by_kind(render("base"), "Deployment")["tandem-engine"]
    main_container(deploy)["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSION, strict=True)


def test_extras_outside_the_kustomization_are_crds_or_valid_native_objects() -> None:
    listed = set(yaml.safe_load((K8S / "extras" / "kustomization.yaml").read_text()).get("resources", []))
    seen_crds = set()
    for path in sorted((K8S / "extras").glob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name in listed:
            continue
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            if doc["kind"] in CRD_KINDS:
                seen_crds.add(doc["kind"])
            else:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert seen_crds == CRD_KINDS


# ---------------------------------------------------------------------------------------------
# Drain timings and probes


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_termination_grace_covers_pre_stop_and_drain(name: str) -> None:
    docs = render(name)
    drain = int(deployment_flags(docs, "engine")["drain-grace-period"] or 0)
    assert drain == DEFAULT_DRAIN_S
    for deploy in by_kind(docs, "Deployment").values():
        grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= pre_stop_seconds(main_container(deploy)) + drain + BUFFER_S
        assert pre_stop_seconds(main_container(deploy)) >= 5, "endpoints need time to drop the pod"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_probes_are_grpc_with_the_right_service_names(name: str) -> None:
    docs = render(name)
    expected = {"engine": ENGINE_SERVICE, "frontend": FRONTEND_SERVICE}
    for deploy in by_kind(docs, "Deployment").values():
        container = main_container(deploy)
        grpc_port = container_port(container, "grpc")
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[probe_name]
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}
            assert probe["grpc"]["port"] == grpc_port
        assert container["startupProbe"]["grpc"]["service"] == expected[component(deploy)]
        assert container["readinessProbe"]["grpc"]["service"] == expected[component(deploy)]
        assert container["livenessProbe"]["grpc"]["service"] == LIVENESS_SERVICE


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_engine_startup_probe_allows_a_slow_model_load(name: str) -> None:
    engine = by_kind(render(name), "Deployment")["tandem-engine"]
    startup = main_container(engine)["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600


# ---------------------------------------------------------------------------------------------
# Services, ports, selectors


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_engine_service_is_headless_and_publishes_only_ready_pods(name: str) -> None:
    svc = by_kind(render(name), "Service")["tandem-engine"]
    assert svc["spec"]["clusterIP"] == "None"
    assert not svc["spec"].get("publishNotReadyAddresses", False)
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "metrics": 9091}
    frontend = by_kind(render(name), "Service")["tandem-frontend"]
    assert frontend["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {p["name"]: p["port"] for p in frontend["spec"]["ports"]} == {"grpc": 50050, "metrics": 9090}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_service_ports_match_container_ports_and_flags(name: str) -> None:
    docs = render(name)
    deployments = list(by_kind(docs, "Deployment").values())
    for svc in by_kind(docs, "Service").values():
        selected = [
            d
            for d in deployments
            if labels_match(
                {"matchLabels": svc["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"]
            )
        ]
        assert len(selected) == 1, f"service {svc['metadata']['name']} selects {len(selected)} deployments"
        container = main_container(selected[0])
        flags = parse_flags(resolved_args(selected[0], docs))
        for port in svc["spec"]["ports"]:
            assert container_port(container, port["targetPort"]) == port["port"]
        assert int(flags["port"] or 0) == container_port(container, "grpc")
        assert int(flags["metrics-port"] or 0) == container_port(container, "metrics")
        annotations = selected[0]["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == container_port(container, "metrics")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pdbs_and_deployment_selectors_select_existing_pods(name: str) -> None:
    docs = render(name)
    deployments = list(by_kind(docs, "Deployment").values())
    for deploy in deployments:
        assert labels_match(deploy["spec"]["selector"], deploy["spec"]["template"]["metadata"]["labels"])
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert len(pdbs) == 2
    for pdb in pdbs.values():
        selected = [
            d
            for d in deployments
            if labels_match(pdb["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        assert len(selected) == 1, f"PDB {pdb['metadata']['name']} must select exactly one workload"
        assert pdb["spec"].get("maxUnavailable") == 1, "a 1-replica workload must not block node drains"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_hpa_targets_the_frontend_deployment_on_cpu(name: str) -> None:
    docs = render(name)
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    assert list(hpas) == ["tandem-frontend"]
    spec = hpas["tandem-frontend"]["spec"]
    target = spec["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    deploy = by_kind(docs, "Deployment")[target["name"]]
    assert component(deploy) == "frontend"
    assert [m["resource"]["name"] for m in spec["metrics"]] == ["cpu"]
    assert main_container(deploy)["resources"]["requests"]["cpu"], "utilisation needs a CPU request"
    assert 1 <= spec["minReplicas"] <= spec["maxReplicas"]


def test_queue_depth_hpa_in_extras_targets_the_engine_deployment() -> None:
    hpa = by_kind(render("extras"), "HorizontalPodAutoscaler")["tandem-engine-queue"]
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment"
    assert component(by_kind(render("overlays/gpu"), "Deployment")[target["name"]]) == "engine"
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "tandem_num_requests_waiting"


# ---------------------------------------------------------------------------------------------
# Flags


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_flag_is_one_the_service_accepts(name: str) -> None:
    docs = render(name)
    for comp, known in (("engine", ENGINE_FLAGS), ("frontend", FRONTEND_FLAGS)):
        flags = deployment_flags(docs, comp)
        assert set(flags) <= known, f"{comp}: unknown flags {set(flags) - known}"
        for flag, value in flags.items():
            assert (value is None) == (flag in BOOLEAN_FLAGS), f"--{flag} value {value!r}"
            assert value is None or "$(" not in value, f"unresolved variable in --{flag}={value}"
    assert "model" in deployment_flags(docs, "engine")
    assert "model" not in deployment_flags(docs, "frontend"), "frontends fetch the tokenizer from the engines"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_flag_configmap_key_is_used(name: str) -> None:
    """A misspelt key in an overlay's ConfigMap patch would otherwise be silently ignored."""
    docs = render(name)
    for deploy in by_kind(docs, "Deployment").values():
        container = main_container(deploy)
        args = " ".join(container["args"])
        for source in container["envFrom"]:
            data = by_kind(docs, "ConfigMap")[source["configMapRef"]["name"]]["data"]
            for key in data:
                if "_ARG_" in key:
                    assert f"$({key})" in args, f"{key} is not referenced by {deploy['metadata']['name']}"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_frontend_resolves_every_engine_through_the_headless_service(name: str) -> None:
    docs = render(name)
    target = deployment_flags(docs, "frontend")["engine"] or ""
    match = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", target)
    assert match, target
    svc = by_kind(docs, "Service")[match.group(1)]
    assert match.group(2) == NAMESPACE_PLACEHOLDER, "namespace must come from the downward API"
    assert svc["spec"]["clusterIP"] == "None"
    assert int(match.group(3)) == next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")


def test_gpu_overlay_flags() -> None:
    flags = deployment_flags(render("overlays/gpu"), "engine")
    assert (flags["device"], flags["dtype"], flags["attention-backend"]) == ("cuda", "bfloat16", "triton")
    assert 0 < float(flags["gpu-memory-utilization"] or 0) < 1


def test_cpu_dev_overlay_flags_and_single_replicas() -> None:
    docs = render("overlays/cpu-dev")
    flags = deployment_flags(docs, "engine")
    assert (flags["device"], flags["dtype"], flags["attention-backend"]) == ("cpu", "float32", "torch")
    assert "gpu-memory-utilization" not in flags
    assert all(d["spec"]["replicas"] == 1 for d in by_kind(docs, "Deployment").values())
    assert by_kind(docs, "HorizontalPodAutoscaler")["tandem-frontend"]["spec"]["minReplicas"] == 1


def test_cpu_dev_init_container_writes_the_model_the_engine_reads() -> None:
    docs = render("overlays/cpu-dev")
    deploy = next(d for d in by_kind(docs, "Deployment").values() if component(d) == "engine")
    (init,) = deploy["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["tandem"] and init["args"][0] == "make-tiny-model"
    model_dir = init["args"][1]
    assert deployment_flags(docs, "engine")["model"] == model_dir
    writer = next(m for m in init["volumeMounts"] if model_dir.startswith(m["mountPath"] + "/"))
    reader = next(m for m in main_container(deploy)["volumeMounts"] if m["name"] == writer["name"])
    assert not writer.get("readOnly") and model_dir.startswith(reader["mountPath"] + "/")
    assert "--seed" in init["args"], "every engine replica must generate the same model and tokenizer"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_frontend_mounts_no_model_and_routes_by_cache(name: str) -> None:
    docs = render(name)
    frontend = next(d for d in by_kind(docs, "Deployment").values() if component(d) == "frontend")
    spec = frontend["spec"]["template"]["spec"]
    assert "model" not in {v["name"] for v in spec["volumes"]} and not spec.get("initContainers")
    assert all("model" not in m["mountPath"] for c in all_containers(frontend) for m in c.get("volumeMounts", []))
    assert deployment_flags(docs, "frontend")["routing"] == "cache-aware"


# ---------------------------------------------------------------------------------------------
# Resources and security


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_engine_has_a_memory_backed_dev_shm(name: str) -> None:
    spec = by_kind(render(name), "Deployment")["tandem-engine"]["spec"]["template"]["spec"]
    mount = next(
        m
        for m in main_container({"spec": {"template": {"spec": spec}}})["volumeMounts"]
        if m["mountPath"] == "/dev/shm"
    )
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert set(volume) == {"name", "emptyDir"}
    assert volume["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_gpu_limit_only_in_the_gpu_overlay(name: str) -> None:
    docs = render(name)
    for deploy in by_kind(docs, "Deployment").values():
        for container in all_containers(deploy):
            limits = container.get("resources", {}).get("limits", {})
            requests = container.get("resources", {}).get("requests", {})
            wants_gpu = name == "overlays/gpu" and container["name"] == "engine"
            assert ("nvidia.com/gpu" in limits) == wants_gpu, (name, container["name"])
            assert "nvidia.com/gpu" not in requests
            if wants_gpu:
                tp = int(deployment_flags(docs, "engine")["tensor-parallel-size"] or 0)
                assert int(limits["nvidia.com/gpu"]) == tp == 1
                pod = deploy["spec"]["template"]["spec"]
                assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_container_has_memory_limits_and_requests(name: str) -> None:
    for deploy in by_kind(render(name), "Deployment").values():
        for container in all_containers(deploy):
            assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
            assert container["resources"]["limits"]["memory"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pods_run_non_root_without_privilege_escalation(name: str) -> None:
    for deploy in by_kind(render(name), "Deployment").values():
        pod = deploy["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for container in all_containers(deploy):
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx.get("privileged", False) is False
            assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add")
            assert ctx["readOnlyRootFilesystem"] is True
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert "/tmp" in mounts and "/home/tandem/.cache" in mounts, "writable dirs on a read-only root"


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlays_pin_image_tags(name: str) -> None:
    for deploy in by_kind(render(name), "Deployment").values():
        for container in all_containers(deploy):
            assert not container["image"].endswith(":latest"), container["image"]


def test_gpu_overlay_mounts_the_model_pvc_read_only_in_the_engines() -> None:
    docs = render("overlays/gpu")
    pvc = by_kind(docs, "PersistentVolumeClaim")
    for deploy in by_kind(docs, "Deployment").values():
        if component(deploy) != "engine":
            continue
        model = next(v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
        assert set(model) == {"name", "persistentVolumeClaim"}
        assert model["persistentVolumeClaim"]["claimName"] in pvc
        assert model["persistentVolumeClaim"]["readOnly"] is True


def test_smg_overlay_puts_the_gateway_in_front_of_the_engines_without_a_token() -> None:
    """SMG sends no credentials to gRPC workers: the engines run without the token, only frontends and the
    gateway may reach their gRPC port, and the gateway discovers exactly the engine pods on that port."""
    docs = render(SMG_OVERLAY)
    deployments = by_kind(docs, "Deployment")
    engine = main_container(deployments["tandem-engine"])
    assert not any(a.startswith("--engine-token-file") for a in engine["args"])
    smg = main_container(deployments["tandem-smg"])
    args = smg["args"]
    engine_labels = deployments["tandem-engine"]["spec"]["template"]["metadata"]["labels"]
    selector = args[args.index("--selector") + 1:args.index("--service-discovery-port=50051")]
    assert selector and all(engine_labels.get(k) == v for k, v in (s.split("=", 1) for s in selector))
    assert "--policy=cache_aware" in args and "--model-path=/models/model" in args
    claim = deployments["tandem-smg"]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]
    assert claim == {"claimName": "tandem-model", "readOnly": True}
    policy = by_kind(docs, "NetworkPolicy")["tandem-engine-from-smg"]["spec"]
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "smg"
    assert "tandem-smg" in by_kind(docs, "Service") and "tandem-smg-discovery" in by_kind(docs, "Role")


def test_pd_overlay_runs_two_engine_pools_that_differ_only_in_their_kv_role() -> None:
    """The prefill pool is the gpu overlay's engine renamed (prefill/): same pod spec, flags and config but
    the KV role; selectors (Deployments, PDBs) keep the pools apart while the headless engine Service, the
    frontends' one target, selects both; frontends route `pd`; engines may reach engines (the pull)."""
    from engine_svc.cli import build_parser
    from engine_svc.kv_transfer.config import KVTransferConfig

    docs = render(PD_OVERLAY)
    deployments = by_kind(docs, "Deployment")
    decode, prefill = deployments["tandem-engine"], deployments["tandem-engine-prefill"]
    roles = {}
    for pool, deploy in (("decode", decode), ("prefill", prefill)):
        args = resolved_args(deploy, docs)
        config = next(a.split("=", 1)[1] for a in args if a.startswith("--kv-transfer-config="))
        roles[pool] = KVTransferConfig.from_json(config).kv_role
        build_parser().parse_args(args)  # every flag is one the engine takes
        assert deploy["spec"]["template"]["metadata"]["labels"]["tandem.dev/kv-pool"] == pool
    assert roles == {"decode": "kv_consumer", "prefill": "kv_producer"}

    def pod(deploy: dict[str, Any]) -> dict[str, Any]:
        spec = copy.deepcopy(deploy["spec"]["template"]["spec"])
        spec["containers"][0]["envFrom"][0]["configMapRef"]["name"] = "<engine config>"
        return spec

    assert pod(decode) == pod(prefill), "the prefill pool drifted from the engine it is made of"
    configs = by_kind(docs, "ConfigMap")
    assert {k: v for k, v in configs["tandem-engine-config"]["data"].items() if k != "ENGINE_ARG_KV_TRANSFER_CONFIG"} \
        == {k: v for k, v in configs["tandem-engine-config-prefill"]["data"].items()
            if k != "ENGINE_ARG_KV_TRANSFER_CONFIG"}
    # Disjoint workloads, each with its own PDB; one Service over both pools.
    for deploy, other in ((decode, prefill), (prefill, decode)):
        assert not labels_match(deploy["spec"]["selector"], other["spec"]["template"]["metadata"]["labels"])
    for pdb in by_kind(docs, "PodDisruptionBudget").values():
        selected = [d for d in deployments.values()
                    if labels_match(pdb["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert len(selected) == 1, pdb["metadata"]["name"]
    service = by_kind(docs, "Service")["tandem-engine"]
    for deploy in (decode, prefill):
        assert all(deploy["spec"]["template"]["metadata"]["labels"].get(k) == v
                   for k, v in service["spec"]["selector"].items())
    assert deployment_flags(docs, "frontend")["routing"] == "pd"
    ingress = by_kind(docs, "NetworkPolicy")["tandem-engine"]["spec"]["ingress"]
    assert any(rule["from"][0].get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component")
               == "engine" and rule["ports"][0]["port"] == "grpc" for rule in ingress)
