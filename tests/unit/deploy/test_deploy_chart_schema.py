"""The chart refuses a config the binary would refuse (issue 32, item 3): ``agent.config`` and
``coordinator.config`` are checked at render against the JSON Schema generated from the config dataclasses
(``scripts/gen_chart_schema.py``), so a typo fails ``helm install`` instead of crash-looping every pod. And the
Secrets the chart generates survive an upgrade: rendered by Helm's engine against a stand-in API server, the
``lookup`` finds the installed Secret and its value is kept."""

from __future__ import annotations

import base64
import importlib.util
import json
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import helm_python as helm
import pytest
import yaml

from gpuhealth.config import Config, ConfigError, json_schema, load_config

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "deploy" / "helm" / "gpuhealth"
NS = "gpu-mon"


def gen_chart_schema() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_chart_schema", REPO / "scripts" / "gen_chart_schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_schema_is_the_generated_one() -> None:
    text = (CHART / "values.schema.json").read_text()
    assert json.loads(text)["definitions"]["gpuhealthConfig"] == json_schema()
    assert gen_chart_schema().render(text, json_schema()) == text, "run scripts/gen_chart_schema.py"
    schema = json.loads(text)["properties"]
    assert schema["agent"]["properties"]["config"] == {"$ref": "#/definitions/gpuhealthConfig"}
    assert schema["coordinator"]["properties"]["config"] == {"$ref": "#/definitions/gpuhealthConfig"}


@pytest.mark.parametrize(("values", "named"), [
    ({"agent": {"config": {"collectors": {"fast_interval": 3}}}}, "fast_interval"),  # the typo
    ({"agent": {"config": {"colectors": {"fast_interval_s": 3}}}}, "colectors"),
    ({"agent": {"config": {"collectors": {"fast_interval_s": 0}}}}, "/agent/config/collectors/fast_interval_s"),
    ({"agent": {"config": {"collectors": {"history_len": 2.5}}}}, "/agent/config/collectors/history_len"),
    ({"agent": {"config": {"agent": {"json_logs": "maybe"}}}}, "/agent/config/agent/json_logs"),
    ({"agent": {"config": {"agent": {"dcgm_hostname_label": "HOSTNAME"}}}}, "dcgm_hostname_label"),
    ({"agent": {"config": {"diag": {"busbw_min_fraction": 1.5}}}}, "/agent/config/diag/busbw_min_fraction"),
    ({"coordinator": {"config": {"coordinator": {"hang_k": 0}}}}, "/coordinator/config/coordinator/hang_k"),
    ({"coordinator": {"config": {"coordinator": {"retention": 30}}}}, "retention"),
])
def test_a_config_typo_fails_the_render(chart: Any, values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=named):
        chart.render(values, name="gh", namespace=NS, is_install=True)


def test_every_key_at_its_default_renders(chart: Any) -> None:
    """The schema takes every key the binary has, at its default, in both configs (paths and listen addresses
    the chart sets itself are left out: the templates refuse those with their own line)."""
    defaults = Config()
    kept_by_chart = {"listen", "metrics_listen", "state_dir", "socket_path", "pod_resources_socket", "db_path",
                     "evidence_dir", "screen_block_dir", "coordinator", "node_name"}
    cfg: dict[str, Any] = {}
    for section, keys in json_schema()["properties"].items():
        cfg[section] = {k: getattr(getattr(defaults, section), k) for k in keys["properties"] if k not in kept_by_chart}
    chart.render({"agent": {"config": cfg}, "coordinator": {"config": cfg}}, name="gh", namespace=NS, is_install=True)


def _loader_accepts(cfg: dict[str, Any]) -> bool:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c.yaml"
        path.write_text(yaml.safe_dump(cfg))
        try:
            load_config(path, env={})
        except ConfigError:
            return False
        return True


def _schema_accepts(chart: Any, cfg: dict[str, Any]) -> bool:
    try:
        chart.validate_schema({"agent": {"config": cfg}})
    except helm.HelmValuesError:
        return False
    return True


