"""The agent's ``/health`` is the ``status --json`` document from the same builder, plus what only a
running agent knows. Both are golden files; this one is checked against the other.

Regenerate after a deliberate change with ``GPUHEALTH_UPDATE_GOLDEN=1 pytest tests/unit/agent/`` and
review the diff like code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agent_testing import wait_for

from gpuhealth.agent.daemon import Agent
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.config import Config
from gpuhealth.runtime.sdnotify import SystemdNotifier

GOLDEN = Path(__file__).parents[2] / "golden"
UPDATE = os.environ.get("GPUHEALTH_UPDATE_GOLDEN") == "1"
AGENT_ONLY_NODE_KEYS = {"ready", "agent_version"}
AGENT_ONLY_COLLECTOR_KEYS = {"last_success_time", "runs_total", "errors_total", "timeouts_total"}


def _health_of_agent(recording: Path) -> dict[str, Any]:
    cfg = Config()
    cfg.agent.node_name = "golden-node"
    cfg.agent.pod_resources_socket = "/nonexistent/kubelet.sock"
    cfg.collectors.disabled = ["host"]  # reads the machine running the test, as in the status golden
    cfg.collectors.fast_interval_s = cfg.collectors.slow_interval_s = 3600.0  # no second sweep
    agent = Agent(cfg, FakeNvml.from_file(recording), extensions=[], serve_http=False,
                  notifier=SystemdNotifier(env={}))
    agent.start()
    try:
        wait_for(lambda: agent.ready, what="the first sweep")
        return agent.node_report()
    finally:
        agent.stop()


def _normalise(doc: dict[str, Any]) -> dict[str, Any]:
    node = doc["node"]
    node["time"] = 0
    node["backend"] = Path(node["backend"].removeprefix("simulated from ")).name
    for c in node["collectors"]:
        c["duration_s"] = 0
        if "last_success_time" in c:
            # A collector that needs no NVML may run once more when NVML comes up: runs, not errors, vary.
            assert c["runs_total"] >= 1 and c["errors_total"] == c["timeouts_total"] == 0, c
            c["last_success_time"], c["runs_total"] = 0, 1
    return doc


def test_health_matches_golden_on_the_real_recording(h200_recording: Path) -> None:
    doc = _normalise(_health_of_agent(h200_recording))
    path = GOLDEN / "health_h200x2.json"
    if UPDATE:
        path.write_text(json.dumps(doc, indent=2) + "\n")
    assert doc == json.loads(path.read_text())
    assert doc["node"]["ready"] is True and doc["node"]["nvml_up"] is True
    assert all(c["success"] for c in doc["node"]["collectors"])


def test_health_is_status_json_plus_what_only_an_agent_knows() -> None:
    status = json.loads((GOLDEN / "status_h200x2.json").read_text())
    health = json.loads((GOLDEN / "health_h200x2.json").read_text())
    assert health["gpus"] == status["gpus"]
    assert health["findings"] == status["findings"]
    extra = set(health["node"]) - set(status["node"])
    assert extra == AGENT_ONLY_NODE_KEYS
    assert {k: v for k, v in health["node"].items() if k not in extra | {"collectors"}} == {
        k: v for k, v in status["node"].items() if k != "collectors"}
    assert [c["name"] for c in health["node"]["collectors"]] == [c["name"] for c in status["node"]["collectors"]]
    for h, s in zip(health["node"]["collectors"], status["node"]["collectors"], strict=True):
        assert set(h) - set(s) == AGENT_ONLY_COLLECTOR_KEYS
        assert {k: v for k, v in h.items() if k in s} == s
