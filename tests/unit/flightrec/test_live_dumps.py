"""Dumps taken from a running job, a moment apart (the agent's periodic FIFO dumps, issue 15).

Each rank's dump is written when its own process gets to it: rank 1's may show all_reduce #4434 in
flight while rank 0's, written 180 ms later, shows #4434…#4465 done. That is not a stall:
- an all-reduce whose kernel ran to completion (NCCL timing: a measured duration under the timeout)
  was posted by every member, so a member whose dump ends before it was simply dumped earlier;
- a wait younger, at its rank's dump, than the job's ordinary pauses (and than 1 s) is not a hang —
  whichever rank's dump came first, with or without timing (dump times from the file or its contents).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from frbuild import dump, entry, write_json

from gpuhealth.flightrec.report import RootKind, Verdict
from gpuhealth.flightrec.verdict import triage

LIVE = Path(__file__).resolve().parents[2] / "fixtures" / "zerocode" / "h200x2_nccl2.28.9" / "live_dumps_straggler_1.3"
WORLD4 = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}


@pytest.mark.parametrize("copied", [False, True])
def test_real_live_dumps_of_a_running_job_are_not_a_hang(tmp_path: Path, copied: bool) -> None:
    # ``copied``: the files as a copy leaves them, dated now (hours after the job ran): a rank proven to
    # have gone on is not "timed out" however old the dumps look.
    folder = LIVE
    if copied:
        folder = tmp_path / "copy"
        shutil.copytree(LIVE, folder)
        for f in folder.iterdir():
            os.utime(f, (time.time() + 86_400, time.time() + 86_400))
    rep = triage(folder)
    assert rep.verdict is Verdict.STRAGGLER, rep.summary
    assert not any(f.code == "collective.gpu_stall" for f in rep.findings), rep.summary
    # Which rank is slow, from the dumps themselves: NCCL records a collective's start after the rank's
    # own compute, so the rank that waits inside all_reduce is the fast one. Rank 1 waits ~4.9 ms per
    # collective, rank 0 ~0.01 ms: rank 0 computes longer (GPU 0 still ran two hung jobs' spinning kernels;
    # see the fixture's README).
    assert rep.headline is not None and rep.headline.evidence["rank"] == 0, rep.summary


H100 = Path(__file__).resolve().parents[2] / "fixtures" / "zerocode" / "h100x2_nccl2.28.9"


@pytest.mark.parametrize("copied", [False, True])
def test_a_true_1_3x_straggler_is_named_from_its_periodic_dumps(tmp_path: Path, copied: bool) -> None:
    """2 x H100: rank 1 computes 1.3x (train.py's loop sized once, after cuBLAS warm-up; nothing else on the
    GPUs). Rank 1's dump ends at #1039 while rank 0's shows #1040 done with a measured kernel time and waits in
    #1042: rank 1 was dumped first and went on. Read fresh or copied (re-dated files), no hang is read into
    that, and the straggler is rank 1 at ~1.3x."""
    folder = H100 / "live_dumps_straggler_1.3"
    if copied:
        folder = tmp_path / "copy"
        shutil.copytree(H100 / "live_dumps_straggler_1.3", folder)
        for f in folder.iterdir():
            os.utime(f, (time.time() + 86_400, time.time() + 86_400))
    rep = triage(folder)
    assert rep.verdict is Verdict.STRAGGLER, rep.summary
    assert rep.headline is not None and rep.headline.evidence["rank"] == 1, rep.summary
    assert 1.2 <= rep.headline.evidence["ratio_to_median"] <= 1.4, rep.headline.evidence
    assert any("rank 1's dump ends at collective #1039" in n for n in rep.notes), rep.notes


def test_the_coordinators_evidence_of_a_reported_hang_names_the_stuck_rank() -> None:
    """What the coordinator collected for job B (NCCL's pickles through the FIFO, py-spy stacks) after the
    agent reported it from NCCL RAS: rank 1 never reached all_reduce #602, and its stack shows the sleep."""
    folder = H100 / "coordinator_hang_B"
    stacks = json.loads((folder / "stacks.json").read_text())
    rep = triage(folder / "fr", stacks={int(r): s for r, s in stacks.items()})
    assert rep.verdict is Verdict.HANG and rep.culprits == [1], rep.summary
    assert rep.roots[0].kind is RootKind.HOST_STUCK and rep.roots[0].seq == 602


def _rank(n: int, *, last_state: str = "completed", timed: bool = True, duration_ms: float = 0.2,
          age_s: float = 0.0) -> dict[str, Any]:
    # Dumped ``age_s`` after the newest collective of the run (the files are written now): 0 is a running job.
    now = time.time_ns() - int(age_s * 1e9)
    return dump([entry(s, state=last_state if s == n else "completed", created_ns=now - (n - s) * 6_000_000,
                       duration_ms=duration_ms if timed and (s < n or last_state == "completed") else None)
                 for s in range(1, n + 1)], pg_config=WORLD4)


def test_a_rank_dumped_earlier_is_not_stuck(tmp_path: Path) -> None:
    for r in (0, 1, 3):
        write_json(tmp_path, f"rank{r}.json", _rank(60))
    write_json(tmp_path, "rank2.json", _rank(50, last_state="started"))
    rep = triage(tmp_path)
    assert rep.verdict is Verdict.HEALTHY, rep.summary
    assert all(r.kind is RootKind.BEHIND for r in rep.roots), rep.roots


def test_without_timing_a_young_wait_is_not_a_hang(tmp_path: Path) -> None:
    for r in (0, 1, 3):
        write_json(tmp_path, f"rank{r}.json", _rank(60, timed=False))
    write_json(tmp_path, "rank2.json", _rank(50, last_state="started", timed=False))
    rep = triage(tmp_path)
    assert rep.verdict is Verdict.HEALTHY, rep.summary
    assert any("taken while the job ran" in n for n in rep.notes), rep.notes


def test_a_rank_dumped_first_is_not_blamed_for_what_others_wait_in(tmp_path: Path) -> None:
    # Reversed: ranks 0, 1, 3 were dumped later and wait in all_reduce #61 that rank 2, dumped 0.1 s
    # before them, had not reached yet. Without the dump times this reads "rank 2 is stuck on the host".
    for r in (0, 1, 3):
        write_json(tmp_path, f"rank{r}.json", _rank(61, last_state="started", timed=False))
    write_json(tmp_path, "rank2.json", _rank(60, timed=False, age_s=0.1))
    rep = triage(tmp_path)
    assert rep.verdict is Verdict.HEALTHY, rep.summary
    # The same dumps, written two minutes after the collectives stopped: now rank 2 is the culprit.
    old = tmp_path / "old"
    for r in (0, 1, 3):
        write_json(old, f"rank{r}.json", _rank(61, last_state="started", timed=False, age_s=120))
    write_json(old, "rank2.json", _rank(60, timed=False, age_s=120.1))
    rep = triage(old)
    assert rep.verdict is Verdict.HANG and rep.roots[0].ranks == (2,), rep.summary


def test_without_timing_a_wait_that_lasted_is_still_reported(tmp_path: Path) -> None:
    # No measured durations (TORCH_NCCL_ENABLE_TIMING unset, or Gloo): "completed" may mean ended by an
    # error, so nothing is credited, and a wait of two minutes is the story.
    for r in (0, 1, 3):
        write_json(tmp_path, f"rank{r}.json", _rank(60, timed=False, age_s=120))
    write_json(tmp_path, "rank2.json", _rank(50, last_state="started", timed=False, age_s=120))
    rep = triage(tmp_path)
    assert rep.verdict is Verdict.HANG, rep.summary
    assert rep.roots[0].kind is RootKind.GPU_STALL and rep.roots[0].ranks == (2,)


def test_kernels_ended_by_an_abort_prove_nothing(tmp_path: Path) -> None:
    # Durations as long as the timeout: the watchdog aborted the communicator, the kernels ended then.
    for r in (0, 1, 3):
        write_json(tmp_path, f"rank{r}.json", _rank(60, duration_ms=600_000.0, age_s=120))
    write_json(tmp_path, "rank2.json", _rank(50, last_state="started", duration_ms=600_000.0, age_s=120))
    rep = triage(tmp_path)
    assert rep.verdict is Verdict.HANG, rep.summary
