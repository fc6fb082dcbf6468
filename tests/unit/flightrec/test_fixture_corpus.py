"""Every committed dump with a known answer (an ``expected.json`` from the fault that was injected, see
tests/integration/fr_jobs/corpus.py) is triaged as a user would, and judged by what an operator relies on:
the verdict, the headline (the first finding of the highest severity names the root rank(s) and no other),
and no rank blamed at warning or above that is not at fault.

Cases the analyser does not get right yet are listed in XFAIL (strict: when the analyser learns a class,
its test fails until the entry is removed here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "fr_jobs"))
import corpus  # the corpus and its rules, shared with benchmarks/triage_quality.py

from gpuhealth.model import Entity, Finding, Severity

# case -> the issue-12 class it stands for. Remove an entry when the analyser gets the case right.
XFAIL: dict[str, str] = {}

CASES = corpus.discover()


def _param(case: corpus.Case) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=f"issue 12: {XFAIL[case.name]}")] if case.name in XFAIL else []
    return pytest.param(case, id=case.name, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_triage_names_the_injected_fault(case: corpus.Case) -> None:
    rep, judged = corpus.judge_case(case)
    assert judged.ok, f"{case.name} ({case.expected['why']}):\n  " + "\n  ".join(
        [*judged.reasons, f"summary: {rep.summary}"])


def test_xfail_list_names_only_cases_that_exist() -> None:
    assert set(XFAIL) <= {c.name for c in CASES}


def test_the_corpus_covers_the_classes_of_issue_12() -> None:
    # Each class is made by a real job: Gloo on CPU, and NCCL on GPUs for what Gloo does not record.
    modes = {(c.expected.get("backend"), c.name.rsplit("/", 1)[-1]) for c in CASES}
    for backend, mode in [
        ("gloo", "pipeline_hang"), ("gloo", "pipeline_batch_hang"), ("gloo", "coalesced_mismatch"),
        ("gloo", "gather_healthy"), ("gloo", "scatter_healthy"), ("gloo", "alltoall_split_mismatch"),
        ("gloo", "alltoall_uneven_healthy"), ("gloo", "broadcast_then_stall"), ("gloo", "recv_any_source"),
        ("gloo", "healthy_jitter"), ("gloo", "rank_exit"), ("gloo", "tp_pp_dp_skip"),
        ("nccl", "pipeline_hang"), ("nccl", "pipeline_batch_hang"), ("nccl", "pipeline_batch_healthy"),
        ("nccl", "coalesced_mismatch"), ("nccl", "send_recv_size_mismatch"), ("nccl", "scatter_healthy"),
        ("nccl", "alltoall_split_mismatch"), ("nccl", "broadcast_then_stall"), ("nccl", "rank_exit"),
    ]:
        assert (backend, mode) in modes, (backend, mode)
    assert sum(c.expected["verdict"] == "healthy" for c in CASES) >= 6  # false alarms are measured too


def test_every_rank_alive_at_the_dump_left_its_dump() -> None:
    # The launcher kills (SIGKILL, -9) every rank after the dumps, or a finished rank exits 0 after its dump;
    # a rank that ended otherwise (exited, aborted) left none. A fixture missing any other dump would not be
    # the run its expected.json describes.
    for case in CASES:
        codes = case.expected.get("seen", {}).get("exit_codes")
        if codes is None:
            continue
        ranks = {int(p.stem.removeprefix("rank")) for p in case.dumps.glob("rank*.json")}
        assert ranks == {int(r) for r, code in codes.items() if code in (-9, 0)}, case.name


# ------------------------------------------------------------------------------- the rules themselves


def _f(rank: int | None, sev: Severity = Severity.CRITICAL, **ev: object) -> Finding:
    evidence = dict(ev) if rank is None else {"rank": rank, **ev}
    return Finding("collective.missing_rank", sev, Entity.rank(rank) if rank is not None else Entity.node("job"),
                   "m", evidence=evidence)


HANG_3 = {"verdict": "hang", "root_ranks": [3], "why": "w", "made_by": "m"}


def test_rules_accept_the_root_first() -> None:
    j = corpus.judge("hang", [_f(3), _f(None, Severity.INFO, waiting_ranks=[0, 1, 2])], HANG_3)
    assert j.ok and j.reasons == []


def test_rules_reject_a_waiting_rank_as_headline() -> None:
    j = corpus.judge("hang", [_f(2), _f(3)], HANG_3)
    assert not j.headline_ok and j.false_culprits == [2]


def test_rules_read_the_highest_severity_first() -> None:
    # A warning listed first is not the headline when a critical finding follows.
    j = corpus.judge("hang", [_f(1, Severity.WARNING), _f(3)], HANG_3)
    assert j.headline_ok and j.false_culprits == [1]


def test_rules_reject_a_rankless_headline_and_a_wrong_verdict() -> None:
    j = corpus.judge("incomplete", [_f(None, ranks=[]), _f(3, Severity.WARNING)], HANG_3)
    assert not j.verdict_ok and not j.headline_ok


def test_rules_for_a_healthy_job_and_for_acceptable_ranks() -> None:
    healthy = {"verdict": "healthy", "root_ranks": [], "why": "w", "made_by": "m"}
    assert corpus.judge("healthy", [_f(0, Severity.INFO)], healthy).ok
    assert not corpus.judge("healthy", [_f(0, Severity.WARNING)], healthy).ok
    gloo_p2p = {**HANG_3, "root_ranks": [1], "also_acceptable": [2, 3]}
    assert corpus.judge("hang", [_f(2), _f(3)], gloo_p2p).ok
    assert not corpus.judge("hang", [_f(0), _f(1)], gloo_p2p).ok
    # Without an acceptable alternative, every root rank must be named at the top severity.
    two = {**HANG_3, "root_ranks": [2, 3]}
    assert not corpus.judge("hang", [_f(3)], two).headline_ok
    assert corpus.judge("hang", [_f(3), _f(2)], two).ok


def test_malformed_expected_is_refused_with_its_path(tmp_path: Path) -> None:
    case = tmp_path / "bad"
    (case / "dumps").mkdir(parents=True)
    (case / "expected.json").write_text('{"verdict": "stuck", "root_ranks": ["3"]}')
    with pytest.raises(ValueError, match=r"bad/expected.json: verdict must be one of"):
        corpus.discover(tmp_path)
