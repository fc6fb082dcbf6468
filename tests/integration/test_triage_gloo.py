"""Real multi-process PyTorch jobs (Gloo on CPU, 4 ranks, TORCH_FR_BUFFER_SIZE set, dumps taken on
demand by a watchdog thread in each rank before the process-group timeout) with one injected fault
each; triage must name the right rank and finding code, and say nothing about a healthy run.

All eight jobs run once per session (two at a time) and every assertion shares them."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpuhealth.flightrec.verdict import TriageReport, triage
from gpuhealth.model import StepRecord

pytestmark = pytest.mark.integration

HARNESS = Path(__file__).parent / "fr_jobs" / "job.py"
MODES = ["healthy", "hang_skip", "hang_sleep", "subgroup_hang", "subgroup_skip", "type_mismatch", "size_mismatch",
         "dtype_mismatch", "straggler"]
CULPRIT = 3
# job name -> (mode, extra harness options). "hang_sleep_late" is dumped only after the 3 s
# process-group timeout fired (the waiting ranks caught the error and stayed up to be dumped).
JOBS = {m: (m, ["--pg-timeout", "30", "--stall-s", "2.0"]) for m in MODES}
JOBS["hang_sleep_late"] = ("hang_sleep", ["--pg-timeout", "3", "--stall-s", "5.0"])


def _run(mode: str, extra: list[str], out: Path) -> Path:
    cmd = [sys.executable, str(HARNESS), "--mode", mode, "--out", str(out), "--world-size", "4",
           "--culprit", str(CULPRIT), "--steps", "14", "--fault-step", "4", "--compute-s", "0.05",
           "--buffer", "500", "--job-timeout", "60", *extra]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("frjobs")
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(_run, mode, extra, base / name) for name, (mode, extra) in JOBS.items()}
        return {name: f.result() for name, f in futures.items()}


def _steps(folder: Path) -> list[StepRecord]:
    return [StepRecord.from_dict(json.loads(line)) for p in sorted(folder.glob("steps_rank*.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]


def _triage(folder: Path) -> TriageReport:
    return triage(folder / "dumps", steps=_steps(folder))


def _codes(rep: TriageReport) -> list[tuple[str, object]]:
    return [(f.code, f.evidence.get("rank")) for f in rep.findings]


@pytest.mark.slow
def test_every_rank_dumped(jobs: dict[str, Path]) -> None:
    for mode, folder in jobs.items():
        launcher = json.loads((folder / "launcher.json").read_text())
        assert sorted(p.name for p in (folder / "dumps").glob("*.json")) == [f"rank{r}.json" for r in range(4)], mode
        if mode in ("hang_skip", "hang_sleep", "subgroup_hang", "subgroup_skip", "type_mismatch"):
            assert launcher["reason"] == "stalled", mode


def test_healthy_run_reports_nothing(jobs: dict[str, Path]) -> None:
    rep = _triage(jobs["healthy"])
    assert rep.verdict == "healthy"
    assert rep.findings == []
    assert rep.ranks_seen == [0, 1, 2, 3] and rep.ranks_missing == []


@pytest.mark.parametrize(("mode", "verdict", "code", "group"), [
    ("hang_skip", "hang", "collective.missing_rank", "0"),
    ("hang_sleep", "hang", "collective.missing_rank", "0"),
    ("subgroup_hang", "hang", "collective.missing_rank", "2"),
    ("subgroup_skip", "hang", "collective.missing_rank", "2"),
    ("type_mismatch", "mismatch", "collective.type_mismatch", "0"),
    ("size_mismatch", "mismatch", "collective.size_mismatch", "0"),
    ("dtype_mismatch", "mismatch", "collective.dtype_mismatch", "0"),
])
def test_fault_is_named_with_rank_code_and_group(jobs: dict[str, Path], mode: str, verdict: str, code: str,
                                                 group: str) -> None:
    rep = _triage(jobs[mode])
    assert rep.verdict == verdict, rep.summary
    assert _codes(rep) == [(code, CULPRIT)], rep.summary
    ev = rep.findings[0].evidence
    assert ev["group"] == group
    assert any("job.py" in line for line in ev.get("stack", [])), "call site from the pickle's frames"


def test_subgroup_hang_root_and_consequence(jobs: dict[str, Path]) -> None:
    ev = _triage(jobs["subgroup_hang"]).findings[0].evidence
    assert ev["waiting_ranks"] == [2]  # the culprit's TP peer
    assert ev["consequences"] == ["0"]  # ranks 0,1 wait in the world group because of it


def test_skip_is_recognised_as_a_skipped_collective(jobs: dict[str, Path]) -> None:
    ev = _triage(jobs["hang_skip"]).findings[0].evidence
    assert ev["kind"] == "skipped" and ev["waiting_ranks"] == [0, 1, 2]


def test_subgroup_skip_blames_the_skipper_not_its_waiting_peer(jobs: dict[str, Path]) -> None:
    # Rank 3 skipped its TP all_reduce: its peer (2) waits in the TP group and is itself "ahead" there,
    # while 0, 1 and 3 wait for 2 in the world group. Counting alone cannot tell 2 from 3; the ranks'
    # own order of collectives can.
    ev = _triage(jobs["subgroup_skip"]).findings[0].evidence
    assert ev["kind"] == "skipped" and ev["waiting_ranks"] == [2]
    assert ev["consequences"] == ["0"]


def test_mismatch_evidence_has_exact_sizes(jobs: dict[str, Path]) -> None:
    ev = _triage(jobs["size_mismatch"]).findings[0].evidence
    assert ev["actual"]["input_sizes"] == [[2048]] and ev["expected"]["input_sizes"] == [[1024]]
    assert ev["decided_by"] == "majority"
    assert ev["completed"] is True  # a broadcast leaf: Gloo let it pass silently
    ev = _triage(jobs["type_mismatch"]).findings[0].evidence
    assert ev["actual"]["op"] == "all_gather" and ev["expected"]["op"] == "all_reduce"


def test_straggler_doing_twice_the_compute(jobs: dict[str, Path]) -> None:
    rep = _triage(jobs["straggler"])
    assert rep.verdict == "straggler"
    assert _codes(rep) == [("rank.straggler", CULPRIT)]
    ev = rep.findings[0].evidence
    assert 1.6 <= ev["ratio_to_median"] <= 2.4
    assert 4 <= ev["since_step"] <= 6
    # Without the step records the dumps alone (Gloo: no durations) show nothing wrong.
    assert triage(jobs["straggler"] / "dumps").verdict == "healthy"


def test_cli_json_and_exit_codes(jobs: dict[str, Path]) -> None:
    exe = [sys.executable, "-m", "gpuhealth.cli.main", "triage"]
    hang = subprocess.run([*exe, str(jobs["hang_sleep"] / "dumps"), "--json"], capture_output=True, text=True)
    assert hang.returncode == 2, hang.stderr
    doc = json.loads(hang.stdout)
    assert doc["verdict"] == "hang" and doc["culprits"] == [CULPRIT]
    assert all("rank" in f["evidence"] for f in doc["findings"] if f["entity"]["kind"] == "rank")
    slow = subprocess.run([*exe, str(jobs["straggler"] / "dumps"), "--steps", str(jobs["straggler"]),
                           "--exit-codes", "slurm"], capture_output=True, text=True)
    assert slow.returncode == 0 and slow.stdout.startswith("STRAGGLER: culprit rank(s) 3")
    ok = subprocess.run([*exe, str(jobs["healthy"] / "dumps")], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("HEALTHY")
    assert "no errors found" not in ok.stdout.lower()


def test_dump_after_the_timeout_still_names_the_rank(jobs: dict[str, Path]) -> None:
    # Gloo marks the timed-out collective finished on the ranks that waited: the "pending" evidence
    # is gone, but rank 3 never enqueued it and the others went idle for longer than the timeout.
    assert sorted(p.name for p in jobs["hang_sleep_late"].glob("error_rank*.txt")) == [
        "error_rank0.txt", "error_rank1.txt", "error_rank2.txt"]
    rep = _triage(jobs["hang_sleep_late"])
    assert rep.verdict == "hang", rep.summary
    assert _codes(rep) == [("collective.missing_rank", CULPRIT)]
    ev = rep.findings[0].evidence
    assert ev["kind"] == "timed_out" and ev["group"] == "0" and ev["timeout_s"] == 3.0


def test_pickles_alone_give_the_same_verdict(jobs: dict[str, Path], tmp_path: Path) -> None:
    for mode in ("hang_sleep", "type_mismatch"):
        pkls = sorted((jobs[mode] / "dumps").glob("*.pkl"))
        rep = triage(pkls)
        assert rep.identity == {r: "filename" for r in range(4)}
        assert _codes(rep) == _codes(triage(jobs[mode] / "dumps")), mode
