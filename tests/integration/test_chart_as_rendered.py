"""The Helm chart (and the kustomize base) run as rendered: the coordinator and an agent started from the
rendered pod specs — their args, environment, ConfigMaps, Secrets and projected tokens — and the agent
connects with the credentials the chart gives it; a client without them is refused.

What a cluster would provide and cannot run here is supplied, and nothing else is changed:

- volumes: each mount path is a folder of the test (ConfigMaps and Secrets written there as the kubelet
  would, with their modes; a projected ServiceAccount token is what the stand-in API server issued for
  that pod), and the container paths in args and config files are read through those folders;
- the network: pods have their own network namespace, here one host is shared, so the listen addresses
  take port 0 (GPUHEALTH_*_LISTEN) and the agent's coordinator address — checked first to be the
  coordinator Service's DNS name and port, whose target is the coordinator's gRPC container port — is
  the port the coordinator bound;
- the API server: the TokenReview stand-in (tests/integration/tokenreview_standin.py), at the address the
  kubelet gives pods (KUBERNETES_SERVICE_HOST/PORT); the GPUs: the agent reads a scenario (NVML fake).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import grpc
import helm_python as helm
import pytest
import yaml
from commands import CLI, SCENARIO, Proc, run_cli, until
from simagent import SimAgent
from tokenreview_standin import ServiceAccountToken, StandIn

from gpuhealth.runtime.credentials import node_token
from gpuhealth.runtime.tls import token_metadata

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "deploy"))
from test_deploy_kubernetes import render as kustomize

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "gpu-mon"
NODE = "node-a"


def _chart(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(REPO / "deploy" / "helm" / "gpuhealth") as chart:
        out = chart.render(values, name="gh", namespace=NAMESPACE, is_install=True)
    return [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name)]
    return doc


class Pod:
    """One pod of a rendered workload, its volumes materialised under ``root``."""

    def __init__(self, docs: list[dict[str, Any]], kind: str, name: str, root: Path, *,
                 tokens: dict[str | None, str], cluster_configmaps: dict[str, dict[str, str]]) -> None:
        self.docs = docs
        self.spec = _one(docs, kind, name)["spec"]["template"]["spec"]
        self.root = root
        self.volumes: dict[str, Path] = {}
        for volume in self.spec.get("volumes", []):
            self.volumes[volume["name"]] = self._materialise(volume, tokens, cluster_configmaps)

    def _materialise(self, volume: dict[str, Any], tokens: dict[str | None, str],
                     cluster_configmaps: dict[str, dict[str, str]]) -> Path:
        where = self.root / "volumes" / volume["name"]
        where.mkdir(parents=True)
        if "configMap" in volume:
            self._files(where, self._configmap(volume["configMap"]["name"], cluster_configmaps),
                        volume["configMap"].get("items"), 0o644)
        elif "secret" in volume:
            secret = _one(self.docs, "Secret", volume["secret"]["secretName"])
            data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
            self._files(where, data, volume["secret"].get("items"), volume["secret"].get("defaultMode", 0o644))
        elif "projected" in volume:
            for source in volume["projected"]["sources"]:
                if "serviceAccountToken" in source:
                    sa = source["serviceAccountToken"]
                    self._files(where, {sa["path"]: tokens[sa.get("audience")] + "\n"}, None, 0o600)
                elif "configMap" in source:
                    self._files(where, self._configmap(source["configMap"]["name"], cluster_configmaps),
                                source["configMap"].get("items"), 0o644)
        return where

    def _configmap(self, name: str, cluster: dict[str, dict[str, str]]) -> dict[str, str]:
        if name in cluster:
            return cluster[name]
        data: dict[str, str] = _one(self.docs, "ConfigMap", name)["data"]
        return data

    @staticmethod
    def _files(where: Path, data: dict[str, str], items: list[dict[str, str]] | None, mode: int) -> None:
        chosen = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
        for key, path in chosen.items():
            (where / path).write_text(data[key])
            os.chmod(where / path, mode)

    def mounts(self, container: dict[str, Any]) -> dict[str, Path]:
        return {m["mountPath"]: self.volumes[m["name"]] for m in container.get("volumeMounts", [])}

    def host_path(self, container: dict[str, Any], path: str) -> str:
        """A container path, as this test reaches it (through the folder of the volume mounted there)."""
        for mount, folder in sorted(self.mounts(container).items(), key=lambda kv: -len(kv[0])):
            if path == mount or path.startswith(mount.rstrip("/") + "/"):
                return str(folder / path[len(mount):].lstrip("/"))
        return path

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in container.get("env", []):
            if "value" in e:
                out[e["name"]] = e["value"]
            elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
                out[e["name"]] = NODE
            elif "secretKeyRef" in e["valueFrom"]:
                ref = e["valueFrom"]["secretKeyRef"]
                found = [d for d in self.docs if d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"]]
                if found:
                    out[e["name"]] = base64.b64decode(found[0]["data"][ref["key"]]).decode()
                else:
                    assert ref.get("optional"), f"Secret {ref['name']} is not rendered and not optional"
        return out

    def command(self, container: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """The container's command line (the image's ENTRYPOINT is gpuhealth) with $(VAR) from its
        environment and container paths through the volumes; its config file read the same way."""
        env = self.env(container)
        args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in container["args"]]
        if "--config" in args:
            path = Path(self.host_path(container, args[args.index("--config") + 1]))
            path.write_text(yaml.safe_dump(self._through_mounts(container, yaml.safe_load(path.read_text()))))
        return [*CLI, *(self.host_path(container, a) if a.startswith("/") else a for a in args)], env

    def _through_mounts(self, container: dict[str, Any], value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._through_mounts(container, v) for k, v in value.items()}
        if isinstance(value, str) and value.startswith("/"):
            return self.host_path(container, value)
        return value


def _service_target(docs: list[dict[str, Any]], service: str, port_name: str, workload: tuple[str, str]) -> int:
    """The Service port named ``port_name`` must select the workload's pods and target a named container
    port of it: that container port."""
    svc = _one(docs, "Service", service)
    pod = _one(docs, *workload)["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [port] = [p for p in svc["spec"]["ports"] if p["name"] == port_name]
    container_ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    target = int(container_ports[port["targetPort"]])
    return target


def _run(tmp_path: Path, docs: list[dict[str, Any]], namespace: str, procs: list[Proc]) -> None:
    api = StandIn(tmp_path)
    api.start()
    try:
        account = f"system:serviceaccount:{namespace}:gpuhealth-agent"
        api.tokens = {"agent.pod.token": ServiceAccountToken(account, ["gpuhealth"], "agent-pod", "uid-a", node=NODE),
                      "other.pod.token": ServiceAccountToken(account, ["gpuhealth"], "agent-b", "uid-b", node="b")}
        tokens = {"gpuhealth": "agent.pod.token", None: api.credential}
        cluster = {"kube-root-ca.crt": {"ca.crt": Path(api.ca_file).read_text()}}
        host, port = api.url.removeprefix("https://").rsplit(":", 1)
        kube = {"KUBERNETES_SERVICE_HOST": host, "KUBERNETES_SERVICE_PORT": port}

        # -- the coordinator, as its Deployment says
        coord_pod = Pod(docs, "Deployment", "gpuhealth-coordinator", tmp_path / "coordinator", tokens=tokens,
                        cluster_configmaps=cluster)
        c = coord_pod.spec["containers"][0]
        args, env = coord_pod.command(c)
        grpc_port = _service_target(docs, "gpuhealth-coordinator", "grpc", ("Deployment", "gpuhealth-coordinator"))
        config_text = _one(docs, "ConfigMap", "gpuhealth-coordinator-config")["data"]["coordinator.yaml"]
        assert yaml.safe_load(config_text)["coordinator"]["listen"] == f"0.0.0.0:{grpc_port}"
        assert c["readinessProbe"]["grpc"]["port"] == grpc_port
        ready = tmp_path / "coordinator.ready"
        coord = Proc([*args, "--ready-file", str(ready)], tmp_path / "coordinator.log",
                     {**env, **kube, "GPUHEALTH_COORDINATOR_LISTEN": "0.0.0.0:0",
                      "GPUHEALTH_COORDINATOR_METRICS_LISTEN": "127.0.0.1:0"})
        procs.append(coord)
        until(lambda: ready.exists() or (not coord.alive() and pytest.fail(coord.log())), 30, "the coordinator")
        bound = json.loads(ready.read_text())["grpc_port"]
        address = f"127.0.0.1:{bound}"
        assert "WITHOUT authentication" not in coord.log()
        operator = env.get("GPUHEALTH_COORDINATOR_OPERATOR_TOKEN")

        # -- the agent, as its DaemonSet says (init containers first)
        agent_pod = Pod(docs, "DaemonSet", "gpuhealth-agent", tmp_path / "agent", tokens=tokens,
                        cluster_configmaps=cluster)
        for init in agent_pod.spec.get("initContainers", []):
            init_args, init_env = agent_pod.command(init)
            res = run_cli(*init_args[len(CLI):], env=init_env)
            assert res.returncode == 0, res.stderr
        a = agent_pod.spec["containers"][0]
        agent_args, agent_env = agent_pod.command(a)
        agent_cfg = yaml.safe_load(_one(docs, "ConfigMap", "gpuhealth-agent-config")["data"]["agent.yaml"])
        svc_port = next(p["port"] for p in _one(docs, "Service", "gpuhealth-coordinator")["spec"]["ports"]
                        if p["name"] == "grpc")
        # the agent finds the coordinator through its Service (here: the port it bound)
        assert agent_cfg["agent"]["coordinator"] == f"gpuhealth-coordinator.{namespace}.svc:{svc_port}"
        agent = Proc(agent_args, tmp_path / "agent.log",
                     {**agent_env, "GPUHEALTH_AGENT_LISTEN": "127.0.0.1:0", "GPUHEALTH_AGENT_COORDINATOR": address,
                      "GPUHEALTH_AGENT_NVML_SNAPSHOT": str(SCENARIO)})
        procs.append(agent)
        reader = {"GPUHEALTH_TOKEN": operator or "agent.pod.token"}

        def connected() -> bool:
            res = run_cli("fleet", "--coordinator", address, "--json", env=reader)
            return res.returncode in (0, 1) and any(n["name"] == NODE and n["connected"]
                                                    for n in json.loads(res.stdout)["nodes"])

        until(connected, 40, f"the agent connected with the chart's credentials:\n{agent.log()}")

        # -- an unauthenticated client, and another pod's credential for this node: refused
        cluster_secret = [d for d in docs
                          if d["kind"] == "Secret" and d["metadata"]["name"] == "gpuhealth-cluster-secret"]
        other = (node_token(base64.b64decode(cluster_secret[0]["data"]["secret"]).strip(), "b") if cluster_secret
                 else "other.pod.token")  # node b's credential, in the chart's kind
        codes = asyncio.run(_probes(address, other))
        assert codes == [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED], codes
        res = run_cli("fleet", "--coordinator", address)
        assert res.returncode == 3 and "UNAUTHENTICATED" in res.stderr, res.stderr
        if operator:  # the chart's operator token acts on nodes (past authorisation: no such job)
            res = run_cli("triage", "--job", "no-such-job", "--coordinator", address, env={"GPUHEALTH_TOKEN": operator})
            assert "no job 'no-such-job'" in res.stderr, res.stderr
    finally:
        api.stop()


async def _probes(address: str, other: str) -> list[grpc.StatusCode | None]:
    out: list[grpc.StatusCode | None] = []
    for node, md in ((NODE, ()), (NODE, token_metadata(other))):
        agent = SimAgent(address, node, metadata=md, incarnation="probe")
        try:
            await agent.register()
            out.append(None)
        except grpc.aio.AioRpcError as exc:
            out.append(exc.code())
        finally:
            await agent.close()
    return out


@pytest.fixture
def procs() -> Any:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


@pytest.mark.parametrize("values", [{}, {"auth": {"mode": "nodeSecret"}},
                                    {"agent": {"port": 9612}, "coordinator": {"port": 9610, "metricsPort": 9611}}],
                         ids=["token-review", "node-secret", "other-ports"])
def test_the_chart_runs_as_rendered_authenticated(tmp_path: Path, procs: list[Proc], values: dict[str, Any]) -> None:
    docs = _chart(values)
    if values.get("auth", {}).get("mode") == "nodeSecret":  # tokens minted by the init container, not projected
        assert not any("projected" in v for v in _one(docs, "DaemonSet", "gpuhealth-agent")["spec"]["template"]
                       ["spec"]["volumes"])
    _run(tmp_path, docs, NAMESPACE, procs)


def test_the_kustomize_base_runs_as_rendered_authenticated(tmp_path: Path, procs: list[Proc]) -> None:
    _run(tmp_path, kustomize("base"), "gpuhealth", procs)
