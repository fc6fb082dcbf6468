"""What an unscraped ``gpuhealth agent`` does between its checks (issue 34): its threads carry their names in the
kernel (``top -H``), the HTTP and rank-socket threads sleep until a socket is ready instead of waking every
second, and every collector still runs on its cadence (the freshness the benchmark reports)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from agent_process import AgentProcess

pytestmark = pytest.mark.integration


def _threads(pid: int) -> dict[int, tuple[str, int]]:
    """tid → (kernel name, context switches so far)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
        out[int(task.name)] = (comm, switches)
    return out


def test_an_unscraped_agent_names_its_threads_and_its_socket_threads_do_not_wake(tmp_path: Path) -> None:
    scenario = tmp_path / "eight.yaml"
    scenario.write_text("recording: nvml_h200x2.json\ngpu_count: 8\n")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"agent:\n  pod_resources_socket: {tmp_path / 'none.sock'}\n  socket_path: {tmp_path / 'a.sock'}\n")
    agent = AgentProcess(tmp_path, ["--config", str(cfg), "--scenario", str(scenario)])
    try:
        agent.wait_ready(timeout=90)
        time.sleep(1.0)  # the answer to /ready handed back
        first = _threads(agent.proc.pid)
        names = {name for name, _ in first.values()}
        assert {"gh-http", "gh-http-0", "gh-rankhub", "gh-scheduler", "gh-xid-events", "gh-c-telemetry",
                "gh-c-presence"} <= names, names
        time.sleep(6.0)  # no scrape meanwhile
        second = _threads(agent.proc.pid)
        woke = {first[t][0]: second[t][1] - first[t][1] for t in first if t in second}
        assert woke["gh-http"] <= 1 and woke["gh-rankhub"] <= 1, woke  # they woke every second: 6 each
        health = agent.health()["node"]
        now = health["time"]
        for c in health["collectors"]:  # every fast check still fresh (interval 5 s; generous for a loaded box)
            if c["lane"] == "fast":
                assert c["success"] and now - c["last_success_time"] < 12.0, c
    finally:
        agent.stop()
    # the rank socket's wire only, not the in-job hook (tracker, link, timing, control: loaded for nothing before)
    assert agent.modules()["instrument"] == ["gpuhealth.instrument", "gpuhealth.instrument.protocol"]
