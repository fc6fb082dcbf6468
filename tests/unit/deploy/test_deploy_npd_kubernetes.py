"""node-problem-detector on Kubernetes (issue 32): NPD's upstream image has no Python, so the chart and the kustomize
overlay ship a bash check (deploy/npd/gpuhealth-npd-check.sh) that NPD runs from the ConfigMap, and an example NPD
DaemonSet on the upstream image that mounts it (deploy/npd/node-problem-detector.yaml, validated here against the
Kubernetes schemas). With a restrictive networkPolicy.metricsFrom, the agent's NetworkPolicy admits NPD's pods
(npd.podLabels) — before, it blocked them silently and the node condition stayed Unknown — and the chart's NOTES
say what it admits and what it cannot (a hostNetwork NPD). The check itself runs against a real agent in
tests/integration/test_npd_check.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from chart_docs import NS, REPO, notes, one, rendered
from test_deploy_kubernetes import K8S_VERSIONS, render, validate
from test_deploy_npd import NPD_CUSTOM_PLUGIN_SCHEMA

CHECK = REPO / "deploy" / "npd" / "gpuhealth-npd-check.sh"
EXAMPLE = REPO / "deploy" / "npd" / "node-problem-detector.yaml"
COPIES = [REPO / "deploy" / "helm" / "gpuhealth" / "files" / "gpuhealth-npd-check.sh",
          REPO / "deploy" / "kubernetes" / "overlays" / "npd" / "gpuhealth-npd-check.sh"]
RESTRICTED = {"networkPolicy": {"metricsFrom": [
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}}


def example() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def npd_pod(docs: list[dict[str, Any]]) -> tuple[str, dict[str, str], dict[str, Any]]:
    """Namespace, labels and spec of the example NPD pod."""
    ds = one(docs, "DaemonSet", "node-problem-detector")
    template = ds["spec"]["template"]
    return ds["metadata"]["namespace"], template["metadata"]["labels"], template["spec"]


def test_the_check_is_one_file_in_three_places() -> None:
    for copy in COPIES:
        assert copy.read_text() == CHECK.read_text(), f"{copy} differs from {CHECK}: copy it again"


@pytest.mark.parametrize("source", ["chart", "overlay"])
def test_the_monitor_runs_the_bash_check_from_the_configmap(chart: Any, source: str) -> None:
    docs = rendered(chart, {"npd": {"enabled": True}}) if source == "chart" else render("overlays/npd")
    cm = one(docs, "ConfigMap", "gpuhealth-npd-monitor")
    monitor = json.loads(cm["data"]["gpuhealth-monitor.json"])
    jsonschema.validate(monitor, NPD_CUSTOM_PLUGIN_SCHEMA)
    [rule] = monitor["rules"]
    assert rule["path"] == "/bin/bash"  # the upstream image's bash; a ConfigMap file need not be executable
    script, _url, timeout = rule["args"]
    assert script == "/config/gpuhealth/gpuhealth-npd-check.sh" and int(timeout) < 45
    assert cm["data"]["gpuhealth-npd-check.sh"].rstrip("\n") == CHECK.read_text().rstrip("\n")


def test_the_example_npd_daemonset_mounts_the_monitor_where_it_runs_the_check(chart: Any) -> None:
    docs = example()
    for version in K8S_VERSIONS:
        for doc in docs:
            validate(doc, version)
    _ns, _labels, pod = npd_pod(docs)
    [container] = pod["containers"]
    assert container["image"].startswith("registry.k8s.io/node-problem-detector/node-problem-detector:")
    flags = [a.split("=", 1)[1] for a in container["command"] if a.startswith("--config.custom-plugin-monitor=")]
    [volume] = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == "gpuhealth-npd-monitor"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    monitor_cm = one(rendered(chart, {"npd": {"enabled": True}}), "ConfigMap", "gpuhealth-npd-monitor")
    assert flags == [f"{mount['mountPath']}/gpuhealth-monitor.json"]
    [rule] = json.loads(monitor_cm["data"]["gpuhealth-monitor.json"])["rules"]
    assert rule["args"][0] == f"{mount['mountPath']}/gpuhealth-npd-check.sh"


def _admits(policy: dict[str, Any], namespace: str, labels: dict[str, str], port: str) -> bool:
    """Whether a NetworkPolicy's ingress rules let a pod (its namespace, its labels) reach ``port``. A peer with
    both selectors must match both; a namespace is labelled kubernetes.io/metadata.name (Kubernetes sets it)."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}

    def matches(selector: dict[str, Any] | None, have: dict[str, str]) -> bool:
        assert not (selector or {}).get("matchExpressions")
        return all(have.get(k) == v for k, v in (selector or {}).get("matchLabels", {}).items())

    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        peers = rule.get("from")
        if not peers:
            return True
        for peer in peers:
            ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
            same_ns = namespace == policy["metadata"]["namespace"]
            if (matches(ns_sel, ns_labels) if ns_sel is not None else same_ns) and matches(pod_sel, labels):
                return True
    return False


@pytest.mark.parametrize("npd_namespace", ["", "kube-system"])
def test_a_restrictive_metrics_from_still_admits_npd(chart: Any, npd_namespace: str) -> None:
    namespace, labels, _ = npd_pod(example())
    namespace = npd_namespace or NS
    docs = rendered(chart, {**RESTRICTED, "npd": {"enabled": True, "namespace": npd_namespace}})
    policy = one(docs, "NetworkPolicy", "gpuhealth-agent")
    for version in K8S_VERSIONS:
        validate(policy, version)
    assert _admits(policy, namespace, labels, "metrics")
    assert _admits(policy, "monitoring", {"app": "prometheus"}, "metrics")  # metricsFrom still holds
    assert not _admits(policy, "default", {"app": "prometheus"}, "metrics")
    assert not _admits(policy, "default", labels, "metrics")  # NPD's labels, elsewhere: not NPD
    # NPD's pods carrying other labels are admitted once npd.podLabels names them (null drops Helm's default)
    other = {"app": None, "k8s-app": "npd"}
    relabelled = one(rendered(chart, {**RESTRICTED, "npd": {"enabled": True, "podLabels": other}}),
                     "NetworkPolicy", "gpuhealth-agent")
    assert not _admits(relabelled, NS, labels, "metrics") and _admits(relabelled, NS, {"k8s-app": "npd"}, "metrics")


def test_notes_warn_where_npd_could_be_blocked(chart: Any) -> None:
    text = notes(chart, {**RESTRICTED, "npd": {"enabled": True}})
    assert "app=node-problem-detector" in text and "hostNetwork" in text and "Unknown" in text
    assert "networkPolicy.metricsFrom" in notes(chart, RESTRICTED)  # NPD set up by hand: blocked unless admitted
    quiet = notes(chart, {"npd": {"enabled": True}})  # metricsFrom empty: everyone reaches the agents
    assert "WARNING" not in quiet and "gpuhealth-npd-monitor" in quiet
    assert "NetworkPolicy" not in notes(chart)
