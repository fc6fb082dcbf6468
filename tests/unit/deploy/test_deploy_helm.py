"""The Helm chart (deploy/helm/gpuhealth), rendered offline by Helm's own engine (helm-python-sdk:
Helm's Go SDK, no cluster) and validated like the kustomize manifests: every object against the
Kubernetes OpenAPI schemas (strict) or the prometheus-operator CRD schemas, with default values and
with the values operators change; helm lint clean; the values schema refuses bad input."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from gpuhealth.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from chart_docs import one, rendered
from test_deploy_kubernetes import K8S_VERSIONS, render, validate

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "gpuhealth"
RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"




def test_helm_lint_is_clean() -> None:
    result = helm.lint(CHART, strict=True)
    assert result["errors"] == [], result
    assert all(m["severity"] <= 1 for m in result["messages"]), result  # info only (icon)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", [{}, {"coordinator": {"enabled": False}, "agent": {"privileged": False}},
                                    {"monitoring": {"serviceMonitor": False, "prometheusRule": False}}],
                         ids=["defaults", "agent-only-unprivileged", "no-prometheus-operator"])
def test_every_rendered_object_validates(chart: Any, version: str, values: dict[str, Any]) -> None:
    docs = rendered(chart, values)
    assert docs
    for doc in docs:
        validate(doc, version)
        if doc["kind"] not in ("ClusterRoleBinding",):  # cluster-scoped
            assert doc["metadata"]["namespace"] == "gpu-mon"


def test_defaults_install_what_the_kustomize_base_does(chart: Any) -> None:
    base = {(d["kind"], d["metadata"]["name"].split("-")[0] if d["kind"] == "ConfigMap" else d["metadata"]["name"])
            for d in render("base") if d["kind"] != "Namespace"}  # Helm installs into the release's namespace
    # the chart also generates the operator token (kustomize cannot: the base takes an optional Secret), and
    # names its one cluster-scoped object after the release's namespace
    ours = {(d["kind"], d["metadata"]["name"].split("-")[0] if d["kind"] == "ConfigMap"
             else d["metadata"]["name"].replace("-gpu-mon-", "-"))
            for d in rendered(chart) if d["kind"] != "Secret"}
    assert ours == base
    ds = one(rendered(chart), "DaemonSet", "gpuhealth-agent")
    base_ds = one(render("base"), "DaemonSet", "gpuhealth-agent")
    for key in ("tolerations", "nodeSelector", "runtimeClassName", "priorityClassName"):
        assert ds["spec"]["template"]["spec"][key] == base_ds["spec"]["template"]["spec"][key], key
    assert ds["spec"]["template"]["spec"]["tolerations"] == [{"operator": "Exists"}]  # every taint


def test_agent_config_is_a_valid_gpuhealth_config_pointing_at_the_release(chart: Any, tmp_path: Path) -> None:
    docs = rendered(chart, {"agent": {"port": 9600, "config": {"agent": {"dcgm_compat": True}}}})
    text = one(docs, "ConfigMap", "gpuhealth-agent-config")["data"]["agent.yaml"]
    (tmp_path / "agent.yaml").write_text(text)
    cfg = load_config(tmp_path / "agent.yaml", env={})  # what the agent itself would accept
    assert cfg.agent.dcgm_compat is True and cfg.agent.listen == "0.0.0.0:9600"
    assert cfg.agent.coordinator == "gpuhealth-coordinator.gpu-mon.svc:9500"
    ds = one(docs, "DaemonSet", "gpuhealth-agent")
    [port] = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert port["containerPort"] == 9600
    assert one(docs, "Service", "gpuhealth-agent")["spec"]["ports"][0]["port"] == 9600
    coord = rendered(chart, {"coordinator": {"enabled": False}})
    text = one(coord, "ConfigMap", "gpuhealth-agent-config")["data"]["agent.yaml"]
    assert "coordinator" not in yaml.safe_load(text)["agent"]
    assert not [d for d in coord if "coordinator" in d["metadata"]["name"]]


def test_rules_are_the_alert_rules_with_runbooks_under_the_chosen_base(chart: Any) -> None:
    docs = rendered(chart, {"runbookBaseUrl": "https://wiki.example.org/sre/gpuhealth"})
    groups = one(docs, "PrometheusRule", "gpuhealth")["spec"]["groups"]
    source = yaml.safe_load(RULES.read_text())["groups"]
    urls = [r["annotations"]["runbook_url"] for g in groups for r in g["rules"]]
    assert urls and all(u.startswith("https://wiki.example.org/sre/gpuhealth/docs/alerts.md#") for u in urls)
    for g in groups:
        for r in g["rules"]:
            r["annotations"]["runbook_url"] = "docs/alerts.md#" + r["annotations"]["runbook_url"].split("#")[1]
    assert groups == source  # the same rules as deploy/prometheus/alerts.yaml
    sm = one(docs, "ServiceMonitor", "gpuhealth-agent")["spec"]["endpoints"][0]
    assert sm["honorLabels"] is True and {"regex": "(pod|namespace|container)", "action": "labeldrop"} in \
        sm["relabelings"]


def test_unprivileged_agent_does_without_kmsg(chart: Any) -> None:
    ds = one(rendered(chart, {"agent": {"privileged": False}}), "DaemonSet", "gpuhealth-agent")
    pod = ds["spec"]["template"]["spec"]
    assert pod["containers"][0]["securityContext"]["privileged"] is False
    assert "kmsg" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize(("values", "complaint"), [
    ({"runbookBaseUrl": "docs/"}, "runbookBaseUrl"),
    ({"agent": {"port": 99999}}, "port"),
    ({"agent": {"tolerance": []}}, "tolerance"),
    ({"coordinator": {"storage": {"size": "lots"}}}, "size"),
])
def test_the_values_schema_refuses_bad_values(chart: Any, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmError, match=complaint):
        chart.render(values, name="gh", namespace="gpu-mon")
