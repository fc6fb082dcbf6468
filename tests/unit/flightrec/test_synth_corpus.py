"""The synthetic corpus of benchmarks/triage_quality.py (tests/integration/fr_jobs/synth.py): its dumps must
look like the real ones and its simulated jobs must behave like the faults they claim, or the quality
numbers measure the generator instead of triage."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "fr_jobs"))
import corpus
import synth

from gpuhealth.flightrec.load import load_dumps


def _case(klass: str, seed: int = 0) -> synth.Case:
    rng = random.Random(seed)
    for _ in range(200):
        try:
            return synth.make_case(rng, klass, 0)
        except LookupError:
            continue
    raise AssertionError(klass)


def test_a_healthy_job_runs_to_the_end_and_a_stuck_rank_stops_its_peers() -> None:
    healthy = _case("healthy")
    played = synth.play(healthy)
    assert all(all(d) and len(d) == len(p) for d, p in zip(played.done, healthy.programs, strict=True))
    stuck = _case("host_stuck")
    (culprit,) = stuck.expected["root_ranks"]
    played = synth.play(stuck)
    assert played.posted[culprit] == stuck.stuck_at[culprit]
    op = stuck.programs[culprit][stuck.stuck_at[culprit]]
    waiting = [r for r in op.group.ranks if r != culprit
               and any(not d for d in played.done[r][: played.posted[r]])]
    assert waiting, "the culprit's group peers wait for it"


def test_every_class_writes_dumps_the_loader_reads(tmp_path: Path) -> None:
    for klass in synth.CLASSES:
        case = _case(klass, seed=3)
        root = synth.write(case, tmp_path)
        doc = json.loads((root / "expected.json").read_text())
        assert corpus.check_expected(doc, klass) == [], klass
        res = load_dumps(root / "dumps")
        lost = case.missing | case.unreadable
        assert set(res.ranks) == set(range(case.job.world)) - lost, klass
        errors = {p.rank for p in res.problems if p.severity == "error"}
        assert errors <= case.unreadable, (klass, [p.message for p in res.problems])


def test_gloo_dumps_have_gloo_quirks_and_nccl_dumps_record_p2p(tmp_path: Path) -> None:
    nccl = _case("p2p_unmatched")
    assert nccl.job.backend == "nccl" and nccl.job.pp > 1
    res = load_dumps(synth.write(nccl, tmp_path) / "dumps")
    assert any(e.is_p2p for d in res.dumps.values() for e in d.entries)
    rng = random.Random(5)
    gloo = next(c for c in (synth.make_case(rng, "host_stuck", i) for i in range(40)) if c.job.backend == "gloo")
    res = load_dumps(synth.write(gloo, tmp_path) / "dumps")
    entries = [e for d in res.dumps.values() for e in d.entries]
    assert entries and all(e.state == "scheduled" and not e.is_p2p for e in entries)


@pytest.mark.parametrize("klass", ["straggler_fr", "healthy_timed"])
def test_durations_say_who_waited(klass: str, tmp_path: Path) -> None:
    case = _case(klass)
    res = load_dumps(synth.write(case, tmp_path) / "dumps")
    waited = {r: sum(e.duration_ms or 0.0 for e in d.entries) for r, d in res.dumps.items()}
    if klass == "straggler_fr":
        (slow,) = case.expected["root_ranks"]
        assert waited[slow] == min(waited.values())  # it arrives last: its collectives take least
    else:
        assert max(waited.values()) < 3 * (sum(waited.values()) / len(waited))


def test_generation_is_deterministic_per_seed() -> None:
    n = len(synth.CLASSES)
    a = [(c.name, c.expected) for c in synth.generate(n, seed=7)]
    b = [(c.name, c.expected) for c in synth.generate(n, seed=7)]
    assert a == b and {c["root_code"] for _, c in a} == set(synth.CLASSES)
