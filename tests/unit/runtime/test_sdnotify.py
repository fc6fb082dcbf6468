"""sd_notify over a real AF_UNIX datagram socket (path and abstract namespace)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gpuhealth.runtime.sdnotify import SystemdNotifier


def _listener(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


def test_ready_status_watchdog_stopping_reach_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    sock = _listener(path)
    n = SystemdNotifier(env={"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready("2 GPUs: 2 healthy")
    assert sock.recv(4096) == b"READY=1\nSTATUS=2 GPUs: 2 healthy"
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert n.status("degraded")
    assert sock.recv(4096) == b"STATUS=degraded"
    assert n.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    n.close()
    sock.close()


def test_abstract_socket_names_start_with_at() -> None:
    name = f"gpuhealth-test-{os.getpid()}"
    sock = _listener(b"\0" + name.encode())
    n = SystemdNotifier(env={"NOTIFY_SOCKET": "@" + name})
    assert n.ready()
    assert sock.recv(4096) == b"READY=1"
    n.close()
    sock.close()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "10000000"}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}, 5.0),
        ({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
        ({"WATCHDOG_USEC": "junk"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec(env: dict[str, str], expected: float | None) -> None:
    assert SystemdNotifier(env=env).watchdog_interval_s == expected


def test_outside_systemd_and_with_a_dead_socket_nothing_raises(tmp_path: Path) -> None:
    assert not SystemdNotifier(env={}).ready()
    gone = SystemdNotifier(env={"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.ready() is False
    assert gone.watchdog() is False
