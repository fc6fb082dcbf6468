"""``gpuhealth status --json`` and a running agent's ``/health`` are one document from one builder
(node.assemble_report): the node's driver and CUDA driver versions and whether NVML is up are in both,
equal, on the same recording — ``status --json`` lacked them (issue 32). Only what a running agent alone
knows (ready, its version, per-collector run counts) is the agent's own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from commands import Agent, run_cli, write_config

pytestmark = pytest.mark.integration

RECORDING = "nvml_h200x2.json"  # the bundled real 2 x H200 recording (driver 580.159.04, CUDA 13.0)
AGENT_ONLY = {"ready", "agent_version"}
VARYING = {"time", "collectors", "environment"}  # each process reads its own clock and machine


def _config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "agent.yaml", {
        "agent": {"nvml_snapshot": RECORDING, "listen": "127.0.0.1:0", "node_name": "n1",
                  "state_dir": str(tmp_path / "state"), "socket_path": str(tmp_path / "r.sock"),
                  "pod_resources_socket": str(tmp_path / "none.sock")},
        "collectors": {"disabled": ["host"]},
        "diag": {"enabled": False}})


def test_status_json_and_health_carry_the_same_node_facts(tmp_path: Path) -> None:
    config = _config(tmp_path)
    result = run_cli("status", "--json", "--config", str(config))
    assert result.returncode == 0, result.stderr
    status: dict[str, Any] = json.loads(result.stdout)["node"]
    agent = Agent(tmp_path / "agent", config)
    try:
        agent.wait_ready()
        health: dict[str, Any] = agent.health()["node"]
    finally:
        agent.stop()
    assert status["driver_version"] == health["driver_version"] == "580.159.04"
    assert status["cuda_driver_version"] == health["cuda_driver_version"] == "13000"
    assert status["nvml_up"] is health["nvml_up"] is True
    assert set(health) - set(status) == AGENT_ONLY
    assert {k: v for k, v in status.items() if k not in VARYING} == {
        k: v for k, v in health.items() if k not in VARYING | AGENT_ONLY}
