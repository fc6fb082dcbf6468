"""A real Prometheus server scrapes a real agent process running a faulty 8-GPU scenario; the
alert-relevant series are in Prometheus with the right labels (queried through its HTTP API).

Scenario ``faulty_node.yaml`` (the shared fault fixture): 8 H200s cloned from the real recording,
GPU 3 trained down to PCIe x8, GPU 1 in HW slowdown, XID 79 on GPU 5 (at 1 s).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_process import AgentProcess, http_get, prometheus_port

pytestmark = pytest.mark.integration

SCENARIO = Path(__file__).parents[1] / "fixtures" / "scenarios" / "faulty_node.yaml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AgentProcess, str]]:
    work = tmp_path_factory.mktemp("scrape")
    cfg = work / "agent.yaml"
    cfg.write_text(yaml.safe_dump({"collectors": {"fast_interval_s": 1.0, "slow_interval_s": 2.0},
                                   "agent": {"node_name": "gpu-node-7", "socket_path": str(work / "agent.sock"),
                                             "dcgm_schema": "4.8",  # the names dashboard 12239 queries
                                             "pod_resources_socket": str(work / "no-kubelet.sock")}}))
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(SCENARIO), "--dcgm-compat"])
    (work / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "gpuhealth", "static_configs": [{"targets": [f"127.0.0.1:{agent.port}"]}]}],
    }))
    prom_log = (work / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         "--web.listen-address=127.0.0.1:0", "--storage.tsdb.retention.time=1h"],
        stdout=prom_log, stderr=subprocess.STDOUT,
    )
    try:
        prom_url = f"http://127.0.0.1:{prometheus_port(work / 'prometheus.log', prom)}"
        agent.wait_ready()
        _wait(lambda: _query(prom_url, 'up{job="gpuhealth"} == 1'), 40, "Prometheus to scrape the agent",
              lambda: (work / "prometheus.log").read_text(errors="replace")[-3000:])
        # wait until a scrape after the first full sweep (findings and XIDs are in)
        _wait(lambda: _query(prom_url, 'gpuhealth_findings{code="xid.79"}'), 30, "findings to reach Prometheus")
        yield agent, prom_url
    finally:
        prom.terminate()
        prom.wait(10)
        prom_log.close()
        agent.stop()


def _query(prom_url: str, promql: str) -> list[dict[str, Any]]:
    code, body = http_get(f"{prom_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}), timeout=5)
    if code != 200:
        return []
    data = json.loads(body)
    assert data["status"] == "success", data
    return data["data"]["result"]  # type: ignore[no-any-return]


def _wait(fn: Any, timeout: float, what: str, detail: Any = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            out = fn()
        except OSError:
            out = None
        if out:
            return out
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{detail()}" if detail else ""))


def _by_gpu(result: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["metric"]["gpu"]: r for r in result}


def test_degraded_pcie_link_is_in_prometheus_on_gpu_3(stack: tuple[AgentProcess, str]) -> None:
    _, prom = stack
    width = _by_gpu(_query(prom, 'gpuhealth_gpu_pcie_link_width{which="current"}'))
    assert sorted(width, key=int) == [str(i) for i in range(8)]
    assert width["3"]["value"][1] == "8" and width["0"]["value"][1] == "16"
    m = width["3"]["metric"]
    assert m["uuid"].startswith("GPU-") and m["pci_bus_id"] and m["model_name"] == "NVIDIA H200"
    assert m["job"] == "gpuhealth" and "hostname" not in m
    [finding] = _query(prom, 'gpuhealth_findings{code="pcie.link_degraded"}')
    assert finding["metric"]["gpu"] == "3" and finding["metric"]["severity"] == "critical"
    assert finding["metric"]["uuid"] == m["uuid"]


def test_xid_79_is_counted_by_code_on_gpu_5_and_the_gpu_is_unhealthy(stack: tuple[AgentProcess, str]) -> None:
    _, prom = stack
    [xid] = _query(prom, 'gpuhealth_gpu_xid_errors_total{xid="79"}')
    assert xid["metric"]["gpu"] == "5" and float(xid["value"][1]) >= 1
    [finding] = _query(prom, 'gpuhealth_findings{code="xid.79",severity="critical"}')
    assert finding["metric"]["gpu"] == "5" and finding["metric"]["action"] == "reboot"
    unhealthy = _by_gpu(_query(prom, "gpuhealth_gpu_health == 2"))
    assert set(unhealthy) == {"3", "5"}


def test_hw_slowdown_on_gpu_1(stack: tuple[AgentProcess, str]) -> None:
    _, prom = stack
    active = _by_gpu(_query(prom, 'gpuhealth_gpu_throttle_reason_active{reason="hw_slowdown"} == 1'))
    assert set(active) == {"1"}
    [finding] = _query(prom, 'gpuhealth_findings{code="throttle.hw_slowdown"}')
    assert finding["metric"]["gpu"] == "1"
    assert _by_gpu(_query(prom, "gpuhealth_gpu_health"))["1"]["value"][1] == "1"  # degraded


def test_dcgm_exporter_names_and_labels_reach_prometheus(stack: tuple[AgentProcess, str]) -> None:
    _, prom = stack
    [xid] = _query(prom, 'DCGM_FI_DEV_XID_ERRORS{gpu="5"}')
    assert xid["value"][1] == "79"
    assert set(xid["metric"]) >= {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "err_code",
                                  "err_msg",
                                  "DCGM_FI_DRIVER_VERSION"}
    assert xid["metric"]["Hostname"] == "gpu-node-7" and xid["metric"]["device"] == "nvidia5"
    assert xid["metric"]["err_code"] == "79" and xid["metric"]["err_msg"] == "GPU has fallen off the bus"
    [width] = _query(prom, 'DCGM_FI_DEV_PCIE_LINK_WIDTH{gpu="3"}')
    assert width["value"][1] == "8"
    # the standard dashboard's queries (grafana.com 12239) have data
    for expr in ('DCGM_FI_DEV_GPU_TEMP{instance=~".*", gpu=~".*"}', "sum(DCGM_FI_DEV_POWER_USAGE)",
                 "DCGM_FI_DEV_SM_CLOCK * 1000000", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"):
        assert _query(prom, expr), expr
    assert len(_query(prom, "DCGM_FI_DEV_GPU_TEMP")) == 8


def test_collector_health_and_simulated_flag_are_scraped(stack: tuple[AgentProcess, str]) -> None:
    _, prom = stack
    ok = {r["metric"]["collector"]: r["value"][1] for r in _query(prom, "gpuhealth_collector_success")}
    assert {"presence", "xid", "pcie", "throttle", "telemetry"} <= set(ok)
    assert ok["pcie"] == "1"
    assert _query(prom, "gpuhealth_simulated == 1")
    assert _query(prom, 'gpuhealth_build_info{simulated="true"}')


def test_the_readme_command_shows_the_xid_only_the_agent_sees(stack: tuple[AgentProcess, str]) -> None:
    """README: `gpuhealth status --agent 127.0.0.1:9502` against an agent on faulty_node.yaml shows the
    XID 79 on GPU 5 (which a one-shot status does not: tests/unit/test_readme_claims.py) — run as written,
    on this agent's port, in the README's address form (no scheme)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "`gpuhealth status --agent 127.0.0.1:9502`" in " ".join(readme.split())
    agent, _ = stack
    gpuhealth = str(Path(sys.executable).parent / "gpuhealth")
    out = subprocess.run([gpuhealth, "status", "--agent", f"127.0.0.1:{agent.port}", "--json"],
                         capture_output=True, text=True, timeout=60)
    doc = json.loads(out.stdout)
    assert doc["source"] == "agent", out.stderr  # the agent answered, not a fallback sweep
    found = {(g["index"], f["code"]) for g in doc["gpus"] for f in g["findings"]}
    assert (5, "xid.79") in found and (3, "pcie.link_degraded") in found and (1, "throttle.hw_slowdown") in found
    assert out.returncode == 2  # unhealthy, in the default profile
    human = subprocess.run([gpuhealth, "status", "--agent", f"127.0.0.1:{agent.port}"], capture_output=True,
                           text=True, timeout=60)
    assert "xid.79" in human.stdout
