"""The dashboard and the alert rules against the real thing: a running ``gpuhealth agent`` (replaying
the bundled H200 recording with an XID 79 on GPU 0), a running ``gpuhealth coordinator``, and a real
Prometheus server scraping both with our rule file loaded.

Proves: every metric name the dashboard and the rules use is exposed by the agent or the
coordinator; every dashboard query is valid PromQL that Prometheus evaluates without error; the
core panels have data; all rules evaluate healthy; the XID alert fires and the agent-down alert
does not; and GPU series carry the Slurm job and Kubernetes pod that hold each GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "gpuhealth.json"
RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"
SERVICE_MONITOR = REPO / "deploy" / "kubernetes" / "base" / "servicemonitor.yaml"
DCGM_DASHBOARD = REPO / "tests" / "fixtures" / "dcgm_dashboard_12239_queries.json"
GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
GPU0 = "GPU-00000000-1111-2222-3333-444444444440"
GPU1 = "GPU-00000001-1111-2222-3333-444444444441"
# Names Prometheus makes itself (not exposed by any target).
SYNTHETIC = {"up"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "sum", "max", "min", "avg", "count", "rate", "increase", "time", "vector",
                "label_values", "topk", "bottomk", "abs", "inf", "nan"}


def port_in_log(log: Path, pattern: str, procs: list[subprocess.Popen[bytes]]) -> int:
    """The port a server started on port 0 says it bound (the kernel picked a free one: no port is guessed
    here that another process could take first)."""
    found: list[int] = []

    def said() -> bool:
        m = re.search(pattern, log.read_text(errors="replace")) if log.exists() else None
        found[:] = [int(m.group(1))] if m else []
        return bool(found)

    wait_for(said, f"the port in {log.name}", procs=procs)
    return found[0]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(predicate: Any, what: str, timeout: float = 40.0, procs: list[subprocess.Popen[bytes]] = ()) -> Any:
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args[0]} exited with {p.returncode} while waiting for {what}"
        try:
            value = predicate()
            if value:
                return value
        except (OSError, ValueError, KeyError) as exc:
            last_exc = exc
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} (last error: {last_exc})")


# ------------------------------------------------------------------------------------------ fakes

def start_fake_kubelet(sock: Path) -> Any:
    """A kubelet PodResources v1 server on a unix socket: pod train-0 holds GPU 1."""
    import grpc

    from gpuhealth.proto.kubelet import api_pb2, api_pb2_grpc

    class Lister(api_pb2_grpc.PodResourcesListerServicer):
        def List(self, request: Any, context: Any) -> Any:
            return api_pb2.ListPodResourcesResponse(pod_resources=[api_pb2.PodResources(
                name="train-0", namespace="ml", containers=[api_pb2.ContainerResources(
                    name="trainer", devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpu",
                                                                      device_ids=[GPU1])])])])

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    return server


# ------------------------------------------------------------------------------------------ scrape config

def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def service_monitor_job(target: str, *, node: str, agent_pod: str) -> dict[str, Any]:
    """The scrape job prometheus-operator makes of the shipped agent ServiceMonitor, with a static
    target standing in for Kubernetes discovery (the same __meta_ labels): the operator's own
    relabelling first (it labels every target with the scraped pod's namespace/pod/container), then
    the ServiceMonitor's ``relabelings``, and its ``honorLabels``."""
    monitors = [d for d in yaml.safe_load_all(SERVICE_MONITOR.read_text()) if d]
    [endpoint] = next(m for m in monitors if m["metadata"]["name"] == "gpuhealth-agent")["spec"]["endpoints"]
    operator = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
        {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
    ]
    ours = [{_snake(k): v for k, v in r.items()} for r in endpoint.get("relabelings", [])]
    return {
        "job_name": "serviceMonitor/gpuhealth/gpuhealth-agent/0",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint["path"],
        "static_configs": [{"targets": [target], "labels": {
            "__meta_kubernetes_namespace": "gpuhealth", "__meta_kubernetes_service_name": "gpuhealth-agent",
            "__meta_kubernetes_pod_name": agent_pod, "__meta_kubernetes_pod_container_name": "agent",
            "__meta_kubernetes_pod_node_name": node}}],
        "relabel_configs": operator + ours,
    }


# ------------------------------------------------------------------------------------------ stack

def nic_tree(root: Path) -> None:
    """One InfiniBand port and one physical Ethernet NIC in a sysfs tree."""
    port = root / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
    (port / "counters").mkdir(parents=True)
    (root / "sys" / "class" / "infiniband" / "mlx5_0" / "hca_type").write_text("MT4129\n")
    for name, text in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("rate", "400 Gb/sec (4X NDR)"),
                       ("link_layer", "InfiniBand")):
        (port / name).write_text(text + "\n")
    for counter in ("port_xmit_wait", "symbol_error", "port_xmit_data"):
        (port / "counters" / counter).write_text("0\n")
    nic = root / "sys" / "class" / "net" / "ens1"
    (nic / "statistics").mkdir(parents=True)
    dev, drv = root / "sys" / "devices" / "ens1", root / "sys" / "bus" / "pci" / "drivers" / "ice"
    dev.mkdir(parents=True)
    drv.mkdir(parents=True)
    os.symlink(drv, dev / "driver")
    os.symlink(dev, nic / "device")
    for key, value in (("speed", 100000), ("duplex", "full"), ("operstate", "up"), ("carrier_changes", 2)):
        (nic / key).write_text(f"{value}\n")
    for counter in ("rx_errors", "tx_errors", "rx_dropped", "tx_dropped"):
        (nic / "statistics" / counter).write_text("0\n")


