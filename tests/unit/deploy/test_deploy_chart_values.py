"""Chart values drive the binary (issue 23): one port value renders the config file and every manifest that
names the port; the agents find the coordinator from its Service; each auth mode wires the same paths into
the config files and the pod specs (and the RBAC TokenReview needs); a NetworkPolicy ships; hostPID with
CAP_SYS_PTRACE, imagePullSecrets, affinity and extra env are values; node-problem-detector's monitor on
Kubernetes reaches the agent on its own node through a Service with internalTrafficPolicy: Local — in the
chart and in the kustomize base (overlays/npd). Everything rendered by Helm's own engine or kustomize, and
validated against the Kubernetes schemas; the configs loaded with gpuhealth's own loader."""

from __future__ import annotations

import base64
import json
import posixpath
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import helm_python as helm
import jsonschema
import pytest

from gpuhealth.config import Config, split_address

sys.path.insert(0, str(Path(__file__).parent))
from chart_docs import NS, config, rendered
from test_deploy_kubernetes import K8S_VERSIONS, render, validate
from test_deploy_npd import NPD_CUSTOM_PLUGIN_SCHEMA

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "gpuhealth"


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [d] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    return d


def pod(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(docs, kind, name)["spec"]["template"]["spec"]
    return spec


def agent_config(docs: list[dict[str, Any]]) -> Config:
    return config(docs, "gpuhealth-agent-config", "agent.yaml")


def coordinator_config(docs: list[dict[str, Any]]) -> Config:
    return config(docs, "gpuhealth-coordinator-config", "coordinator.yaml")


def mount_of(spec: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume mounted at the folder holding ``path`` (the longest mount path that contains it)."""
    mounts = sorted(container["volumeMounts"], key=lambda m: -len(m["mountPath"]))
    m = next(m for m in mounts if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume: dict[str, Any] = {v["name"]: v for v in spec["volumes"]}[m["name"]]
    return volume


def service_target(docs: list[dict[str, Any]], service: str, port_name: str, kind: str,
                   workload: str) -> tuple[int, int]:
    """(Service port, the container port it targets); the Service selects the workload's pods."""
    svc = one(docs, "Service", service)
    template = one(docs, kind, workload)["spec"]["template"]
    assert svc["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    [port] = [p for p in svc["spec"]["ports"] if p["name"] == port_name]
    named = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    return int(port["port"]), int(named[port["targetPort"]])


# ---------------------------------------------------------------------------------------------------- ports
@pytest.mark.parametrize("ports", [(9502, 9500, 9501), (9612, 9610, 9611)])
def test_one_port_value_renders_config_and_manifests(chart: Any, ports: tuple[int, int, int]) -> None:
    agent_port, grpc_port, metrics_port = ports
    docs = rendered(chart, {"agent": {"port": agent_port},
                            "coordinator": {"port": grpc_port, "metricsPort": metrics_port}})
    acfg, ccfg = agent_config(docs), coordinator_config(docs)
    # the agent: listen address, container port, both Services, probes (by the port's name)
    assert split_address(acfg.agent.listen) == ("0.0.0.0", agent_port)
    for service in ("gpuhealth-agent", "gpuhealth-local-agent"):
        assert service_target(docs, service, "metrics", "DaemonSet", "gpuhealth-agent") == (agent_port, agent_port)
    agent = pod(docs, "DaemonSet", "gpuhealth-agent")["containers"][0]
    assert agent["livenessProbe"]["httpGet"]["port"] == agent["readinessProbe"]["httpGet"]["port"] == "metrics"
    # the coordinator: listen and metrics addresses, container ports, gRPC probes, Service
    assert split_address(ccfg.coordinator.listen) == ("0.0.0.0", grpc_port)
    assert split_address(ccfg.coordinator.metrics_listen) == ("0.0.0.0", metrics_port)
    assert service_target(docs, "gpuhealth-coordinator", "grpc", "Deployment", "gpuhealth-coordinator") == \
        (grpc_port, grpc_port)
    assert service_target(docs, "gpuhealth-coordinator", "metrics", "Deployment", "gpuhealth-coordinator") == \
        (metrics_port, metrics_port)
    coord = pod(docs, "Deployment", "gpuhealth-coordinator")["containers"][0]
    assert coord["livenessProbe"]["grpc"]["port"] == coord["readinessProbe"]["grpc"]["port"] == grpc_port
    # the agents find the coordinator from its Service
    assert acfg.agent.coordinator == f"gpuhealth-coordinator.{NS}.svc:{grpc_port}"
    for version in K8S_VERSIONS:
        for doc in docs:
            validate(doc, version)


@pytest.mark.parametrize(("values", "complaint"), [
    ({"agent": {"config": {"agent": {"listen": "0.0.0.0:9600"}}}}, "set agent.port instead"),
    ({"coordinator": {"config": {"coordinator": {"listen": "0.0.0.0:9600"}}}}, "coordinator.port"),
    ({"coordinator": {"config": {"coordinator": {"metrics_listen": "0.0.0.0:9601"}}}}, "metricsPort"),
    ({"auth": {"mode": "password"}}, "mode"),
    ({"imagePullSecrets": ["regcred"]}, "imagePullSecrets"),
])
def test_a_second_source_for_a_port_or_a_bad_value_is_refused(chart: Any, values: dict[str, Any],
                                                               complaint: str) -> None:
    with pytest.raises(helm.HelmError, match=complaint):
        chart.render(values, name="gh", namespace=NS)


# ---------------------------------------------------------------------------------------------- auth modes
def test_token_review_mode_wires_tokens_paths_and_rbac(chart: Any) -> None:
    docs = rendered(chart, {"auth": {"audience": "gh-aud"}})
    acfg, ccfg = agent_config(docs), coordinator_config(docs)
    # the agent presents a projected token of the audience the coordinator expects
    spec = pod(docs, "DaemonSet", "gpuhealth-agent")
    token_volume = mount_of(spec, spec["containers"][0], acfg.coordinator.token_file or "")
    [source] = token_volume["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == ccfg.coordinator.token_review_audience == "gh-aud"
    assert posixpath.basename(acfg.coordinator.token_file or "") == source["serviceAccountToken"]["path"]
    assert spec["automountServiceAccountToken"] is False
    # the coordinator asks the API server with its own projected token and the cluster's CA
    assert ccfg.coordinator.token_review == "in-cluster"
    assert ccfg.coordinator.agent_service_accounts == f"system:serviceaccount:{NS}:gpuhealth-agent"
    cspec = pod(docs, "Deployment", "gpuhealth-coordinator")
    kube = mount_of(cspec, cspec["containers"][0], ccfg.coordinator.token_review_credential_file or "")
    assert kube is mount_of(cspec, cspec["containers"][0], ccfg.coordinator.token_review_ca or "")
    paths = {s.get("serviceAccountToken", {}).get("path") for s in kube["projected"]["sources"]}
    paths |= {i["path"] for s in kube["projected"]["sources"] for i in s.get("configMap", {}).get("items", [])}
    assert {posixpath.basename(ccfg.coordinator.token_review_credential_file or ""),
            posixpath.basename(ccfg.coordinator.token_review_ca or "")} <= paths
    crb = one(docs, "ClusterRoleBinding", "gpuhealth-coordinator")
    assert crb["roleRef"]["name"] == "system:auth-delegator"
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "gpuhealth-coordinator", "namespace": NS}]
    assert one(docs, "Role", "gpuhealth-coordinator")["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    assert not ccfg.coordinator.allow_unauthenticated and not ccfg.coordinator.node_secret_file


def test_node_secret_mode_generates_the_secret_and_mints_each_agents_token(chart: Any) -> None:
    docs = rendered(chart, {"auth": {"mode": "nodeSecret"}})
    acfg, ccfg = agent_config(docs), coordinator_config(docs)
    secret = base64.b64decode(one(docs, "Secret", "gpuhealth-cluster-secret")["data"]["secret"])
    assert len(secret) >= 32
    spec = pod(docs, "DaemonSet", "gpuhealth-agent")
    [init] = spec["initContainers"]
    args = init["args"]
    assert args[:3] == ["token", "--node", "$(NODE_NAME)"]
    assert {e["name"]: e for e in init["env"]}["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    out = args[args.index("--out") + 1]
    assert out == acfg.coordinator.token_file  # minted where the agent reads it ...
    assert mount_of(spec, init, out) is mount_of(spec, spec["containers"][0], out)  # ... through the same volume
    assert mount_of(spec, spec["containers"][0], out)["emptyDir"]["medium"] == "Memory"
    # the secret reaches the init container, never the agent container
    assert "cluster-secret" not in {m["name"] for m in spec["containers"][0]["volumeMounts"]}
    cspec = pod(docs, "Deployment", "gpuhealth-coordinator")
    vol = mount_of(cspec, cspec["containers"][0], ccfg.coordinator.node_secret_file or "")
    assert vol["secret"]["secretName"] == "gpuhealth-cluster-secret"
    assert vol["secret"]["defaultMode"] & 0o007 == 0  # not readable by every user (read_secret refuses that)
    assert not [d for d in docs if d["kind"] in ("Role", "ClusterRoleBinding")]
    taken = rendered(chart, {"auth": {"mode": "nodeSecret", "existingSecret": "mine"}})
    assert not [d for d in taken if d["kind"] == "Secret" and "cluster" in d["metadata"]["name"]]
    cspec = pod(taken, "Deployment", "gpuhealth-coordinator")
    assert {v["name"]: v for v in cspec["volumes"]}["cluster-secret"]["secret"]["secretName"] == "mine"


def test_the_operator_token_is_the_coordinators_alone(chart: Any) -> None:
    docs = rendered(chart)
    token = base64.b64decode(one(docs, "Secret", "gpuhealth-operator-token")["data"]["token"])
    assert len(token) >= 32
    env = {e["name"]: e for e in pod(docs, "Deployment", "gpuhealth-coordinator")["containers"][0]["env"]}
    assert env["GPUHEALTH_COORDINATOR_OPERATOR_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "gpuhealth-operator-token", "key": "token"}
    agent = json.dumps(pod(docs, "DaemonSet", "gpuhealth-agent"))
    assert "gpuhealth-operator-token" not in agent and "OPERATOR_TOKEN" not in agent


def test_mode_none_is_said_in_the_config(chart: Any) -> None:
    docs = rendered(chart, {"auth": {"mode": "none"}})
    assert coordinator_config(docs).coordinator.allow_unauthenticated is True
    assert agent_config(docs).coordinator.token_file is None


# --------------------------------------------------------------------------------------------------- policy
def test_network_policies_let_agents_and_grpc_from_reach_the_coordinator_only(chart: Any) -> None:
    operators = [{"namespaceSelector": {"matchLabels": {"team": "sre"}}}]
    docs = rendered(chart, {"networkPolicy": {"grpcFrom": operators}})
    policy = one(docs, "NetworkPolicy", "gpuhealth-coordinator")["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "gpuhealth-coordinator"}
    grpc_rule = next(r for r in policy["ingress"] if r["ports"][0]["port"] == "grpc")
    assert grpc_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gpuhealth-agent"}}},
                                 *operators]
    ports = {p["name"] for p in pod(docs, "Deployment", "gpuhealth-coordinator")["containers"][0]["ports"]}
    assert {p["port"] for r in policy["ingress"] for p in r["ports"]} <= ports
    agent = one(docs, "NetworkPolicy", "gpuhealth-agent")["spec"]
    assert [p["port"] for r in agent["ingress"] for p in r["ports"]] == ["metrics"]
    assert not [d for d in rendered(chart, {"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_base_ships_the_same_policies_and_token_review() -> None:
    base = render("base")
    assert {d["metadata"]["name"] for d in base if d["kind"] == "NetworkPolicy"} == \
        {"gpuhealth-coordinator", "gpuhealth-agent"}
    ccfg = config(base, "gpuhealth-coordinator-config", "coordinator.yaml").coordinator
    acfg = config(base, "gpuhealth-agent-config", "agent.yaml")
    assert ccfg.token_review == "in-cluster" and ccfg.agent_service_accounts.endswith(":gpuhealth:gpuhealth-agent")
    spec = pod(base, "DaemonSet", "gpuhealth-agent")
    [source] = mount_of(spec, spec["containers"][0], acfg.coordinator.token_file or "")["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == ccfg.token_review_audience


# ------------------------------------------------------------------------------------------- pod options
def test_host_pid_with_ptrace_pull_secrets_affinity_and_extra_env(chart: Any) -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gpu"]}]}]}}}
    extra = [{"name": "GPUHEALTH_COLLECTORS_EXPECTED_GPUS", "value": "8"}]
    docs = rendered(chart, {"imagePullSecrets": [{"name": "regcred"}],
                            "agent": {"hostPID": True, "privileged": False, "affinity": affinity, "extraEnv": extra},
                            "coordinator": {"affinity": affinity, "extraEnv": extra}})
    for kind, name in (("DaemonSet", "gpuhealth-agent"), ("Deployment", "gpuhealth-coordinator")):
        spec = pod(docs, kind, name)
        assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["affinity"] == affinity
        assert extra[0] in spec["containers"][0]["env"]
    agent = pod(docs, "DaemonSet", "gpuhealth-agent")
    assert agent["hostPID"] is True
    assert agent["containers"][0]["securityContext"]["capabilities"] == {"add": ["SYS_PTRACE"]}
    privileged = pod(rendered(chart, {"agent": {"hostPID": True}}), "DaemonSet", "gpuhealth-agent")
    assert privileged["hostPID"] is True and "capabilities" not in privileged["containers"][0]["securityContext"]
    default = pod(rendered(chart), "DaemonSet", "gpuhealth-agent")
    assert "hostPID" not in default and "imagePullSecrets" not in default and "affinity" not in default
    for version in K8S_VERSIONS:
        for doc in docs:
            validate(doc, version)


# ------------------------------------------------------------------------------------ node-problem-detector
def _npd_url(monitor: dict[str, Any]) -> str:
    """The agent URL a monitor's rule asks: the bash check's first argument on Kubernetes (NPD's image has no
    Python), ``gpuhealth status --agent`` on bare metal."""
    jsonschema.validate(monitor, NPD_CUSTOM_PLUGIN_SCHEMA)
    [rule] = monitor["rules"]
    args = rule["args"]
    if rule["path"] == "/bin/bash":
        assert args[0].endswith("/gpuhealth-npd-check.sh") and len(args) == 3, args
        return str(args[1])
    assert args[:3] == ["status", "--exit-codes", "npd"]
    return str(args[args.index("--agent") + 1])


def _reaches_the_local_agent(docs: list[dict[str, Any]], url: str, namespace: str) -> None:
    """The URL names a Service (name.namespace.svc:port) with internalTrafficPolicy Local that selects the
    agent pods, on a port whose target is the agent's container port — the port the agent listens on."""
    parts = urlsplit(url)
    m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc", parts.hostname or "")
    assert m is not None and m.group(2) == namespace, url
    svc = one(docs, "Service", m.group(1))
    assert svc["metadata"]["name"] == m.group(1) and svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"].get("clusterIP") != "None"  # headless Services have no traffic policy
    [port] = [p for p in svc["spec"]["ports"] if p["port"] == parts.port]
    service_port, container_port = service_target(docs, m.group(1), port["name"], "DaemonSet", "gpuhealth-agent")
    assert service_port == parts.port
    assert split_address(agent_config(docs).agent.listen) == ("0.0.0.0", container_port)


@pytest.mark.parametrize("values", [{"npd": {"enabled": True}},
                                    {"npd": {"enabled": True, "namespace": "kube-system"}, "agent": {"port": 9612}}])
def test_the_charts_npd_monitor_asks_the_agent_on_its_node(chart: Any, values: dict[str, Any]) -> None:
    docs = rendered(chart, values)
    cm = one(docs, "ConfigMap", "gpuhealth-npd-monitor")
    assert cm["metadata"]["namespace"] == values["npd"].get("namespace", NS)
    _reaches_the_local_agent(docs, _npd_url(json.loads(cm["data"]["gpuhealth-monitor.json"])), NS)
    assert not [d for d in rendered(chart) if d["metadata"]["name"] == "gpuhealth-npd-monitor"]


def test_the_kustomize_npd_overlay_asks_the_agent_on_its_node() -> None:
    docs = render("overlays/npd")
    cm = one(docs, "ConfigMap", "gpuhealth-npd-monitor")
    assert cm["metadata"]["name"] == "gpuhealth-npd-monitor" and cm["metadata"]["namespace"] == "kube-system"
    monitor = json.loads(cm["data"]["gpuhealth-monitor.json"])
    _reaches_the_local_agent(docs, _npd_url(monitor), "gpuhealth")
    # the bare-metal monitor (gpuhealth on the host) stays on loopback; the two differ only in their rule's command
    bare = json.loads((REPO / "deploy" / "npd" / "gpuhealth-monitor.json").read_text())
    assert _npd_url(bare) == "http://127.0.0.1:9502"
    bare["rules"][0].update(path=monitor["rules"][0]["path"], args=monitor["rules"][0]["args"])
    assert bare == monitor
    for version in K8S_VERSIONS:
        for doc in docs:
            validate(doc, version)
