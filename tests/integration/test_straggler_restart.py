"""A straggler announced by the coordinator is not announced again after the coordinator is killed
and restarted on the same database: the episode continues (one verdict per rank and episode)."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
from gpuhealth.coordinator.query import list_jobs
from gpuhealth.model import StepRecord

pytestmark = pytest.mark.integration

JOB, WORLD, SLOW = "job-straggler", 8, 5


def _until(cond: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def _start(port: int, db: Path, ready: Path) -> tuple[subprocess.Popen[bytes], int]:
    """Port 0 the first time (the kernel picks a free one); the same port again on a restart."""
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuhealth.cli.main", "coordinator", "--listen", f"127.0.0.1:{port}",
         "--metrics-listen", "off", "--db", str(db), "--ready-file", str(ready), "--hang-floor", "3600"],
        stdout=subprocess.DEVNULL, stderr=open(db.parent / "coordinator.log", "ab"))  # noqa: SIM115
    _until(ready.exists, 30, "the coordinator to serve")
    return proc, int(json.loads(ready.read_text())["grpc_port"])


def _verdicts(db: Path) -> list[str]:
    with sqlite3.connect(db) as con:
        return [kind for (kind,) in con.execute("SELECT kind FROM verdicts WHERE job_id=? ORDER BY id", (JOB,))]


@pytest.mark.timeout(120)
def test_a_killed_and_restarted_coordinator_does_not_announce_the_straggler_again(tmp_path: Path) -> None:
    db, ready = tmp_path / "coord.db", tmp_path / "ready.json"
    coord, port = _start(0, db, ready)
    address = f"127.0.0.1:{port}"
    link = CoordinatorLink(LinkSettings(address=address, spool_path=str(tmp_path / "spool.db"),
                                        batch_interval_s=0.05, backoff_initial_s=0.2, backoff_max_s=1.0))
    link.start(None)

    def feed(first: int, last: int) -> None:
        for step in range(first, last):
            compute = [0.06 * (1.8 if r == SLOW else 1.0) * (1 + 0.02 * ((r + step) % 3 - 1)) for r in range(WORLD)]
            link.on_steps(None, [StepRecord(JOB, r, step, 1.7e9 + step, 0.2, compute[r], 0.2 - compute[r])
                                 for r in range(WORLD)])
            time.sleep(0.01)

    try:
        feed(0, 80)
        _until(lambda: _verdicts(db) == ["straggler"], 30, "the straggler verdict")
        coord.send_signal(signal.SIGKILL)
        coord.wait(10)
        coord, _ = _start(port, db, ready)
        feed(80, 200)

        def flagged_again() -> bool:
            jobs = list_jobs(address, JOB, timeout_s=10)["jobs"]
            return bool(jobs) and jobs[0]["stragglers"] == [SLOW] and jobs[0]["last_step"] == 199

        _until(flagged_again, 30, "the restarted coordinator to see the job and its straggler")
        time.sleep(1.5)  # a few more detection ticks
        assert _verdicts(db) == ["straggler"]  # the episode continued: no second verdict
    finally:
        link.stop()
        coord.send_signal(signal.SIGTERM)
        coord.wait(10)
