"""`gpuhealth triage FOLDER` never gives a clean bill of health on evidence it set aside (issue 26).

Through the real command, on real recorded dumps (tests/fixtures/flightrec): several jobs in one folder
are each triaged; one job spread over node folders or node prefixes stays one job; step files beside
the dumps are read; a second dump of a rank is shown in the human output and keeps the verdict from
"healthy"."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from frbuild import FIXTURES

GPUHEALTH = str(Path(sys.executable).parent / "gpuhealth")
GLOO = FIXTURES / "gloo_4rank"
NCCL = FIXTURES / "nccl_2gpu"


def _triage(*args: str) -> tuple[int, str, str]:
    out = subprocess.run([GPUHEALTH, "triage", *args], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, out.stdout, out.stderr


def _copy(case: Path, to: Path, prefix: str = "", ranks: str = "0123") -> None:
    to.mkdir(parents=True, exist_ok=True)
    for f in sorted((case / "dumps").iterdir()):
        if f.stem[-1] in ranks:
            shutil.copy(f, to / f"{prefix}{f.name}")


def test_two_jobs_in_subfolders_are_each_triaged(tmp_path: Path) -> None:
    # The case: one healthy job and one hung job side by side read as "HEALTHY: 4 rank(s)", exit 0.
    _copy(GLOO / "healthy", tmp_path / "jobA")
    _copy(GLOO / "hang_sleep", tmp_path / "jobB")
    code, out, _ = _triage(str(tmp_path))
    assert code == 2, out  # the worst of the two: unhealthy
    lines = out.splitlines()
    assert lines[0] == f"2 jobs in {tmp_path}, each triaged on its own: 1 hang, 1 healthy"
    assert lines[1].startswith("  jobA: HEALTHY: 4 rank(s)")
    assert lines[2].startswith("  jobB: HANG: culprit rank(s) 3 — rank 3 never reached gloo:all_reduce #4")
    assert "=== job jobB (8 file(s)) ===" in out and "[critical] collective.missing_rank  rank 3" in out
    doc = json.loads(_triage(str(tmp_path), "--json")[1])
    assert doc["verdict"] == "hang"
    assert [(j["job"], j["verdict"], j["ranks_seen"]) for j in doc["jobs"]] == \
        [("jobA", "healthy", [0, 1, 2, 3]), ("jobB", "hang", [0, 1, 2, 3])]


def test_two_jobs_side_by_side_told_apart_by_their_name_prefixes(tmp_path: Path) -> None:
    _copy(GLOO / "healthy", tmp_path, prefix="jobA-")
    _copy(GLOO / "hang_sleep", tmp_path, prefix="jobB-")
    code, out, _ = _triage(str(tmp_path))
    assert code == 2
    assert out.splitlines()[1:3] == [
        "  jobA-*: HEALTHY: 4 rank(s), no stuck, mismatched or straggling rank",
        "  jobB-*: " + _triage(str(GLOO / "hang_sleep" / "dumps"))[1].splitlines()[0]]


def test_one_job_spread_over_node_folders_or_node_prefixes_stays_one_job(tmp_path: Path) -> None:
    alone = _triage(str(GLOO / "hang_sleep" / "dumps"))
    _copy(GLOO / "hang_sleep", tmp_path / "folders" / "node0", ranks="01")
    _copy(GLOO / "hang_sleep", tmp_path / "folders" / "node1", ranks="23")
    _copy(GLOO / "hang_sleep", tmp_path / "prefixes", prefix="node0-", ranks="01")
    _copy(GLOO / "hang_sleep", tmp_path / "prefixes", prefix="node1-", ranks="23")
    for layout in ("folders", "prefixes"):
        code, out, _ = _triage(str(tmp_path / layout))
        assert code == alone[0] == 2
        assert out.splitlines()[0] == alone[1].splitlines()[0], out


def test_a_folder_of_every_fixture_job_gives_each_its_own_expected_verdict() -> None:
    # 82 real jobs (NCCL on 2 and 4 GPUs, Gloo on 4 ranks, step files beside the Gloo ones): before,
    # one rank 0 of 82 was read, and one verdict reported.
    code, out, _ = _triage(str(FIXTURES), "--json")
    doc = json.loads(out)
    assert code == 2 and len(doc["jobs"]) == 82
    for job in doc["jobs"]:
        folder = FIXTURES / job["job"]
        expected = folder / "expected.json" if folder.is_dir() and (folder / "expected.json").exists() \
            else FIXTURES / f"{job['job']}.expected.json"
        assert job["verdict"] == json.loads(expected.read_text())["verdict"], (job["job"], job["summary"])
    assert {j["job"] for j in doc["jobs"] if j["verdict"] == "straggler"} >= {"gloo_4rank/straggler_1.1"}


def test_step_files_beside_the_dumps_are_read(tmp_path: Path) -> None:
    # A straggler shows in step times: a folder holding the dumps and the steps said HEALTHY without --steps.
    code, out, _ = _triage(str(GLOO / "straggler_1.1"))
    assert code == 1 and out.startswith("STRAGGLER: culprit rank(s) 3"), out
    assert "note: step records read from 4 file(s) beside the dumps (steps_rank0.jsonl" in out
    # other JSON lines (a log) are not step records, and nothing is said about them
    shutil.copytree(GLOO / "healthy", tmp_path / "case")
    (tmp_path / "case" / "events.jsonl").write_text('{"event": "start"}\n')
    code, out, _ = _triage(str(tmp_path / "case"))
    assert code == 0 and out.startswith("HEALTHY") and "events.jsonl" not in out


def test_a_second_dump_of_a_rank_is_shown_and_withholds_a_clean_bill(tmp_path: Path) -> None:
    _copy(NCCL / "healthy", tmp_path)
    shutil.copy(tmp_path / "rank0.json", tmp_path / "rank_0.json")
    code, out, _ = _triage(str(tmp_path))
    assert code == 3, out  # unknown: the second rank-0 dump was not read
    assert out.startswith("INCOMPLETE: no fault in the 2 rank(s) read, but 1 dump file(s) of ranks already read")
    assert "1 file(s) read with a caveat:" in out and "this file is ignored" in out


def test_options_that_describe_one_job_are_refused_for_several(tmp_path: Path) -> None:
    _copy(NCCL / "healthy", tmp_path / "a")
    _copy(NCCL / "hang_sleep", tmp_path / "b")
    code, out, err = _triage(str(tmp_path), "--world-size", "2")
    assert code == 64 and out == ""  # a usage error
    assert err.strip().splitlines()[-1] == (f"Error: --world-size, --group and --stacks describe one job, but "
                                            f"{tmp_path} holds 2 jobs (a, b): give one job's folder")


def test_jobs_with_no_rank_in_common_are_told_apart_by_time(tmp_path: Path) -> None:
    # Ranks 0-1 and ranks 2-3 of one 4-GPU run: the names and the world (4) fit one job, and the times do
    # too; with the second half's times two hours later (beyond its 10-minute collective timeout), they don't.
    nccl4 = FIXTURES / "nccl_4gpu"
    for folder in ("later", "same"):
        _copy(nccl4 / "hang_sleep", tmp_path / folder / "a", ranks="01")
        _copy(nccl4 / "hang_sleep", tmp_path / folder / "b", ranks="23")
    for f in (tmp_path / "later" / "b").glob("*.json"):
        doc = json.loads(f.read_text())
        for e in doc.get("entries", []):
            for key in ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns"):
                if e.get(key):
                    e[key] += 2 * 3600 * 10**9
        f.write_text(json.dumps(doc))
    for p in (tmp_path / "later" / "b").glob("*.pkl"):
        p.unlink()  # its times are those of the run it came from
    doc = json.loads(_triage(str(tmp_path / "later"), "--json")[1])
    assert [(j["job"], j["ranks_seen"], j["ranks_missing"]) for j in doc["jobs"]] == \
        [("a", [0, 1], [2, 3]), ("b", [2, 3], [0, 1])]
    assert doc["jobs"][0]["verdict"] == "incomplete" and doc["jobs"][1]["verdict"] != "healthy"
    # recorded together, they are one job
    together = json.loads(_triage(str(tmp_path / "same"), "--json")[1])
    assert "jobs" not in together and together["ranks_seen"] == [0, 1, 2, 3]
