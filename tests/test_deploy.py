"""The Kubernetes manifests in deploy/ (a kustomize base): every resource validates against the Kubernetes
OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors), the KEDA ScaledObject (a CRD the
schemas do not know) is checked structurally, and the cross-resource wiring holds: labels and selectors,
ports, probes, the drain arithmetic, RBAC for the router's service discovery, volumes, and the mmserve and
vllm-router args parsing with their own CLI parsers. No cluster, no network."""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from mmserve import cli

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.33.0"  # a recent release the installed kubernetes-validate ships strict schemas for
CRD_GROUPS = {"keda.sh"}  # custom resources: no upstream schema, checked structurally below
REPLICA_LABELS = {"app.kubernetes.io/name": "mmserve", "app.kubernetes.io/component": "replica"}

Manifest = dict[str, Any]


def _kustomization() -> Manifest:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def _load() -> list[tuple[str, Manifest]]:
    out: list[tuple[str, Manifest]] = []
    for name in _kustomization()["resources"]:
        with (DEPLOY / name).open() as f:
            out.extend((name, doc) for doc in yaml.safe_load_all(f) if doc is not None)
    return out


DOCS = _load()


def _one(kind: str, name: str) -> Manifest:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected exactly one {kind}/{name}, found {len(found)}"
    return found[0]


def _container(deployment: Manifest) -> Manifest:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} should appear exactly once in {args}"
    return args[args.index(flag) + 1]