@pytest.mark.parametrize("cfg", [
    {"collectors": {"fast_interval_s": 0.001}},
    {"collectors": {"fast_interval_s": 86_400}},
    {"collectors": {"fast_interval_s": 86_401}},
    {"collectors": {"fast_interval_s": -1}},
    {"collectors": {"history_len": 1}},
    {"collectors": {"history_len": 0}},
    {"collectors": {"history_len": 3.0}},
    {"collectors": {"expected_gpus": 8}},
    {"collectors": {"expected_gpus": 5000}},
    {"collectors": {"disabled": ["xid", "ecc"]}},
    {"collectors": {"disabled": "xid,ecc"}},
    {"collectors": {"disabled": [{"a": 1}]}},
    {"collectors": {"sysfs_root": ["/"]}},
    {"agent": {"json_logs": True}},
    {"agent": {"node_name": 12}},
    {"agent": {"node_name": "x" * 4097}},
    {"agent": {"dcgm_hostname_label": "hostname"}},
    {"agent": {"dcgm_hostname_label": "host"}},
    {"diag": {"bandwidth_pcie_fraction": 0}},
    {"diag": {"bandwidth_pcie_fraction": 1}},
    {"coordinator": {"screen_concurrency": 0}},
    {"coordinator": {"screen_concurrency": 1}},
    {"zerocode": {"keep_evidence": 0}},
    {"zerocode": {"nope": 1}},
    {"nope": {}},
], ids=lambda c: json.dumps(c)[:60])
def test_the_schema_judges_as_the_loader_does(chart: Any, cfg: dict[str, Any]) -> None:
    """(A null in values is no case: Helm removes the key before the schema and the template see it.)"""
    assert _schema_accepts(chart, cfg) == _loader_accepts(cfg)


# ------------------------------------------------------------------------------ generated Secrets kept
class _StandInApiServer:
    """Enough of a Kubernetes API server for Helm's ``lookup`` of a Secret: discovery of v1 and GET of one
    Secret (404 for any other), over plain HTTP on loopback."""

    def __init__(self, secrets: dict[tuple[str, str], dict[str, str]]) -> None:
        self.secrets = secrets
        self.asked: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_GET(self) -> None:  # http.server's name
                path = self.path.split("?")[0]
                outer.asked.append(path)
                parts = path.strip("/").split("/")
                body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "reason": "NotFound", "code": 404}
                code = 404
                if path == "/api/v1":
                    code, body = 200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                        {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                         "verbs": ["get", "list"]}]}
                elif len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "secrets":
                    data = outer.secrets.get((parts[3], parts[5]))
                    if data is not None:
                        code, body = 200, {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": data,
                                           "metadata": {"name": parts[5], "namespace": parts[3]}}
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> _StandInApiServer:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def _secrets(out: dict[str, str]) -> dict[str, dict[str, str]]:
    docs = [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    return {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "Secret"}


@pytest.fixture()
def installed() -> Iterator[_StandInApiServer]:
    kept = {(NS, "gpuhealth-cluster-secret"): {"secret": base64.b64encode(b"c" * 48).decode()},
            (NS, "gpuhealth-operator-token"): {"token": base64.b64encode(b"o" * 48).decode()}}
    with _StandInApiServer(kept) as api:
        yield api


def test_an_upgrade_keeps_the_generated_secrets(chart: Any, installed: _StandInApiServer) -> None:
    """Rendered cluster-aware (what ``helm upgrade`` does), the chart's lookup finds both installed Secrets and
    renders their values, not new random ones."""
    with helm.Config(kube_apiserver=installed.url, kube_token="test", namespace=NS) as cluster:
        out = cluster.render(chart, {"auth": {"mode": "nodeSecret"}}, name="gh", namespace=NS, is_upgrade=True)
    secrets = _secrets(out)
    assert base64.b64decode(secrets["gpuhealth-cluster-secret"]["secret"]) == b"c" * 48
    assert base64.b64decode(secrets["gpuhealth-operator-token"]["token"]) == b"o" * 48
    assert f"/api/v1/namespaces/{NS}/secrets/gpuhealth-cluster-secret" in installed.asked
    assert f"/api/v1/namespaces/{NS}/secrets/gpuhealth-operator-token" in installed.asked


def test_a_first_install_generates_and_an_offline_render_cannot_keep(chart: Any) -> None:
    """Where nothing is installed the values are new and random (48 characters) at each render — which is also
    what ``helm template`` (no cluster: a GitOps tool rendering offline) does: such a tool needs
    ``auth.existingSecret`` / ``auth.existingOperatorSecret`` (deploy/helm/gpuhealth/README.md)."""
    with _StandInApiServer({}) as api, helm.Config(kube_apiserver=api.url, kube_token="t", namespace=NS) as cluster:
        first = _secrets(cluster.render(chart, {"auth": {"mode": "nodeSecret"}}, name="gh", namespace=NS,
                                        is_install=True))
    second = _secrets(chart.render({"auth": {"mode": "nodeSecret"}}, name="gh", namespace=NS, is_install=True))
    for name, key in (("gpuhealth-cluster-secret", "secret"), ("gpuhealth-operator-token", "token")):
        assert len(base64.b64decode(first[name][key])) == 48
        assert first[name][key] != second[name][key]
