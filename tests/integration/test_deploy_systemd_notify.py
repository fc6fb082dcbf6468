"""The systemd units and the binaries they start agree on the notify protocol, checked the way
systemd checks it: a real AF_UNIX datagram socket as ``$NOTIFY_SOCKET`` with SO_PASSCRED, so each
message carries the sender's pid (``NotifyAccess=main`` accepts only the main process).

The agent unit is ``Type=notify`` with ``WatchdogSec=``: the agent started with the unit's own
ExecStart arguments must send READY=1 (with STATUS=) once it serves /ready, then WATCHDOG=1 at
half the watchdog interval, all from the main pid, and STOPPING=1 on SIGTERM. The coordinator unit
must match what the coordinator does (READY=1 ⇔ Type=notify)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SYSTEMD = REPO / "deploy" / "systemd"
GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
UCRED = struct.Struct("iII")  # pid, uid, gid


@dataclass
class Message:
    fields: dict[str, str]
    pid: int
    at: float


def unit_settings(name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (SYSTEMD / name).read_text().splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key, value)
    return out


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages: list[Message] = []

    def receive(self, timeout: float) -> Message | None:
        self.sock.settimeout(timeout)
        try:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = UCRED.unpack(payload[: UCRED.size])[0]
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        msg = Message(fields, pid, time.monotonic())
        self.messages.append(msg)
        return msg

    def wait_for(self, predicate: object, timeout: float) -> list[Message]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if callable(predicate) and predicate(self.messages):
                return self.messages
            self.receive(max(0.05, min(1.0, deadline - time.monotonic())))
        return self.messages

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ghn") as d:  # short: AF_UNIX path limit
        yield Path(d)


def exec_start_argv(unit: str, config: Path) -> list[str]:
    argv = shlex.split(unit_settings(unit)["ExecStart"])
    assert argv[0] == "/usr/local/bin/gpuhealth"
    argv[0] = GPUHEALTH
    argv[argv.index("--config") + 1] = str(config)
    return argv


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def test_agent_unit_notify_protocol(workdir: Path) -> None:
    settings = unit_settings("gpuhealth-agent.service")
    assert settings["Type"] == "notify" and settings["NotifyAccess"] == "main"
    config = workdir / "agent.yaml"
    config.write_text(yaml.safe_dump({"agent": {
        "listen": "127.0.0.1:0", "state_dir": str(workdir / "state"),
        "socket_path": str(workdir / "run" / "agent.sock"), "pod_resources_socket": str(workdir / "none.sock"),
    }}))
    notify = NotifySocket(workdir / "notify.sock")
    # systemd passes WATCHDOG_USEC from WatchdogSec=; a short one keeps the test fast
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUHEALTH_", "NOTIFY_", "WATCHDOG_"))},
           "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    argv = [*exec_start_argv("gpuhealth-agent.service", config), "--nvml-snapshot",
            str(REPO / "src/gpuhealth/data/nvml_h200x2.json")]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        # port 0: the kernel picks a free one, and the agent's log says which
        served = next((line for line in iter(proc.stdout.readline, b"") if b"serving /metrics" in line), b"")
        found = re.search(rb"http://127\.0\.0\.1:(\d+)", served)
        assert found is not None, "the agent never said where it serves"
        port = int(found.group(1))

        def ready(msgs: list[Message]) -> bool:
            return any(m.fields.get("READY") == "1" for m in msgs)

        notify.wait_for(ready, timeout=40)
        assert ready(notify.messages), f"no READY=1; got {notify.messages}"
        ready_msg = next(m for m in notify.messages if m.fields.get("READY") == "1")
        # READY means serving: /ready answers 200 by the time systemd hears it
        assert http_status(f"http://127.0.0.1:{port}/ready") == 200
        assert ready_msg.fields.get("STATUS"), "READY=1 should come with a STATUS= line"

        def watchdogs(msgs: list[Message]) -> list[Message]:
            return [m for m in msgs if m.fields.get("WATCHDOG") == "1" and m.at >= ready_msg.at]

        notify.wait_for(lambda msgs: len(watchdogs(msgs)) >= 3, timeout=10)
        pings = watchdogs(notify.messages)
        assert len(pings) >= 3, f"expected WATCHDOG=1 every 0.5 s; got {notify.messages}"
        gaps = [b.at - a.at for a, b in itertools.pairwise(pings)]
        assert max(gaps) < 1.0, f"watchdog pings {gaps} would miss a 1 s WatchdogSec"
        # NotifyAccess=main: every message must come from the process systemd started
        assert {m.pid for m in notify.messages} == {proc.pid}

        proc.terminate()
        proc.wait(timeout=20)
        notify.wait_for(lambda msgs: any(m.fields.get("STOPPING") == "1" for m in msgs), timeout=2)
        assert any(m.fields.get("STOPPING") == "1" for m in notify.messages)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def test_coordinator_unit_type_matches_the_coordinator(workdir: Path) -> None:
    unit_type = unit_settings("gpuhealth-coordinator.service")["Type"]
    config = workdir / "coordinator.yaml"
    config.write_text(yaml.safe_dump({"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0", "db_path": str(workdir / "coordinator.db"),
    }}))
    notify = NotifySocket(workdir / "notify.sock")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUHEALTH_", "NOTIFY_", "WATCHDOG_"))},
           "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "1000000"}
    ready_file = workdir / "ports.json"  # port 0: the kernel picks free ones, the ready file says which
    argv = [*exec_start_argv("gpuhealth-coordinator.service", config), "--evidence-dir", str(workdir / "ev"),
            "--ready-file", str(ready_file)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not ready_file.exists():
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "coordinator never wrote its ports"
            time.sleep(0.1)
        metrics_port = json.loads(ready_file.read_text())["metrics_port"]
        while http_status(f"http://127.0.0.1:{metrics_port}/metrics") != 200:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "coordinator never served /metrics"
            time.sleep(0.2)
        notify.wait_for(lambda msgs: any(m.fields.get("READY") == "1" for m in msgs), timeout=3)
        sent_ready = any(m.fields.get("READY") == "1" for m in notify.messages)
        if unit_type == "notify":
            assert sent_ready, "Type=notify unit, but the coordinator never sends READY=1: systemd would kill it"
            assert "WatchdogSec" in unit_settings("gpuhealth-coordinator.service")
            def pings(msgs: list[Message]) -> list[Message]:
                return [m for m in msgs if m.fields.get("WATCHDOG") == "1"]

            notify.wait_for(lambda msgs: len(pings(msgs)) >= 3, timeout=3)
            assert len(pings(notify.messages)) >= 3, f"no WATCHDOG=1 every 0.5 s: {notify.messages}"
            assert {m.pid for m in notify.messages} == {proc.pid}  # NotifyAccess=main
            proc.terminate()
            proc.wait(timeout=20)
            notify.wait_for(lambda msgs: any(m.fields.get("STOPPING") == "1" for m in msgs), timeout=2)
            assert any(m.fields.get("STOPPING") == "1" for m in notify.messages)
        else:
            assert unit_type == "exec"
            assert not sent_ready, "the coordinator sends READY=1 now: switch its unit to Type=notify + WatchdogSec"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        notify.close()


def test_ancillary_credentials_are_parsed() -> None:
    # guards the pid check above: our own datagram must come back with our own pid
    with tempfile.TemporaryDirectory(prefix="ghn") as d:
        notify = NotifySocket(Path(d) / "n.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(b"READY=1\nSTATUS=x", str(notify.path))
        msg = notify.receive(2.0)
        notify.close()
    assert msg is not None and msg.pid == os.getpid() and msg.fields == {"READY": "1", "STATUS": "x"}
