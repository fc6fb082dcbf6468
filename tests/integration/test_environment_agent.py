"""The environment reaches everything an operator reads from a running agent: ``/health`` (node.environment),
``/metrics`` (gpuhealth_node_environment_info), and the verdict the scheduler hooks act on — a cloud VM guest whose
host runs the NVSwitch fabric is healthy and fit; the same board on bare metal with the Fabric Manager stopped
drains."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
VM_GUEST = {"virtualization": "vm", "container": False, "host_pid_namespace": True,
            "host_network_namespace": True, "nvswitches_visible": 0, "evidence": ["CPU flag 'hypervisor'"]}
BARE_METAL = {"virtualization": "none", "container": False, "host_pid_namespace": True,
              "host_network_namespace": True, "nvswitches_visible": 4}


def _agent(tmp_path: Path, environment: dict[str, Any]) -> Any:
    from agent_process import AgentProcess

    scenario = tmp_path / "node.yaml"
    scenario.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json",
                                        "system": {"fabric_manager": "stopped", "environment": environment}}))
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(yaml.safe_dump({
        "collectors": {"fast_interval_s": 1.0, "slow_interval_s": 1.0},
        "agent": {"node_name": "n1", "socket_path": str(tmp_path / "agent.sock"), "state_dir": str(tmp_path / "st"),
                  "pod_resources_socket": str(tmp_path / "none.sock")}}))
    work = tmp_path / "agent"
    work.mkdir()
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(scenario)])
    agent.wait_ready()
    return agent


@pytest.fixture
def vm_agent(tmp_path: Path) -> Iterator[Any]:
    agent = _agent(tmp_path, VM_GUEST)
    try:
        yield agent
    finally:
        agent.stop()


def _status(url: str, profile: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "gpuhealth"), "status", "--agent", url, "--exit-codes", profile, "--json"],
                          capture_output=True, text=True, timeout=60, check=False)


def test_a_vm_guest_is_healthy_and_says_where_it_runs(vm_agent: Any) -> None:
    health = vm_agent.health()
    assert (health["node"]["health"], health["node"]["action"]) == ("healthy", "none")
    assert health["node"]["environment"]["kind"] == "VM guest"
    assert health["node"]["environment"]["nvswitches_visible"] == 0
    [fm] = [f for f in health["findings"] if f["code"].startswith("fabric.manager")]
    assert (fm["code"], fm["severity"]) == ("fabric.manager_unobserved", "info")
    code, metrics = vm_agent.get("/metrics")
    assert code == 200
    assert ('gpuhealth_node_environment_info{kind="VM guest",virtualization="vm",container="false",'
            'host_pid_namespace="true",host_network_namespace="true",nvswitches_visible="0"} 1.0') in metrics
    for profile in ("slurm", "npd", "default"):
        assert _status(vm_agent.url, profile).returncode == 0
    human = subprocess.run([str(BIN / "gpuhealth"), "status", "--agent", vm_agent.url], capture_output=True,
                           text=True, timeout=60, check=False)
    assert "Environment: VM guest" in human.stdout and "HEALTHY" in human.stdout


def test_bare_metal_with_the_manager_stopped_drains(tmp_path: Path) -> None:
    agent = _agent(tmp_path, BARE_METAL)
    try:
        health = agent.health()
        assert (health["node"]["health"], health["node"]["action"]) == ("unhealthy", "drain")
        out = _status(agent.url, "slurm")
        assert out.returncode == 1
        assert [f["code"] for f in json.loads(out.stdout)["findings"] if f["severity"] != "info"] == \
            ["fabric.manager_down"]
    finally:
        agent.stop()
