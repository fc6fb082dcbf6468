"""A real agent process through faults over time: a GPU falls off the bus and comes back, the driver
is unloaded and comes back; it keeps serving, reports each failure, recovers without a restart.
Also: systemd notify + watchdog over a real socket, SIGHUP reload, JSON logs, graceful SIGTERM,
and no torch in the agent process.

Scenario ``agent_flaky.yaml`` (clock starts with the agent): GPU 1 lost at 3 s, back at 15 s; driver
unloaded from 18 s to 28 s. The test polls, so the windows cost it no time; they are wide so that a slow
start-up (the first window) or a stalled test thread (the second) on a loaded machine does not miss one.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from agent_process import AgentProcess

pytestmark = pytest.mark.integration

SCENARIO = Path(__file__).parents[1] / "fixtures" / "scenarios" / "agent_flaky.yaml"
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


def _wait(fn: Any, timeout: float, what: str, agent: AgentProcess) -> Any:
    """The first true value ``fn`` returns: assert on it, not on a later read that may have moved on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; agent log:\n{agent.log()[-4000:]}")


def _codes(report: dict[str, Any]) -> set[str]:
    return {f["code"] for f in report["findings"]} | {f["code"] for g in report["gpus"] for f in g["findings"]}


def _metric(text: str, pattern: str) -> float | None:
    m = re.search(r"^" + pattern + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_agent_survives_lost_gpu_and_driver_reload_and_shuts_down_cleanly(tmp_path: Path) -> None:
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(0.2)
    heard: list[str] = []  # drained on a thread, as systemd does
    done = threading.Event()

    def drain() -> None:
        while not done.is_set():
            try:
                heard.append(notify.recv(4096).decode())
            except TimeoutError:
                continue

    drainer = threading.Thread(target=drain, daemon=True)
    drainer.start()
    cfg = tmp_path / "agent.yaml"
    settings: dict[str, Any] = {"collectors": {"fast_interval_s": 0.5, "slow_interval_s": 1.0, "timeout_s": 2.0},
                                "agent": {"json_logs": True, "pod_resources_socket": str(tmp_path / "none.sock"),
                                          "socket_path": str(tmp_path / "agent.sock")}}
    cfg.write_text(yaml.safe_dump(settings))
    agent = AgentProcess(tmp_path, ["--config", str(cfg), "--scenario", str(SCENARIO)],
                         env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000"})
    try:
        agent.wait_ready()
        # systemd: READY=1 after the first sweep, then watchdog pings at half of WATCHDOG_USEC
        _wait(lambda: heard.count("WATCHDOG=1") >= 3, 5, "watchdog pings", agent)
        ready = [m for m in heard if m.startswith("READY=1")]
        assert ready and ready[0].startswith("READY=1\nSTATUS=SIMULATED, 2 GPUs: 2 healthy"), heard

        assert agent.health()["node"]["simulated"] is True
        # --- GPU 1 falls off the bus (3 s): reported, GPU 0 still read, scrape keeps working
        report = _wait(lambda: r if "gpu.lost" in _codes(r := agent.health()) else None, 30, "gpu.lost", agent)
        assert [g["health"] for g in report["gpus"]] == ["healthy", "unhealthy"]
        text = agent.metrics()
        assert _metric(text, r'gpuhealth_gpu_temperature_celsius\{gpu="0",[^}]*sensor="gpu"\}') is not None
        assert _metric(text, r"gpuhealth_nvml_up") == 1.0
        # --- it answers again (15 s)
        _wait(lambda: "gpu.lost" not in _codes(agent.health()), 30, "gpu.lost to clear", agent)
        # --- driver unloaded (18 s): NVML down, GPU health unknown, still serving
        _wait(lambda: _metric(agent.metrics(), "gpuhealth_nvml_up") == 0.0, 30, "NVML down", agent)
        report = _wait(lambda: r if "nvml.unavailable" in _codes(r := agent.health()) else None, 30,
                       "nvml.unavailable", agent)
        assert {g["health"] for g in report["gpus"]} == {"unknown"}
        assert agent.get("/ready")[0] == 200  # the process is fine; the driver is not
        # --- driver back (28 s): re-initialised in the same process
        _wait(lambda: _metric(agent.metrics(), "gpuhealth_nvml_up") == 1.0, 30, "NVML re-initialised", agent)
        _wait(lambda: agent.health()["node"]["health"] == "healthy", 30, "healthy again", agent)
        # telemetry's next run after the re-init (it failed while NVML was down) comes within one fast interval
        telemetry_ok = r'gpuhealth_collector_success\{collector="telemetry"\}'
        text = _wait(lambda: t if _metric(t := agent.metrics(), telemetry_ok) == 1.0 else None, 30,
                     "telemetry succeeding again", agent)
        assert (_metric(text, "gpuhealth_nvml_reinits_total") or 0) >= 1

        # --- SIGHUP: reload the config (turn on dcgm-compat) without a restart
        assert "DCGM_FI_DEV_GPU_TEMP" not in text
        settings["agent"]["dcgm_compat"] = True
        cfg.write_text(yaml.safe_dump(settings))
        agent.signal(signal.SIGHUP)
        _wait(lambda: "DCGM_FI_DEV_GPU_TEMP_CELSIUS{" in agent.metrics(), 10, "dcgm series after SIGHUP", agent)
        # a broken config on SIGHUP is refused and the agent keeps running on the old one
        cfg.write_text("collectors: [not, a, mapping]\n")
        agent.signal(signal.SIGHUP)
        _wait(lambda: "reload failed" in agent.log(), 10, "the reload error in the log", agent)
        assert agent.get("/ready")[0] == 200

        # OpenMetrics when asked (Prometheus asks for it first)
        code, body = agent.get("/metrics", headers={"Accept": OPENMETRICS})
        assert code == 200 and body.endswith("# EOF\n")
    finally:
        rc = agent.stop()
    assert rc == 0, agent.log()[-3000:]
    assert not agent.imported_torch()
    # systemd heard STOPPING=1; logs were JSON lines, each marked simulated. The agent has exited: whatever it
    # sent is in the socket's queue; read the rest once the drainer is gone (it may not have got to it).
    done.set()
    drainer.join(10)
    assert not drainer.is_alive()
    notify.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            heard.append(notify.recv(4096).decode())
    notify.close()
    assert heard[-1] == "STOPPING=1", heard[-5:]
    assert any(m.startswith("STATUS=SIMULATED, 2 GPUs: 1 healthy, 1 unhealthy") for m in heard)
    assert "RELOADING=1" in heard
    records = [json.loads(line) for line in agent.log().splitlines() if line.startswith("{")]
    assert records and all(r["simulated"] is True for r in records)
    messages = " | ".join(r["msg"] for r in records)
    assert "NVML went away" in messages and "NVML is back" in messages and "stopping" in messages
    assert "Traceback" not in agent.log()
    assert "extension ranks started" in messages  # the rank hub ran beside the agent


def test_bad_scenario_file_is_one_clear_line_and_exit_3(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("recording: nvml_h200x2.json\nevents: [{at: 1, type: explode}]\n")
    agent = AgentProcess(tmp_path, ["--scenario", str(bad)])  # fails before any socket is made
    rc = agent.proc.wait(30)
    out = agent.log()
    assert rc == 3
    assert "bad.yaml" in out and "events[0]" in out and "Traceback" not in out