class Stack:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.agent_port = self.coord_port = self.coord_metrics_port = self.prom_port = 0  # bound on port 0

    def spawn(self, argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHEALTH_")}
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        self.procs.append(p)
        return p

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.root.glob("*.log"))

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def promql(self, expr: str) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        status, body = http_get(url)
        data: dict[str, Any] = json.loads(body)
        data["http_status"] = status
        return data


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with tempfile.TemporaryDirectory(prefix="ghd") as d:  # short: unix socket paths
        root = Path(d)
        s = Stack(root)
        # GPM answers (what an H200 under load reports) fill the DCGM dashboard's Tensor Core panel
        gpm = {"GpmMetrics": {"SM_UTIL": 90.0, "SM_OCCUPANCY": 40.0, "ANY_TENSOR_UTIL": 55.0, "DRAM_BW_UTIL": 60.0,
                              "GRAPHICS_UTIL": 95.0}}
        (root / "scenario.yaml").write_text(yaml.safe_dump({
            "recording": "nvml_h200x2.json",
            "overrides": {"0": gpm, "1": gpm},
            "events": [{"at": 0, "type": "xid", "gpu": 0, "xid": 79}],
        }))
        jobs = root / "slurm-jobs"
        jobs.mkdir()
        (jobs / "0").write_text("4242\n")  # the prolog's file for GPU index 0
        kubelet = start_fake_kubelet(root / "kubelet.sock")
        try:
            s.spawn([GPUHEALTH, "coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                     "--db", str(root / "coordinator.db"), "--evidence-dir", str(root / "evidence"),
                     "--ready-file", str(root / "coordinator.ports")], "coordinator")
            wait_for(lambda: (root / "coordinator.ports").exists(), "coordinator ports", procs=s.procs)
            ports = json.loads((root / "coordinator.ports").read_text())
            s.coord_port, s.coord_metrics_port = ports["grpc_port"], ports["metrics_port"]
            nic_tree(root / "sysroot")  # the node's NICs (a replay reads them from collectors.sysfs_root)
            (root / "agent.yaml").write_text(yaml.safe_dump({"collectors": {"sysfs_root": str(root / "sysroot")},
                                                             "agent": {
                "state_dir": str(root / "state"),
                "socket_path": str(root / "run" / "agent.sock"),
                "pod_resources_socket": str(root / "kubelet.sock"),
                "slurm_job_dir": str(jobs),
                "node_name": "node-a",
                "dcgm_schema": "4.8",  # dashboard 12239 as published queries dcgm-exporter 4.5-4.8's names
                "coordinator": f"127.0.0.1:{s.coord_port}",  # the link's own metrics, used by an alert
            }}))
            s.spawn([GPUHEALTH, "agent", "--config", str(root / "agent.yaml"), "--dcgm-compat", "--nvml-snapshot",
                     str(root / "scenario.yaml"), "--listen", "127.0.0.1:0"], "agent")
            s.agent_port = port_in_log(root / "agent.log", r"serving /metrics, /health, /ready on http://127\.0\.0\.1:(\d+)",
                                       s.procs)
            shutil.copy(RULES, root / "alerts.yaml")
            (root / "prometheus.yml").write_text(yaml.safe_dump({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                "rule_files": ["alerts.yaml"],
                "scrape_configs": [
                    # the agent as the shipped ServiceMonitor scrapes it (job label: its Service's name)
                    service_monitor_job(f"127.0.0.1:{s.agent_port}", node="node-a", agent_pod="gpuhealth-agent-x7k2p"),
                    {"job_name": "gpuhealth-coordinator",
                     "static_configs": [{"targets": [f"127.0.0.1:{s.coord_metrics_port}"]}]},
                ],
            }))
            wait_for(lambda: http_get(f"http://127.0.0.1:{s.agent_port}/ready")[0] == 200, "agent /ready",
                     procs=s.procs)
            # what a fabric probe's rank tells its node's agent (gpuhealth diag fabric --agent)
            fabric = urllib.request.Request(f"http://127.0.0.1:{s.agent_port}/fabric?" + urllib.parse.urlencode(
                {"name": "node-a", "verdict": "ok", "send_ratio": "0.98", "recv_ratio": "1.01", "nodes": "8"}),
                method="POST")
            with urllib.request.urlopen(fabric, timeout=10) as resp:
                assert resp.status == 200
            wait_for(lambda: http_get(f"http://127.0.0.1:{s.coord_metrics_port}/metrics")[0] == 200,
                     "coordinator /metrics", procs=s.procs)
            s.spawn([PROMETHEUS, f"--config.file={root / 'prometheus.yml'}",
                     f"--storage.tsdb.path={root / 'tsdb'}", "--web.listen-address=127.0.0.1:0"], "prometheus")
            s.prom_port = port_in_log(root / "prometheus.log", r'msg="Listening on" address=127\.0\.0\.1:(\d+)',
                                      s.procs)
            wait_for(lambda: http_get(f"http://127.0.0.1:{s.prom_port}/-/ready")[0] == 200, "prometheus ready",
                     procs=s.procs)
            wait_for(lambda: len(s.promql('up == 1')["data"]["result"]) == 2, "both targets up", procs=s.procs)
            # pod labels come from a TTL-cached provider: wait until a scrape carries them
            wait_for(lambda: s.promql('gpuhealth_gpu_info{pod="train-0"}')["data"]["result"], "pod labels",
                     procs=s.procs)
            yield s
        except BaseException:
            print(s.logs())
            raise
        finally:
            s.stop()
            kubelet.stop(grace=None)


