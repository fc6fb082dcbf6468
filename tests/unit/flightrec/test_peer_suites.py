"""The peer suites' cases (PyTorch's flight-recorder analyser tests, NVIDIA's straggler tests), rebuilt as
dump folders and step records (tests/integration/fr_jobs/peer_suites.py), judged by the corpus rules an
operator relies on — the verdict, the headline names the root rank(s) and no other, no false culprit —
and, for a straggling code section, the section it is named for. One case per class also runs through
``gpuhealth triage`` as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "fr_jobs"))
import corpus  # the judging rules, shared with benchmarks/triage_quality.py
import peer_suites

from gpuhealth.flightrec.verdict import triage
from gpuhealth.model import StepRecord

CASES = peer_suites.all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_peer_case(case: peer_suites.PeerCase, tmp_path: Path) -> None:
    folder = peer_suites.write(case, tmp_path)
    (found,) = corpus.discover(tmp_path)
    assert found.dumps == folder / "dumps"
    rep, judged = corpus.judge_case(found)
    misses = peer_suites.section_misses(rep.findings, case.expected)
    assert judged.ok and not misses, f"{case.name} ({case.source}: {case.expected['why']}):\n  " + "\n  ".join(
        [*judged.reasons, *misses, f"summary: {rep.summary}"])


def test_every_case_of_both_suites_is_here() -> None:
    suites = Counter(c.suite for c in CASES)
    assert suites == {peer_suites.TORCH_SUITE: 73, peer_suites.NVIDIA_SUITE: 14}
    assert len({c.name for c in CASES}) == len(CASES)
    # every collective PyTorch's analyser knows is run once, as its test_all_events does
    assert {c.name.split("/")[1] for c in CASES if c.name.startswith("all_events/")} == set(peer_suites.COLLECTIVES)


# ------------------------------------------------------------------------------ through the real command


def _cli(case_name: str, tmp_path: Path) -> dict[str, Any]:
    case = next(c for c in CASES if c.name == case_name)
    folder = peer_suites.write(case, tmp_path)
    args = [sys.executable, "-m", "gpuhealth.cli.main", "triage", str(folder / "dumps"), "--json"]
    if case.steps:
        args += ["--steps", str(folder)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


@pytest.mark.parametrize(("case", "verdict", "culprits"), [
    ("hook/list_all_gather_wrong_count", "mismatch", [0, 1]),  # a collective whose own shapes cannot be right
    ("numel/all_gather_base_bad", "mismatch", [0, 1]),
    ("match/all_reduce_inconsistent_on_both", "mismatch", [0, 1]),
    ("p2p/send_without_recv", "hang", [5]),  # the rank that never posted the receive
    ("p2p/second_send_without_recv", "hang", [5]),  # ... also behind a pair both posted
    ("match/gather_nonroot_empty_output", "healthy", []),
    ("all_events/all_reduce", "healthy", []),  # posted everywhere, untimed: no hang is claimed
    ("relative/graded_1.1_1.2_1.3", "straggler", [1, 2, 3]),  # several ranks slow by different amounts
    ("sections/two_sections_2x", "straggler", [2]),  # named for its section
])
def test_each_class_through_gpuhealth_triage(case: str, verdict: str, culprits: list[int], tmp_path: Path) -> None:
    doc = _cli(case, tmp_path)
    assert doc["verdict"] == verdict, doc["summary"]
    assert doc["culprits"] == culprits, doc["summary"]
    if case.startswith("sections/"):
        assert any(f["code"] == "rank.straggler" and f["evidence"].get("section") == "section01"
                   and f["evidence"]["rank"] == 2 for f in doc["findings"])
    if case.startswith("all_events/"):
        assert any("no hang is claimed" in n for n in doc["notes"])
    if verdict == "mismatch":
        head = doc["findings"][0]
        assert head["code"] == "collective.size_mismatch" and head["evidence"]["shape"] == "self"


# ------------------------------------------------------------------------------------ the rules' edges


def test_a_symmetric_impossible_all_gather_is_not_blamed_when_the_group_size_is_a_guess(tmp_path: Path) -> None:
    # The same [8] -> [24] all_gather on both ranks, but no pg_config lists the members: the world is
    # guessed from the ranks that dumped (a third rank may have left no dump), so the records are not judged
    # against it; the op itself is still pending (its creation times say it lasted).
    for rank in (0, 1):
        e = peer_suites.event("all_gather", [[8]], [[24]])
        e["time_created_ns"] = 1_700_000_000_000_000_000
        doc = {"version": "2.8", "rank": rank, "entries": [e], "pg_config": {}}
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(doc))
    rep = triage(tmp_path)
    assert rep.verdict.value != "mismatch", rep.summary


def test_a_timed_stall_is_still_a_hang(tmp_path: Path) -> None:
    # The untimed rule is about missing times only: the same records with creation times are a stall.
    for rank in (0, 1):
        e = peer_suites.event("all_reduce", [[4, 4]], [[4, 4]])
        e["time_created_ns"] = 1_700_000_000_000_000_000
        (tmp_path / f"rank{rank}.json").write_text(json.dumps(peer_suites.suite_dump(rank, [e])))
    rep = triage(tmp_path)
    assert rep.verdict.value == "hang" and rep.headline is not None
    assert rep.headline.code == "collective.gpu_stall"


def test_section_records_survive_the_step_file_round_trip() -> None:
    rec = StepRecord("j", 1, 7, 1.7e9, 0.03, 0.02, None, "forward")
    assert StepRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    assert "section" not in StepRecord("j", 1, 7, 1.7e9, 0.03, 0.02).to_dict()  # whole-step records unchanged
