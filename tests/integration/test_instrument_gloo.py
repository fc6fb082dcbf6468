"""Real multi-process PyTorch Gloo jobs instrumented with ``Tracker``, talking to a real ``RankHub``.

The workers are this file run as a script (``python test_instrument_gloo.py worker …``), one process
per rank, like torchrun would start them (RANK/WORLD_SIZE in the environment), meeting at a ``file://``
rendezvous in the test's folder (no port picked before it is bound).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.agent.ranks import RankHub
from gpuhealth.model import RankIdentity, StepRecord

HERE = Path(__file__).resolve()
WORLD = 4
STEPS = 12
COMPUTE_S = 0.06  # long enough that 4 ranks' scheduling noise on 2 loaded cores is a small fraction of it
STRAGGLER = 2
STUCK = 3


# -- worker side (runs in the rank processes) ------------------------------------------------------


def hold_until_released(release: Path) -> None:
    """The stuck rank: busy on the host (say, a data loader), never reaches the collective."""
    while not release.exists():
        time.sleep(0.02)


def wait_in_allreduce(grad: Any) -> None:
    """The healthy ranks: blocked inside the collective the stuck rank has not joined."""
    import torch.distributed as dist

    dist.all_reduce(grad)


def _worker_job(rank: int, cfg: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gpuhealth.instrument import Tracker

    dist.init_process_group("gloo", init_method=os.environ["TEST_RENDEZVOUS"], rank=rank, world_size=cfg["world"],
                            timeout=timedelta(seconds=90))
    tracker = Tracker(flush_interval_s=0.1)
    tracker.wrap_collectives()
    grad = torch.ones(4096)
    compute = cfg["compute_s"] * (2 if rank == cfg.get("straggler") else 1)
    for _ in range(cfg["steps"]):
        with tracker.step():
            time.sleep(compute)  # the "forward/backward"
            dist.all_reduce(grad)
    if cfg.get("hang"):
        if rank == cfg["stuck"]:
            hold_until_released(Path(cfg["release"]))
            dist.all_reduce(grad)  # late: lets the others finish
        else:
            wait_in_allreduce(grad)
    dist.barrier()
    tracker.close()
    stats = tracker.stats()
    assert stats["dropped"] == 0, stats
    dist.destroy_process_group()


def _worker_main(argv: list[str]) -> int:
    cfg = json.loads(argv[1])
    _worker_job(int(os.environ["RANK"]), cfg)
    return 0


# -- test side -----------------------------------------------------------------------------------


def _launch(world: int, cfg: dict[str, Any], env_extra: dict[str, str], logdir: Path) -> list[subprocess.Popen[bytes]]:
    rendezvous = f"file://{logdir / 'rendezvous'}"  # no port picked before it is bound
    procs = []
    for rank in range(world):
        env = {
            **os.environ, **env_extra, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "TEST_RENDEZVOUS": rendezvous, "TORCH_FR_BUFFER_SIZE": "2000",
            "PYTHONUNBUFFERED": "1",
        }
        log = open(logdir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed when the process ends
        procs.append(subprocess.Popen([sys.executable, str(HERE), "worker", json.dumps(cfg)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait_all(procs: list[subprocess.Popen[bytes]], logdir: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            rc = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"rank {rank} exit {rc}:\n{(logdir / f'rank{rank}.log').read_text()[-3000:]}"


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _main_frames(stacks: dict[str, Any]) -> list[str]:
    main = [t for t in stacks["threads"] if t["main"]]
    assert len(main) == 1
    return [f["function"] for f in main[0]["frames"]]


@pytest.fixture
def sock_dir() -> Any:
    # Short path: unix socket paths are limited to 107 bytes, pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="gh-inst-") as d:
        yield Path(d)


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(180)
def test_gloo_job_steps_straggler_dump_and_stacks(sock_dir: Path, tmp_path: Path) -> None:
    sock = sock_dir / "agent.sock"
    hub = RankHub(sock)
    steps: dict[int, list[StepRecord]] = defaultdict(list)
    hellos: list[RankIdentity] = []
    lock = threading.Lock()

    def on_steps(ident: RankIdentity | None, records: list[StepRecord]) -> None:
        with lock:
            for r in records:
                steps[r.rank].append(r)

    hub.add_listener(on_identity=hellos.append, on_steps=on_steps)
    hub.start()
    release = tmp_path / "release"
    job = "job-gloo-1"
    cfg = {"world": WORLD, "steps": STEPS, "compute_s": COMPUTE_S, "straggler": STRAGGLER, "hang": True,
           "stuck": STUCK, "release": str(release)}
    procs = _launch(WORLD, cfg, {"GPUHEALTH_SOCKET": str(sock), "GPUHEALTH_JOB_ID": job}, tmp_path)
    try:
        _until(lambda: len(hub.ranks(job)) == WORLD, 60, "every rank to say hello")
        idents = hub.ranks(job)
        assert [i.rank for i in idents] == list(range(WORLD))
        assert {i.pid for i in idents} == {p.pid for p in procs}
        assert all(i.world_size == WORLD and i.local_rank == i.rank and i.host for i in idents)

        def all_steps_in() -> bool:
            with lock:
                return all(len(steps[r]) >= STEPS for r in range(WORLD))

        _until(all_steps_in, 60, "every step record")
        with lock:
            per_rank = {r: sorted(steps[r], key=lambda s: s.step)[2:] for r in range(WORLD)}  # skip warm-up
        compute = {r: statistics.median(s.compute_s or 0.0 for s in recs) for r, recs in per_rank.items()}
        wait = {r: statistics.median(s.comm_wait_s or 0.0 for s in recs) for r, recs in per_rank.items()}
        wall = {r: statistics.median(s.wall_s for s in recs) for r, recs in per_rank.items()}
        others = [r for r in range(WORLD) if r != STRAGGLER]
        # The straggler computes COMPUTE_S longer per step and waits about COMPUTE_S less; wall times are all the
        # same. Judged as differences against COMPUTE_S: 4 ranks on 2 loaded cores overshoot every sleep and delay
        # every wakeup alike, which ratios and absolute bounds count against the ranks.
        extra = compute[STRAGGLER] - statistics.median(compute[r] for r in others)
        assert 0.5 * COMPUTE_S < extra < 1.5 * COMPUTE_S, (compute, extra)
        assert min(wait[r] for r in others) - wait[STRAGGLER] > 0.5 * COMPUTE_S, wait
        # A wall time that left out the wait would differ by the straggler's extra COMPUTE_S.
        assert max(wall.values()) - min(wall.values()) < 0.5 * COMPUTE_S, wall
        for r in range(WORLD):
            recs = per_rank[r]
            assert all(s.job_id == job and s.rank == r for s in recs)
            assert all(abs(s.wall_s - (s.compute_s or 0) - (s.comm_wait_s or 0)) < 1e-9 for s in recs)

        # Phase 2: rank STUCK never joins the next all_reduce; the others block inside it.
        def others_blocked() -> bool:
            res = hub.request_stacks(job, 0, timeout_s=5)[0]
            return not isinstance(res, Exception) and "wait_in_allreduce" in _main_frames(res)

        _until(others_blocked, 30, "rank 0 to block in the all_reduce")
        # A hang is a wait that lasted: triage calls no wait under a second a hang (the dumps of a running
        # job land up to a second apart), and nobody dumps a hang sooner than that.
        time.sleep(1.5)

        dump_dir = tmp_path / "fr"
        dump_dir.mkdir()
        dumps = hub.request_dump(job, None, timeout_s=30)
        assert sorted(dumps) == list(range(WORLD)), dumps
        last_enqueued: dict[int, int] = {}
        for r, data in dumps.items():
            assert isinstance(data, bytes | bytearray), (r, data)  # sent over the socket, no shared folder
            (dump_dir / f"rank{r}.json").write_bytes(data)
            dump = json.loads(data)
            assert dump["version"].startswith("2.")
            ops = [e["profiling_name"] for e in dump["entries"]]
            assert ops.count("gloo:all_reduce") >= STEPS
            last_enqueued[r] = int(dump["pg_status"]["0"]["last_enqueued_collective"])
        # The healthy ranks enqueued one more collective than the stuck rank: a dump shows the hang.
        assert {last_enqueued[r] for r in range(WORLD) if r != STUCK} == {last_enqueued[STUCK] + 1}, last_enqueued
        # And triage, fed the hook's dumps, names the stuck rank.
        from gpuhealth.flightrec.verdict import triage

        report = triage(dump_dir)
        assert report.verdict == "hang" and report.culprits == [STUCK], report.summary

        stacks = hub.request_stacks(job, None, timeout_s=10)
        assert sorted(stacks) == list(range(WORLD))
        stuck = stacks[STUCK]
        assert not isinstance(stuck, Exception)
        assert _main_frames(stuck)[-1] == "hold_until_released"
        assert "hold_until_released" in stuck["text"]
        for r in (r for r in range(WORLD) if r != STUCK):
            res = stacks[r]
            assert not isinstance(res, Exception)
            assert "wait_in_allreduce" in _main_frames(res)
            assert any(t["name"] == "gpuhealth-instrument" for t in res["threads"])

        missing = hub.request_stacks(job, 17, timeout_s=1)
        assert isinstance(missing[17], LookupError)

        release.touch()
        _wait_all(procs, tmp_path, 60)
        _until(lambda: hub.ranks(job) == [], 10, "ranks to disconnect")
        assert hub.stats()["malformed"] == 0
        assert len(hellos) == WORLD
    finally:
        release.touch()
        _kill(procs)
        hub.stop()
    assert not sock.exists()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(120)
def test_gloo_job_falls_back_to_jsonl_without_agent(sock_dir: Path, tmp_path: Path) -> None:
    world, n, slow = 3, 12, 2
    cfg = {"world": world, "steps": n, "compute_s": 0.01, "straggler": slow}
    env = {"GPUHEALTH_SOCKET": str(sock_dir / "nobody-listens.sock"), "GPUHEALTH_JOB_ID": "job-jsonl",
           "GPUHEALTH_STEPS_JSONL": str(tmp_path / "steps" / "rank{rank}.jsonl")}
    procs = _launch(world, cfg, env, tmp_path)
    try:
        _wait_all(procs, tmp_path, 90)
    finally:
        _kill(procs)
    for rank in range(world):
        lines = (tmp_path / "steps" / f"rank{rank}.jsonl").read_text().splitlines()
        records = [StepRecord.from_dict(json.loads(line)) for line in lines]
        assert [r.step for r in records] == list(range(n))
        assert all(r.rank == rank and r.job_id == "job-jsonl" and r.world_size == world for r in records)
        assert all(r.wall_s >= 0.01 and r.compute_s is not None and r.comm_wait_s is not None for r in records)
    # The files are what `gpuhealth triage --steps` reads: it finds the rank doing 2x the compute.
    from gpuhealth.cli.triage import read_steps
    from gpuhealth.flightrec.verdict import triage

    records, problems = read_steps([str(p) for p in sorted((tmp_path / "steps").glob("*.jsonl"))])
    assert problems == [] and len(records) == world * n
    report = triage([], steps=records)
    assert report.verdict == "straggler" and report.culprits == [slow], report.summary


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    code = _worker_main(sys.argv[1:])
    # Skip finalization, where torch + Gloo can abort a finished worker (see test_instrument_ddp.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
