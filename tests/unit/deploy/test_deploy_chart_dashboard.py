"""The gpuhealth Grafana dashboard on Kubernetes (issue 32): with ``monitoring.grafanaDashboard.enabled`` the chart
renders a ConfigMap that kube-prometheus-stack's Grafana sidecar loads — labelled ``grafana_dashboard: "1"`` (the
sidecar's default) or the label the operator names — holding exactly the shipped dashboard
(deploy/grafana/gpuhealth.json). Rendered by Helm's own engine and validated against the Kubernetes schemas."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from chart_docs import NS, REPO, one, rendered
from test_deploy_kubernetes import K8S_VERSIONS, validate

DASHBOARD = REPO / "deploy" / "grafana" / "gpuhealth.json"
NAME = "gpuhealth-grafana-dashboard"


def dashboards(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == NAME]


def test_off_by_default(chart: Any) -> None:
    assert dashboards(rendered(chart)) == []


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_on_it_is_the_shipped_dashboard_labelled_for_the_grafana_sidecar(chart: Any, version: str) -> None:
    docs = rendered(chart, {"monitoring": {"grafanaDashboard": {"enabled": True}}})
    cm = one(docs, "ConfigMap", NAME)
    validate(cm, version)
    assert cm["metadata"]["namespace"] == NS
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "annotations" not in cm["metadata"]
    [(key, text)] = cm["data"].items()
    assert key.endswith(".json")
    assert json.loads(text) == json.loads(DASHBOARD.read_text())
    assert text == DASHBOARD.read_text().rstrip("\n")  # byte for byte, legend templates ({{instance}}) untouched


def test_label_namespace_and_folder_are_the_operators(chart: Any) -> None:
    values = {"grafanaDashboard": {"enabled": True, "label": "grafana.example.org/dashboard", "labelValue": "gpu",
                                   "namespace": "monitoring", "folder": "GPU fleet"}}
    cm = one(rendered(chart, {"monitoring": values}), "ConfigMap", NAME)
    assert cm["metadata"]["labels"]["grafana.example.org/dashboard"] == "gpu"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "GPU fleet"}
    validate(cm, K8S_VERSIONS[-1])


@pytest.mark.parametrize("values", [
    {"enabled": "yes"},
    {"enabled": True, "label": "not a label!"},
    {"enabled": True, "namespace": "Monitoring"},
    {"enabled": True, "lable": "grafana_dashboard"},
])
def test_the_values_schema_refuses_a_bad_dashboard_value(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError) as err:
        rendered(chart, {"monitoring": {"grafanaDashboard": values}})
    assert "grafanaDashboard" in str(err.value)
