"""`gpuhealth triage` never calls a job healthy on fewer ranks than the job has (issue 33, item 1): a straggler
needs its peers and a hang the group's members. Each case runs the command a user types."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from commands import CLI, REPO

from gpuhealth.instrument import Tracker
from gpuhealth.instrument.timing import HostTimer

GLOO = REPO / "tests" / "fixtures" / "flightrec" / "gloo_4rank"
NCCL = REPO / "tests" / "fixtures" / "flightrec" / "nccl_4gpu"
INCOMPLETE, HEALTHY = 3, 0


def triage(*args: str | Path, profile: str = "default") -> tuple[int, str, dict]:
    cmd = [*CLI, "triage", *map(str, args), "--exit-codes", profile]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    doc = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert text.returncode == doc.returncode, (text.stdout, doc.stdout)
    return text.returncode, text.stdout + text.stderr, json.loads(doc.stdout)


def hook_steps(folder: Path, ranks: list[int], world: int) -> list[Path]:
    """Step records as the shipped hook writes them with no agent listening (GPUHEALTH_STEPS_JSONL)."""
    for rank in ranks:
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "GPUHEALTH_JOB_ID": "job-part"}
        clock = [1.7e9]  # a steady clock: every rank computes 0.1 s a step (no straggler to find by chance)
        t = Tracker(folder / "rank{rank}.jsonl", socket_path="", env=env, flush_interval_s=0.01,
                    timer=HostTimer(clock=lambda now=clock: now[0]))
        for _ in range(30):
            with t.step():
                clock[0] += 0.1
        t.close()
    return [folder / f"rank{r}.jsonl" for r in ranks]


@pytest.mark.parametrize("ranks", [[0], [0, 1]])
def test_some_ranks_step_records_of_a_4_rank_job_are_incomplete(tmp_path: Path, ranks: list[int]) -> None:
    files = hook_steps(tmp_path, ranks, world=4)
    code, out, doc = triage(*(a for f in files for a in ("--steps", f)))
    assert code == INCOMPLETE and doc["verdict"] == "incomplete", out
    assert doc["ranks_missing"] == [r for r in range(4) if r not in ranks]
    assert out.startswith("INCOMPLETE:") and "left no step records" in out and "HEALTHY" not in out
    for profile, unknown in (("nagios", 3), ("npd", 2), ("slurm", 1)):
        assert triage(*(a for f in files for a in ("--steps", f)), profile=profile)[0] == unknown


def test_one_ranks_records_that_do_not_name_the_world_are_not_a_job(tmp_path: Path) -> None:
    # An older hook (or another producer) writes no world_size: one rank alone cannot be judged.
    one = GLOO / "healthy" / "steps_rank0.jsonl"
    code, out, doc = triage("--steps", one)
    assert code == INCOMPLETE and doc["verdict"] == "incomplete", out
    assert "nothing says how many ranks the job has" in out and "--world-size" in out
    # Said to be a one-rank job, it is judged.
    code, out, _ = triage("--steps", one, "--world-size", "1")
    assert code == HEALTHY and out.startswith("HEALTHY: 1 rank(s)"), out
    # Every rank's records: judged as before.
    code, out, _ = triage(*(a for r in range(4) for a in ("--steps", GLOO / "healthy" / f"steps_rank{r}.jsonl")))
    assert code == HEALTHY and out.startswith("HEALTHY: 4 rank(s)"), out


def test_one_gloo_dump_of_a_4_rank_job_is_incomplete(tmp_path: Path) -> None:
    # Gloo records no membership (pg_config {"": ranks "[]"}): one dump cannot tell a one-rank job.
    for name in ("rank0.json", "rank0.pkl"):
        shutil.copy(GLOO / "healthy" / "dumps" / name, tmp_path / name)
    code, out, doc = triage(tmp_path)
    assert code == INCOMPLETE and doc["verdict"] == "incomplete", out
    assert "nothing says how many ranks the job has" in out
    # With its own step records, which name the world (the hook writes world_size), the others are missing.
    hook_steps(tmp_path, [0], world=4)
    code, out, doc = triage(tmp_path)
    assert code == INCOMPLETE and doc["ranks_missing"] == [1, 2, 3], out
    # --world-size 1 says it is the whole job.
    (tmp_path / "rank0.jsonl").unlink()
    assert triage(tmp_path, "--world-size", "1")[0] == HEALTHY


def test_one_nccl_dump_names_its_group_and_stays_incomplete(tmp_path: Path) -> None:
    shutil.copy(NCCL / "healthy" / "dumps" / "rank0.json", tmp_path / "rank0.json")
    code, out, doc = triage(tmp_path)
    assert code == INCOMPLETE and doc["ranks_missing"] == [1, 2, 3], out
