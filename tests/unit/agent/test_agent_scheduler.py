"""The scheduler runs jobs at their intervals and never waits on one that hangs."""

from __future__ import annotations

import threading
import time

from agent_testing import wait_for

from gpuhealth.agent.scheduler import Job, Scheduler


def _run(s: Scheduler) -> threading.Thread:
    t = threading.Thread(target=s.run_forever, daemon=True)
    t.start()
    return t


def test_jobs_run_at_their_own_intervals() -> None:
    counts = {"fast": 0, "slow": 0}

    def bump(name: str) -> None:
        counts[name] += 1

    s = Scheduler(tick_s=0.01)
    s.add(Job("fast", 0.05, lambda: bump("fast")))
    s.add(Job("slow", 0.5, lambda: bump("slow")))
    t = _run(s)
    time.sleep(1.05)
    s.stop()
    t.join(2)
    assert 2 <= counts["slow"] <= 4  # at 0, 0.5, 1.0
    assert counts["fast"] >= 10
    assert counts["fast"] > 4 * counts["slow"]


def test_hung_job_is_reported_once_and_never_blocks_the_others() -> None:
    release = threading.Event()
    hung: list[tuple[str, float]] = []
    ticks = {"n": 0}
    calls = {"hang": 0}

    def hang() -> None:
        calls["hang"] += 1
        release.wait(10)

    def tick() -> None:
        ticks["n"] += 1

    s = Scheduler(tick_s=0.01, hang_grace_s=0.0, on_hung=lambda job, el: hung.append((job.name, el)))
    s.add(Job("hang", 0.05, hang, timeout_s=0.2))  # same pool as "tick": its worker gets replaced
    s.add(Job("tick", 0.05, tick, timeout_s=0.2))
    t = _run(s)
    wait_for(lambda: bool(hung), 3, "the hang to be declared")
    n = ticks["n"]
    wait_for(lambda: ticks["n"] >= n + 5, 3, "the other job to keep running")
    assert [name for name, _ in hung] == ["hang"]  # reported once
    assert calls["hang"] == 1  # not started again while stuck
    assert s.is_running("hang")
    release.set()
    wait_for(lambda: calls["hang"] >= 2, 3, "the job to run again once it returned")
    s.stop()
    t.join(2)


def test_a_job_that_raises_does_not_kill_its_worker() -> None:
    ran = {"n": 0}

    def bad() -> None:
        raise RuntimeError("bug")

    def good() -> None:
        ran["n"] += 1

    s = Scheduler(tick_s=0.01)
    s.add(Job("bad", 0.02, bad))
    s.add(Job("good", 0.02, good))
    t = _run(s)
    wait_for(lambda: ran["n"] >= 5, 3, "the good job to keep running")
    s.stop()
    t.join(2)


def test_disabled_jobs_wait_and_run_soon_makes_them_due() -> None:
    enabled = threading.Event()
    ran = {"n": 0}
    s = Scheduler(tick_s=0.01)
    s.add(Job("gated", 3600, lambda: ran.__setitem__("n", ran["n"] + 1), enabled=enabled.is_set))
    t = _run(s)
    time.sleep(0.1)
    assert ran["n"] == 0
    enabled.set()
    wait_for(lambda: ran["n"] == 1, 2, "the first run once enabled")
    s.run_soon("gated")
    wait_for(lambda: ran["n"] == 2, 2, "run_soon to make the job due despite its 1 h interval")
    s.stop()
    t.join(2)
