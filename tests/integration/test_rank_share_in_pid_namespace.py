"""Issue 30, item 9, over real sockets: the agent's rank hub in its own PID namespace (as an agent pod
without ``hostPID``: the kernel gives it pid 0 for every peer), ranks and a flooder as processes of
non-root users outside it. One process of uid 65534 sends 300 hellos to one job; before, it held 256 of
them (its uid's whole share) and another rank of the same uid was refused. Now the uid's connections are
shared by job, and that rank — and another user's — connect and count."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_rank_socket_hardening import FLOODER, HOST, NOBODY, RankProcess, sock_dir, until

pytestmark = pytest.mark.integration
__all__ = ["sock_dir"]  # the fixture, shared


class HubInPidNamespace:
    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(HOST),
                                      str(path), json.dumps({"hello_timeout_s": 60.0})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def stats(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture
def hub(sock_dir: Path) -> Iterator[HubInPidNamespace]:
    h = HubInPidNamespace(sock_dir / "a.sock")
    try:
        yield h
    finally:
        h.stop()


def test_one_process_cannot_hold_its_uids_share_when_the_agent_sees_no_pids(hub: HubInPidNamespace,
                                                                              sock_dir: Path) -> None:
    sock = sock_dir / "a.sock"
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, str(sock), "0", "300"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    procs: list[RankProcess] = []
    try:
        assert flooder.stdout is not None and flooder.stdout.readline().strip() == "done"

        def judged() -> bool:
            st = hub.stats()
            return st["connections"] + st["refused_over_share"] + st["refused_connections"] >= 300 and \
                st["connected"] == st["ranks"]

        until(judged, 30, "the flood judged")
        held = [r for r in hub.stats()["ranks_list"] if r["job_id"] == "flood"]
        assert len(held) <= 64, len(held)  # before: 256, the uid's whole share
        same_user = RankProcess(sock, "real", 0, uid=NOBODY)  # another process of the flooder's uid
        procs.append(same_user)
        other_user = RankProcess(sock, "other", 0, uid=NOBODY - 1)
        procs.append(other_user)
        same_user.do("steps real 0 1")
        other_user.do("steps other 0 1")
        until(lambda: {("real", 0), ("other", 0)} <= {(r["job_id"], r["rank"]) for r in hub.stats()["ranks_list"]},
              10, "both ranks connected")
        until(lambda: hub.stats()["step_records_heard"] == 2, 10, "both ranks' step records")
    finally:
        for p in procs:
            p.kill()
        flooder.kill()
        flooder.wait(10)
