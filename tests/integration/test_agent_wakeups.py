"""What an unscraped ``gpuhealth agent`` does between its checks (issue 34): its threads carry their names in the
kernel (``top -H``), the HTTP and rank-socket threads sleep until a socket is ready instead of waking every
second, and every collector still runs on its cadence (the freshness the benchmark reports)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from agent_process import AgentProcess

pytestmark = pytest.mark.integration


def _family(pid: int) -> list[int]:
    """The agent and its children (the rank socket is served by an unprivileged child: docs/security.md)."""
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                continue
    return pids


def _threads(pid: int) -> dict[int, tuple[str, int]]:
    """tid → (kernel name, context switches so far), over the agent and its children."""
    out = {}
    tasks = [t for p in _family(pid) for t in Path(f"/proc/{p}/task").iterdir()]
    for task in tasks:
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
        assert woke["gh-xid-events"] <= 5, woke  # NVML's event wait returned every 500 ms: 12
        health = agent.health()["node"]
        now = health["time"]
        for c in health["collectors"]:  # every fast check still fresh (interval 5 s; generous for a loaded box)
            if c["lane"] == "fast":
                assert c["success"] and now - c["last_success_time"] < 12.0, c
    finally:
        agent.stop()
    # the rank socket's wire only, not the in-job hook (tracker, link, timing, control: loaded for nothing before)
    assert agent.modules()["instrument"] == ["gpuhealth.instrument", "gpuhealth.instrument.protocol"]


def test_an_xid_event_still_reaches_health_on_the_next_sweep_with_the_longer_event_wait(tmp_path: Path) -> None:
    """The XID pump now waits 2 s per call instead of 0.5 s; an event ends the wait at once, so the XID is on
    /health at the xid collector's next run (fast lane 1 s here), not up to a wait later."""
    scenario = tmp_path / "xid.yaml"
    scenario.write_text("recording: nvml_h200x2.json\nevents:\n  - {at: 8, type: xid, gpu: 1, xid: 79}\n")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"agent:\n  pod_resources_socket: {tmp_path / 'none.sock'}\n  socket_path: {tmp_path / 'a.sock'}\n"
                   "collectors:\n  fast_interval_s: 1\n")
    started = time.monotonic()  # the scenario's clock starts a little later, when the agent loads it
    agent = AgentProcess(tmp_path, ["--config", str(cfg), "--scenario", str(scenario)])
    try:
        agent.wait_ready(timeout=60)
        assert time.monotonic() - started < 8.0, "the agent took longer to start than the test allows"
        seen = None
        while time.monotonic() - started < 40 and seen is None:
            health = agent.health()
            per_gpu = [f for g in health.get("gpus", []) for f in g.get("findings", [])]
            findings = [*health.get("findings", []), *per_gpu]
            if any(f.get("code") == "xid.79" for f in findings):
                seen = time.monotonic() - started
            time.sleep(0.2)
        assert seen is not None, agent.log()[-2000:]
        assert seen <= 8.0 + 1.0 + 3.0, seen  # due at 8 s (from a later clock), one 1 s sweep, 3 s of slack
    finally:
        agent.stop()
