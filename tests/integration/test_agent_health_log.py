"""The journal tells a health change: a real ``gpuhealth agent --scenario`` subprocess, its log read back.

faulty_node.yaml: GPU 1 throttled (warning) and GPU 3's PCIe link at x8 (critical) from the start, then
XID 79 on GPU 5 one second in (here LATER_S in). Each is one line naming the finding (code, entity, message,
action); the sweeps after add nothing. A GPU reset clears the XID: the recovery is one line too.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
SCENARIO = Path(__file__).parents[1] / "fixtures" / "scenarios" / "faulty_node.yaml"


# Scenario time starts when the agent builds its fake NVML; the first sweep after it can take seconds on a
# loaded machine (four test workers on two cores). Events come this late so that the first sweep is over
# by then, and the change they make is a change from what it saw.
LATER_S = 6.0


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "gpuhealth.yaml"
    cfg.write_text(yaml.safe_dump({
        "collectors": {"fast_interval_s": 0.5, "slow_interval_s": 1.0},
        "agent": {"state_dir": str(tmp_path / "state"), "socket_path": str(tmp_path / "agent.sock")}}))
    return cfg


def _changes(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "health_change":
            out.append(rec)
    return out


def _run_agent(tmp_path: Path, scenario: Path, until: Any, settle_s: float) -> list[dict[str, Any]]:
    """Run the agent until ``until(changes)`` holds, then ``settle_s`` more (several sweeps); its changes."""
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen([GPUHEALTH, "agent", "--listen", "127.0.0.1:0", "--json-logs", "--config",
                                  str(_config(tmp_path)), "--scenario", str(scenario)],
                                 stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while not until(_changes(log)):
                assert agent.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            time.sleep(settle_s)
        finally:
            agent.send_signal(signal.SIGTERM)
            agent.wait(30)
    return _changes(log)


@pytest.mark.integration
def test_an_xid_that_takes_a_gpu_out_is_one_log_line_with_its_finding(tmp_path: Path) -> None:
    doc = yaml.safe_load(SCENARIO.read_text())
    [xid_event] = doc["events"]
    xid_event["at"] = LATER_S  # faulty_node.yaml's XID, later (above)
    scenario = tmp_path / "faulty_node.yaml"
    scenario.write_text(yaml.safe_dump(doc))
    changes = _run_agent(tmp_path, scenario, lambda c: any("xid.79" in r["codes"] for r in c), settle_s=3.0)
    by_subject: dict[str, list[dict[str, Any]]] = {}
    for rec in changes:
        by_subject.setdefault(rec["subject"], []).append(rec)
    gpu5 = "GPU-00000001-1111-2222-3333-444444440005"
    [xid] = by_subject[gpu5]  # one line, and no repeat in the sweeps after
    assert (xid["level"], xid["health"], xid["was"], xid["action"], xid["codes"]) == \
        ("warning", "unhealthy", "healthy", "reboot", ["xid.79"])
    assert xid["msg"].startswith(f"GPU 5 ({gpu5}) unhealthy (action reboot), was healthy: xid.79 [critical] on gpu "
                                 f"{gpu5}: XID 79 on GPU 5: GPU has fallen off the bus")
    # the faults present from the start: one line each, with the finding
    [gpu3] = by_subject["GPU-00000001-1111-2222-3333-444444440003"]
    assert gpu3["was"] == "start" and gpu3["codes"] == ["pcie.link_degraded"] and "x8" in gpu3["msg"]
    assert "(action drain)" in gpu3["msg"]
    [gpu1] = by_subject["GPU-00000001-1111-2222-3333-444444440001"]
    assert gpu1["health"] == "degraded" and gpu1["codes"] == ["throttle.hw_slowdown"]
    # the node was already unhealthy and needed a drain; the XID's reboot does not change that: one line
    [node] = by_subject["node"]
    assert (node["was"], node["health"], node["action"]) == ("start", "unhealthy", "drain")
    assert set(by_subject) == {gpu5, "GPU-00000001-1111-2222-3333-444444440003",
                               "GPU-00000001-1111-2222-3333-444444440001", "node"}


@pytest.mark.integration
def test_the_recovery_after_a_gpu_reset_is_one_log_line(tmp_path: Path) -> None:
    scenario = tmp_path / "reset.yaml"
    scenario.write_text(yaml.safe_dump({"recording": "nvml_h200x2.json", "events": [
        {"at": LATER_S, "type": "xid", "gpu": 0, "xid": 79, "detail": "GPU has fallen off the bus."},
        {"at": LATER_S + 1, "type": "lost", "gpu": 0}, {"at": LATER_S + 2, "type": "restore", "gpu": 0}]}))
    changes = _run_agent(tmp_path, scenario, lambda c: any(r["health"] == "healthy" for r in c), settle_s=2.0)
    gpu0 = [r for r in changes if r["subject"] != "node"]
    assert [(r["was"], r["health"]) for r in gpu0] == [("healthy", "unhealthy"), ("unhealthy", "healthy")]
    assert gpu0[1]["level"] == "info" and "recovered; cleared xid.79" in gpu0[1]["msg"]
    assert [(r["was"], r["health"]) for r in changes if r["subject"] == "node"] == \
        [("healthy", "unhealthy"), ("unhealthy", "healthy")]