# ------------------------------------------------------------------------------------------ helpers

def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            # label_values(SELECTOR, LABEL) → the selector, as an expression Prometheus can run
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            out.append((f"variable {var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    return [(r.get("alert") or r["record"], r["expr"])
            for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, label
    names (inside {}), or label names in by/on/without lists."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # drop string literals
    text = re.sub(r"\{[^}]*\}", "{}", text)  # drop matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = m.group(0)
        after = text[m.end():].lstrip()
        if word in PROMQL_WORDS or after.startswith("(") or word.startswith("$"):
            continue
        names.add(word)
    return names


def exposed_names(text: str) -> set[str]:
    """Series names in a /metrics page, plus family names from # TYPE (so an empty counter family
    counts: ``foo`` of TYPE counter answers to ``foo_total``)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind in ("summary", "histogram"):
                names |= {name + "_sum", name + "_count", name + "_bucket"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def substitute(expr: str) -> str:
    return expr.replace("$instance", ".+").replace("$gpu", ".+").replace("$job", ".*")


# ------------------------------------------------------------------------------------------ tests

def test_every_metric_used_is_exposed_by_a_running_agent_or_coordinator(stack: Stack) -> None:
    agent = http_get(f"http://127.0.0.1:{stack.agent_port}/metrics")[1]
    coord = http_get(f"http://127.0.0.1:{stack.coord_metrics_port}/metrics")[1]
    exposed = exposed_names(agent) | exposed_names(coord) | SYNTHETIC
    used: dict[str, set[str]] = {}
    for where, expr in [*dashboard_exprs(), *rule_exprs()]:
        for name in metric_names(expr):
            used.setdefault(name, set()).add(where)
    assert len(used) >= 30  # the parser found the names (a broken regex would find none)
    missing = {name: sorted(where) for name, where in used.items() if name not in exposed}
    assert missing == {}, f"used but not exposed: {missing}"


def test_metric_name_parser() -> None:
    expr = ('sum by (instance, code) (rate(gpuhealth_gpu_ecc_errors_total{scope="volatile", a=~"x|y"}[5m])) '
            '* on (instance) group_left (driver_version) gpuhealth_driver_info or vector(0)')
    assert metric_names(expr) == {"gpuhealth_gpu_ecc_errors_total", "gpuhealth_driver_info"}


def test_every_dashboard_query_evaluates_in_prometheus(stack: Stack) -> None:
    errors = []
    for title, expr in dashboard_exprs():
        result = stack.promql(substitute(expr))
        if result.get("status") != "success":
            errors.append(f"{title}: {result.get('error')} in {expr}")
    assert errors == []


@pytest.mark.parametrize(("title", "expected_series"), [
    ("GPU temperature", 4),  # 2 GPUs x (gpu, memory)
    ("Power", 4),
    ("SM clock", 4),
    ("Memory used", 2),
    ("ECC errors (rate)", 4),
    ("GPU inventory", 2),
    ("Active findings", 2),
    ("Collector success", 5),
    ("Agent CPU and memory", 2),
    ("Agents up", 1),
    ("GPUs", 1),
    ("Unhealthy GPUs", 1),
    ("Agents connected", 1),
    ("GPU health over time", 2),
    ("Agents: version, driver, NVML", 1),
    ("variable instance", 1),
    ("variable gpu", 2),
])
def test_core_panels_have_data(stack: Stack, title: str, expected_series: int) -> None:
    def rows() -> int:
        return sum(len(stack.promql(substitute(e))["data"]["result"]) for t, e in dashboard_exprs() if t == title)

    # rate() needs two scrapes; give Prometheus a few seconds
    n = wait_for(lambda: rows() >= expected_series and rows(), f"data in panel {title}", timeout=20)
    assert n >= expected_series


def test_agents_table_shows_the_driver_and_the_timeline_each_gpus_health(stack: Stack) -> None:
    exprs = dict(dashboard_exprs())
    [agent] = stack.promql(substitute(exprs["Agents: version, driver, NVML"]))["data"]["result"]
    assert agent["metric"]["driver"] == "580.159.04" and agent["metric"]["cuda"]  # the columns are filled
    timeline = stack.promql(substitute(exprs["GPU health over time"]))["data"]["result"]
    assert {r["metric"]["gpu"]: r["value"][1] for r in timeline} == {"0": "2", "1": "0"}  # XID 79 on GPU 0
    # a job chosen: only the GPUs Slurm gave it (GPU 0 holds job 4242)
    chosen = exprs["GPU health over time"].replace("$instance", ".+").replace("$gpu", ".+").replace("$job", "4242")
    assert [r["metric"]["gpu"] for r in stack.promql(chosen)["data"]["result"]] == ["0"]


def test_fleet_stats_count_the_unhealthy_gpu(stack: Stack) -> None:
    exprs = dict(dashboard_exprs())
    assert float(stack.promql(exprs["Unhealthy GPUs"])["data"]["result"][0]["value"][1]) == 1.0
    assert float(stack.promql(exprs["GPUs"])["data"]["result"][0]["value"][1]) == 2.0


def test_all_rules_evaluate_and_xid_alert_fires(stack: Stack) -> None:
    def rules() -> list[dict[str, Any]]:
        body = json.loads(http_get(f"http://127.0.0.1:{stack.prom_port}/api/v1/rules")[1])
        return [r for g in body["data"]["groups"] for r in g["rules"]]

    wait_for(lambda: all(r.get("lastEvaluation", "").startswith("20") for r in rules()), "rules evaluated")
    bad = {r["name"]: r.get("lastError") for r in rules() if r["health"] != "ok"}
    assert bad == {}
    assert len(rules()) == len(rule_exprs())

    def firing() -> dict[str, list[dict[str, Any]]]:
        body = json.loads(http_get(f"http://127.0.0.1:{stack.prom_port}/api/v1/alerts")[1])
        out: dict[str, list[dict[str, Any]]] = {}
        for a in body["data"]["alerts"]:
            if a["state"] == "firing":
                out.setdefault(a["labels"]["alertname"], []).append(a)
        return out

    alerts = wait_for(lambda: firing().get("GpuhealthXidFatal") and firing(), "GpuhealthXidFatal firing")
    (alert,) = alerts["GpuhealthXidFatal"]
    xid = alert["labels"]
    assert xid["code"] == "xid.79" and xid["gpu"] == "0" and xid["uuid"] == GPU0 and xid["severity"] == "critical"
    # keyed on the GPU, not on the job holding it (a new job would restart the alert); the job is named
    assert "slurm_job_id" not in xid
    assert alert["annotations"]["holder"] == "slurm job 4242"
    assert "GpuhealthAgentDown" not in alerts
    assert "GpuhealthCollectorFailing" not in alerts
    # The agent's link to the coordinator is up, as Prometheus sees it.
    wait_for(lambda: stack.promql("gpuhealth_agent_coordinator_connected == 1")["data"]["result"],
             "the agent's coordinator link up")


def test_gpu_series_carry_slurm_job_and_pod_attribution(stack: Stack) -> None:
    text = http_get(f"http://127.0.0.1:{stack.agent_port}/metrics")[1]
    info = [line for line in text.splitlines() if line.startswith("gpuhealth_gpu_info{")]
    by_uuid = {re.search(r'uuid="([^"]+)"', line).group(1): line for line in info}  # type: ignore[union-attr]
    assert 'slurm_job_id="4242"' in by_uuid[GPU0] and 'pod="' not in by_uuid[GPU0]
    assert 'pod="train-0"' in by_uuid[GPU1] and 'namespace="ml"' in by_uuid[GPU1]
    assert 'container="trainer"' in by_uuid[GPU1] and "slurm_job_id" not in by_uuid[GPU1]
    # and the alert on GPU 0 can be routed to the job's owner through the finding's labels
    findings = [line for line in text.splitlines() if line.startswith("gpuhealth_findings{") and GPU0 in line]
    assert findings and all('slurm_job_id="4242"' in line for line in findings)


def dcgm_dashboard_exprs() -> list[tuple[str, str]]:
    """dcgm-exporter's own dashboard (grafana.com 12239): its panels' queries and variables, as
    shipped (tests/fixtures/dcgm_dashboard_12239_queries.json, taken from its JSON)."""
    dash = json.loads(DCGM_DASHBOARD.read_text())
    out = [(p["title"], p["expr"]) for p in dash["panels"]]
    for var in dash["variables"]:
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"])
        assert m, var["query"]
        out.append((f"variable {var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return out


@pytest.mark.parametrize("panel", [t for t, _ in dcgm_dashboard_exprs()])
def test_dcgm_exporter_dashboard_works_with_dcgm_compat(stack: Stack, panel: str) -> None:
    """Every panel of the real dashboard 12239 has data from one gpuhealth agent, the Tensor Core
    panel included (NVML GPM), with the node named by instance as the ServiceMonitor sets it."""
    expr = dict(dcgm_dashboard_exprs())[panel].replace("$instance", "node-a").replace("$gpu", ".+")
    result = wait_for(lambda: stack.promql(expr)["data"]["result"], f"DCGM panel {panel}", timeout=20)
    per_gpu = panel not in ("GPU Avg. Temp", "GPU Power Total", "variable instance")
    assert len(result) == (2 if per_gpu else 1), result
    for series in result:
        # the recorded H200s were idle: utilization 0 is their true value, everything else is not 0
        assert float(series["value"][1]) > 0 or panel == "GPU Utilization"
        if "instance" in series["metric"]:
            assert series["metric"]["instance"] == "node-a"
    if panel == "Tensor Core Utilization":
        assert {float(r["value"][1]) for r in result} == {0.55}


def test_pod_attribution_survives_the_shipped_service_monitor(stack: Stack) -> None:
    """The GPU holder's pod/namespace reach Prometheus (and alerts) as pod/namespace, not as
    exported_pod; node-level series do not claim the agent's own pod; the agent pod is agent_pod."""
    [gpu1] = stack.promql(f'gpuhealth_gpu_info{{uuid="{GPU1}"}}')["data"]["result"]
    assert gpu1["metric"]["pod"] == "train-0" and gpu1["metric"]["namespace"] == "ml"
    assert gpu1["metric"]["container"] == "trainer" and gpu1["metric"]["instance"] == "node-a"
    assert gpu1["metric"]["agent_pod"] == "gpuhealth-agent-x7k2p" and gpu1["metric"]["job"] == "gpuhealth-agent"
    assert stack.promql('count({__name__=~"gpuhealth_.+|DCGM_.+", exported_pod=~".+"})')["data"]["result"] == []
    assert stack.promql('count({__name__=~"gpuhealth_.+|DCGM_.+", exported_namespace=~".+"})')["data"]["result"] == []
    [gpu0] = stack.promql(f'gpuhealth_gpu_info{{uuid="{GPU0}"}}')["data"]["result"]
    assert "pod" not in gpu0["metric"]  # a GPU nobody's pod holds
    [node] = stack.promql("gpuhealth_node_health")["data"]["result"]
    assert "pod" not in node["metric"] and "namespace" not in node["metric"]
    [dcgm] = stack.promql(f'DCGM_FI_DEV_GPU_TEMP{{UUID="{GPU1}"}}')["data"]["result"]
    assert dcgm["metric"]["pod"] == "train-0"


def test_kubernetes_probe_targets_answer(stack: Stack) -> None:
    # what the DaemonSet's liveness/readiness probes and the Deployment's gRPC probes ask
    assert http_get(f"http://127.0.0.1:{stack.agent_port}/health")[0] == 200
    assert http_get(f"http://127.0.0.1:{stack.agent_port}/ready")[0] == 200
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{stack.coord_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_screening_coverage_alert_reads_what_the_coordinator_exports(stack: Stack) -> None:
    """The coordinator knows the agent's 2 GPUs, none screened yet: coverage 0, so the rule matches
    the real series and its alert is pending (it fires only after 6 h); its description's query
    finds the oldest-age series."""
    [coverage] = wait_for(lambda: stack.promql("gpuhealth_fleet_screen_coverage_ratio")["data"]["result"],
                          "the coordinator's coverage in Prometheus")
    assert float(coverage["value"][1]) == 0.0 and coverage["metric"]["job"] == "gpuhealth-coordinator"
    instance = coverage["metric"]["instance"]
    [age] = stack.promql(f'max(gpuhealth_fleet_screen_oldest_age_seconds{{instance="{instance}"}})')["data"]["result"]
    assert float(age["value"][1]) >= 0

    def pending() -> list[dict[str, Any]]:
        body = json.loads(http_get(f"http://127.0.0.1:{stack.prom_port}/api/v1/alerts")[1])
        return [a for a in body["data"]["alerts"] if a["labels"]["alertname"] == "GpuhealthScreeningCoverageLow"]

    [alert] = wait_for(pending, "GpuhealthScreeningCoverageLow pending")
    assert alert["state"] == "pending" and alert["labels"]["instance"] == instance
    description = alert["annotations"]["description"]
    assert description.startswith("Only 0% of the GPUs the coordinator") and " ago." in description, description
