"""Issue 30, item 9: the rank socket's fair share holds where the kernel gives no pid.

An agent without ``hostPID`` (the chart's default) gets pid 0 from ``SO_PEERCRED`` for every rank, so the
per-process share never applied: one process of a uid held that uid's whole share (256 of 300 hellos) and
another process of the same uid was refused. Here the hub's one boundary with the kernel
(``peer_credentials``) is given pid 0, over real unix sockets: one uid's connections are then shared by
the job they claim (64 per job, 32 before a hello), a full share gives way to a new connection, and
another uid is never starved."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuhealth.agent import ranks
from gpuhealth.agent.ranks import PeerCredentials, RankHub
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord


class _KernelSaysPidZero:
    """A socket whose SO_PEERCRED reads (pid 0, uid, gid): what a peer in another PID namespace gives."""

    def __init__(self, sock: socket.socket, uid: int) -> None:
        self._sock, self._uid = sock, uid

    def getsockopt(self, *args: int) -> bytes:
        return struct.pack("3i", 0, self._uid, self._uid)


def test_pid_zero_from_the_kernel_is_no_pid() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        creds = ranks.peer_credentials(_KernelSaysPidZero(a, 1234))  # type: ignore[arg-type]
        assert creds == PeerCredentials(None, 1234, 1234)
    finally:
        a.close()
        b.close()


@pytest.fixture
def no_pids(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Every connection reads pid 0; its uid is the next one ``as_uid`` set (the kernel's, by default)."""
    who = {"uid": os.getuid()}
    real = ranks.peer_credentials

    def pid_zero(sock: socket.socket) -> PeerCredentials:
        return real(_KernelSaysPidZero(sock, who["uid"]))  # type: ignore[arg-type]

    monkeypatch.setattr(ranks, "peer_credentials", pid_zero)
    return lambda uid: who.__setitem__("uid", uid)


@pytest.fixture
def hub() -> Iterator[RankHub]:
    with tempfile.TemporaryDirectory(prefix="gh-share-") as d:
        h = RankHub(Path(d) / "r.sock", hello_timeout_s=30.0)
        heard: list[StepRecord] = []
        h.add_listener(on_steps=lambda ident, records: heard.extend(records))
        h.heard = heard  # type: ignore[attr-defined]
        h.start()
        try:
            yield h
        finally:
            h.stop()


def _hello(hub: RankHub, job: str, rank: int, world: int = 1024) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(hub.socket_path))
    try:
        s.sendall(protocol.encode(protocol.hello(RankIdentity(job, rank, world, "h", 0))))
    except OSError:
        pass  # refused already
    return s


def _flood(hub: RankHub, claims: list[tuple[str, int]]) -> list[socket.socket]:
    """Hellos for ``claims``, 16 at a time (each batch judged before the next: fewer than 32 wait for a hello)."""
    out: list[socket.socket] = []
    for k in range(0, len(claims), 16):
        out += [_hello(hub, job, rank) for job, rank in claims[k:k + 16]]
        _settle(hub, len(out))
    return out


def _until(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def _settle(hub: RankHub, n: int) -> None:
    """Every one of ``n`` connections has been accepted and its hello judged (held or refused)."""
    _until(lambda: (st := hub.stats())["connections"] + st["refused_over_share"] + st["refused_connections"] >= n
           and st["connected"] == st["ranks"] and st["refused_hellos"] + st["ranks"] + st.get("displaced_over_share", 0)
           >= st["connections"], f"{n} connections judged")


def _real_rank_counts(hub: RankHub, job: str) -> None:
    s = _hello(hub, job, 0, world=2)
    s.sendall(protocol.encode(protocol.steps([StepRecord(job, 0, 7, 1.7e9, 0.1, 0.08, 0.02)])))
    _until(lambda: any(r.job_id == job for r in hub.heard), f"the step of {job}'s rank")  # type: ignore[attr-defined]
    assert any(i.job_id == job for i in hub.ranks())


def test_one_process_flooding_one_job_leaves_room_for_the_same_uids_other_ranks(
        hub: RankHub, no_pids: Callable[[int], None]) -> None:
    flood = _flood(hub, [("flood", i) for i in range(300)])
    try:
        _settle(hub, 300)
        held = sum(1 for i in hub.ranks() if i.job_id == "flood")
        assert held == 64  # before: 256 (the uid's whole share)
        _real_rank_counts(hub, "real")  # before: refused ("uid … holds 256 connections, its share")
    finally:
        for s in flood:
            s.close()


def test_a_full_share_gives_way_and_another_uid_is_never_starved(
        hub: RankHub, no_pids: Callable[[int], None]) -> None:
    # Four jobs × 64: the uid's whole share (256) without pids.
    flood = _flood(hub, [(f"flood{j}", i) for j in range(4) for i in range(64)])
    try:
        _settle(hub, 256)
        assert hub.stats()["ranks"] == 256
        _real_rank_counts(hub, "real")  # the newest connection of a flood job gave way
        assert hub.stats()["displaced_over_share"] >= 1
        no_pids(os.getuid() + 1)  # another user (as the kernel would say)
        _real_rank_counts(hub, "other-user-job")
    finally:
        for s in flood:
            s.close()


def test_connections_that_never_say_hello_are_bounded_per_uid_without_pids(
        hub: RankHub, no_pids: Callable[[int], None]) -> None:
    silent = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(hub.socket_path))
            silent.append(s)
        _until(lambda: hub.stats()["connections"] + hub.stats()["refused_over_share"] >= 64, "64 judged")
        assert hub.stats()["connected"] == 32
        no_pids(os.getuid() + 1)
        _real_rank_counts(hub, "other-user-job")
    finally:
        for s in silent:
            s.close()