def _port(container: Manifest, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return ports[name]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _expand(args: list[str], container: Manifest) -> list[str]:
    """Expand $(VAR) the way the kubelet does, from the container's literal env values."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in args]


REPLICAS = _one("Deployment", "mmserve")
ROUTER = _one("Deployment", "mmserve-router")
MMSERVE = _container(REPLICAS)
ROUTER_CTR = _container(ROUTER)


# --- the files --------------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_nothing_else() -> None:
    listed = _kustomization()["resources"]
    assert len(listed) == len(set(listed))
    on_disk = {p.name for p in DEPLOY.iterdir() if p.suffix in (".yaml", ".yml")} - {"kustomization.yaml"}
    assert sorted(listed) == sorted(on_disk)


def test_base_is_namespace_agnostic_and_images_are_overridable() -> None:
    kustomization = _kustomization()
    assert "namespace" not in kustomization
    for name, doc in DOCS:
        assert "namespace" not in doc["metadata"], f"{name}: hard-coded namespace"
    declared = {image["name"] for image in kustomization["images"]}
    for deployment in (REPLICAS, ROUTER):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert container["image"].rsplit(":", 1)[0] in declared, container["image"]
    assert MMSERVE["image"] == "mmserve:latest"
    assert ROUTER_CTR["image"] == "vllm-router:0.1.17"


# --- schema validation ------------------------------------------------------------------------------------


def test_the_pinned_kubernetes_version_has_schemas() -> None:
    assert K8S_VERSION in all_versions()


def _core(doc: Manifest) -> bool:
    return doc["apiVersion"].split("/")[0] not in CRD_GROUPS


@pytest.mark.parametrize(
    "doc", [d for _, d in DOCS if _core(d)], ids=[f"{n}:{d['kind']}" for n, d in DOCS if _core(d)]
)
def test_manifest_validates_against_the_kubernetes_schema(doc: Manifest) -> None:
    version = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert version == "1.33"  # the schemas actually used, not a fallback to an older release


def test_validator_rejects_broken_manifests() -> None:
    unknown_field = copy.deepcopy(REPLICAS)
    unknown_field["spec"]["replicaCount"] = 2
    misspelled_probe = copy.deepcopy(REPLICAS)
    ctr = _container(misspelled_probe)
    ctr["readinessprobe"] = ctr.pop("readinessProbe")
    wrong_type = copy.deepcopy(REPLICAS)
    _container(wrong_type)["ports"][0]["containerPort"] = "http"
    for broken in (unknown_field, misspelled_probe, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_every_resource_kind_is_either_schema_checked_or_a_known_crd() -> None:
    kinds = {(d["apiVersion"], d["kind"]) for _, d in DOCS}
    assert ("keda.sh/v1alpha1", "ScaledObject") in kinds
    assert {k for a, k in kinds if a.split("/")[0] in CRD_GROUPS} == {"ScaledObject"}


# --- the replicas -----------------------------------------------------------------------------------------


def _serve_args() -> argparse.Namespace:
    parser = cli.build_parser()
    assert MMSERVE["command"] == ["mmserve", "serve"]
    args = _expand(MMSERVE["args"], MMSERVE)
    try:
        return parser.parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"mmserve's CLI rejects the Deployment args: {shlex.join(args)}")


def test_replica_args_parse_with_mmserves_own_cli() -> None:
    ns = _serve_args()
    assert ns.host == "0.0.0.0"
    assert ns.port == _port(MMSERVE, "http") == 8000
    assert ns.vllm_metric_names is True
    assert str(ns.model).startswith("/models/")
    assert ns.served_model_name and "$(" not in ns.served_model_name[0]
    assert ns.api_key is None  # the key comes from the environment (a Secret), never from the manifest
    kv = json.loads(ns.kv_events_config)
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
    assert kv["endpoint"] == f"tcp://*:{_port(MMSERVE, 'kv-events')}"
    assert kv["replay_endpoint"] == f"tcp://*:{_port(MMSERVE, 'kv-replay')}"


def test_every_dollar_reference_in_args_is_a_declared_env_var() -> None:
    for container in (MMSERVE, ROUTER_CTR):
        declared = {e["name"] for e in container.get("env", [])}
        for arg in container["args"]:
            for ref in re.findall(r"\$\(([^)]*)\)", arg):
                assert ref in declared, f"{container['name']}: $({ref}) is not in env (left unexpanded)"


def test_model_env_vars_are_first_as_the_docs_overlay_patches_them() -> None:
    # docs/deploy.md patches /env/0 and /env/1 by index (JSON patch): keep them in this order.
    assert [e["name"] for e in MMSERVE["env"][:2]] == ["MODEL_PATH", "SERVED_MODEL_NAME"]
    assert "/env/0/value" in (ROOT / "docs" / "deploy.md").read_text()


def test_api_key_comes_from_an_optional_secret() -> None:
    env = {e["name"]: e for e in MMSERVE["env"]}
    ref = env["MMSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["optional"] is True and ref["name"] and ref["key"]


def test_replica_probes() -> None:
    assert MMSERVE["readinessProbe"]["httpGet"]["path"] == "/health"
    assert MMSERVE["livenessProbe"]["httpGet"]["path"] == "/live"
    startup = MMSERVE["startupProbe"]
    assert startup["httpGet"]["path"] == "/live"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # minutes to import and bind
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert MMSERVE[probe]["httpGet"]["port"] in ("http", _port(MMSERVE, "http"))


def test_grace_period_covers_prestop_sleep_plus_drain() -> None:
    command = MMSERVE["lifecycle"]["preStop"]["exec"]["command"]
    assert Path(command[0]).name == "sleep"
    sleep_s = float(command[-1])
    drain_s = _serve_args().shutdown_timeout_s
    assert float(_flag(MMSERVE["args"], "--shutdown-timeout-s")) == drain_s
    grace_s = REPLICAS["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s > sleep_s + drain_s, f"grace {grace_s} s <= preStop {sleep_s} s + drain {drain_s} s"


def _volumes(deployment: Manifest) -> dict[str, Manifest]:
    return {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}


def test_every_volume_mount_names_a_declared_volume() -> None:
    for deployment in (REPLICAS, ROUTER):
        volumes = _volumes(deployment)
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{container['name']}: mount {mount['name']} has no volume"


def test_replica_volumes() -> None:
    volumes = _volumes(REPLICAS)
    mounts = {m["mountPath"]: m for m in MMSERVE["volumeMounts"]}
    model = mounts["/models"]
    assert model["readOnly"] is True
    claim = volumes[model["name"]]["persistentVolumeClaim"]
    pvc = _one("PersistentVolumeClaim", claim["claimName"])
    assert "ReadOnlyMany" in pvc["spec"]["accessModes"]
    assert "emptyDir" in volumes[mounts[str(_serve_args().data_dir)]["name"]]
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    if MMSERVE["securityContext"].get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts  # something writable for caches


def test_replica_service_and_pdb_select_the_replica_pods() -> None:
    pod_labels = REPLICAS["spec"]["template"]["metadata"]["labels"]
    assert _matches(REPLICA_LABELS, pod_labels)
    assert _matches(REPLICAS["spec"]["selector"]["matchLabels"], pod_labels)
    service = _one("Service", "mmserve")
    assert service["spec"]["type"] == "ClusterIP"
    assert _matches(service["spec"]["selector"], pod_labels)
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8000 and port["targetPort"] in ("http", _port(MMSERVE, "http"))
    pdb = _one("PodDisruptionBudget", "mmserve")
    assert _matches(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert pdb["spec"]["maxUnavailable"] == 1


# --- the router -------------------------------------------------------------------------------------------


def test_router_discovers_exactly_the_replica_pods() -> None:
    args = ROUTER_CTR["args"]
    assert ROUTER_CTR["command"] == ["vllm-router"]
    assert "--service-discovery" in args
    start = args.index("--selector") + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    selector = dict(pair.split("=", 1) for pair in args[start:end])  # nargs="+": key=value ...
    assert selector == REPLICA_LABELS
    assert _matches(selector, REPLICAS["spec"]["template"]["metadata"]["labels"])
    assert not _matches(selector, ROUTER["spec"]["template"]["metadata"]["labels"]), "router finds itself"
    assert int(_flag(args, "--service-discovery-port")) == _port(MMSERVE, "http")
    assert _flag(args, "--health-check-endpoint") == MMSERVE["readinessProbe"]["httpGet"]["path"]
    assert _flag(args, "--policy") == "cache_aware"
    namespace_ref = re.fullmatch(r"\$\((\w+)\)", _flag(args, "--service-discovery-namespace"))
    assert namespace_ref, "--service-discovery-namespace should be the pod's own namespace, $(VAR)"
    namespace_env = {e["name"]: e for e in ROUTER_CTR["env"]}[namespace_ref[1]]
    assert namespace_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_router_args_parse_with_vllm_routers_own_cli() -> None:
    # vllm-router is not a dependency of mmserve: this runs where it is installed (pip install vllm-router).
    launch_router = pytest.importorskip("vllm_router.launch_router")
    args = [a.replace("$(POD_NAMESPACE)", "ns1") for a in ROUTER_CTR["args"]]
    try:
        parsed = launch_router.parse_router_args(args)
    except SystemExit:
        pytest.fail(f"vllm-router rejects the Deployment args: {shlex.join(args)}")
    assert parsed.service_discovery is True
    assert parsed.selector == REPLICA_LABELS
    assert parsed.service_discovery_namespace == "ns1"
    assert parsed.service_discovery_port == _port(MMSERVE, "http")


def test_router_probes_do_not_use_its_all_workers_health() -> None:
    # GET /health on the router is 503 when any worker is unhealthy: not a signal about the router itself.
    for probe in ("readinessProbe", "livenessProbe"):
        assert "tcpSocket" in ROUTER_CTR[probe], probe
    assert int(_flag(ROUTER_CTR["args"], "--port")) == _port(ROUTER_CTR, "http")
    assert int(_flag(ROUTER_CTR["args"], "--prometheus-port")) == _port(ROUTER_CTR, "metrics")


def test_router_rbac_allows_watching_pods_for_its_service_account() -> None:
    account = ROUTER["spec"]["template"]["spec"]["serviceAccountName"]
    _one("ServiceAccount", account)
    bindings = [d for _, d in DOCS if d["kind"] == "RoleBinding"]
    bound_roles = [
        b["roleRef"]["name"]
        for b in bindings
        if b["roleRef"]["kind"] == "Role"
        and any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"])
    ]
    assert bound_roles, f"no RoleBinding binds ServiceAccount {account}"
    granted: set[str] = set()
    for role_name in bound_roles:
        for rule in _one("Role", role_name)["rules"]:
            if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                granted |= set(rule["verbs"])
    assert {"get", "list", "watch"} <= granted


def test_router_service_is_the_client_entry_point() -> None:
    service = _one("Service", "mmserve-router")
    assert _matches(service["spec"]["selector"], ROUTER["spec"]["template"]["metadata"]["labels"])
    assert not _matches(service["spec"]["selector"], REPLICAS["spec"]["template"]["metadata"]["labels"])
    http = next(p for p in service["spec"]["ports"] if p["name"] == "http")
    assert http["port"] == 80 and http["targetPort"] in ("http", 8000)


# --- KEDA -------------------------------------------------------------------------------------------------


def _mmserve_metric_names() -> Iterator[str]:
    # Read the source rather than import it: mmserve.api.metrics imports torch (seconds).
    source = (ROOT / "mmserve" / "api" / "metrics.py").read_text()
    prefix = re.search(r'^P = "([^"]+)"', source, re.M)
    assert prefix
    for name in re.findall(r'gauge\(\s*"([a-z_]+)"', source):
        yield prefix[1] + name


def test_keda_scaledobject() -> None:
    (scaled,) = [d for _, d in DOCS if d["kind"] == "ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    assert _one("Deployment", target["name"]) is REPLICAS
    assert "replicas" not in REPLICAS["spec"], "a fixed replica count fights the autoscaler on every apply"
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["cooldownPeriod"] > 0
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > 0
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["serverAddress"].startswith("http")
    assert float(meta["threshold"]) > 0 and isinstance(meta["threshold"], str)  # KEDA wants strings
    metric = re.match(r"\s*sum\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)", meta["query"])
    assert metric and metric[1] == "mmserve:num_requests_waiting"
    assert metric[1] in set(_mmserve_metric_names())
