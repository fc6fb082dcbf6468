"""Stragglers from flight-recorder ``duration_ms`` alone: the rank whose collectives take least
(it arrives last) is named; a tensor-parallel peer that waited for it is not; with start times the
lateness is judged relative to the step."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from gpuhealth.flightrec.load import load_dumps
from gpuhealth.flightrec.verdict import triage
from gpuhealth.stragglers import detect_from_durations

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "fr_jobs"))
import synth  # the triage corpus generator: NCCL dumps with durations, JSON or pickle


def _dumps(world: int, steps: int, *, slow: int | None = None, factor: float = 1.5, onset: int = 0,
           noise: float = 0.03, tp: bool = False, timed: bool = False, seed: int = 0,
           ) -> dict[int, list[tuple[str, int, float] | tuple[str, int, float, int]]]:
    """Each step: compute, then (with ``tp``) an all_reduce in each pair {0,1}, {2,3}, …, then a world
    all_reduce. A collective lasts from a rank's arrival until the last member arrived (+ transfer)."""
    rng = np.random.default_rng(seed)
    out: dict[int, list[tuple[str, int, float] | tuple[str, int, float, int]]] = {r: [] for r in range(world)}
    t0 = 0.0
    for step in range(steps):
        comp = 0.020 * np.maximum(0.2, 1 + noise * rng.normal(size=world))
        if slow is not None and step >= onset:
            comp[slow] *= factor
        arrive = comp.copy()
        if tp:
            for p in range(0, world, 2):
                done = max(comp[p], comp[p + 1]) + 0.0002
                for r in (p, p + 1):
                    out[r].append((f"tp{p // 2}", step + 1, (done - comp[r]) * 1000, int((t0 + comp[r]) * 1e9)))
                    arrive[r] = done
        done = arrive.max() + 0.001
        for r in range(world):
            out[r].append(("world", step + 1, (done - arrive[r]) * 1000, int((t0 + arrive[r]) * 1e9)))
        t0 += done
    if not timed:
        return {r: [(x[0], x[1], x[2]) for x in items] for r, items in out.items()}  # as triage passes them
    return out


def test_the_rank_whose_collectives_are_shortest_is_the_straggler() -> None:
    found = detect_from_durations(_dumps(4, 40, slow=3, onset=10))
    assert [f.evidence["rank"] for f in found] == [3]
    f = found[0]
    assert "waits least" in f.message and f.evidence["measure"] == "flight-recorder duration_ms"
    assert f.evidence["since_collective"] == "group world collective #11"  # step 10 is collective #11
    assert 9.0 <= f.evidence["excess_s"] * 1000 <= 11.0  # the others wait ~10 ms for it


def test_healthy_durations_give_nothing() -> None:
    assert detect_from_durations(_dumps(8, 60, noise=0.2)) == []
    assert detect_from_durations(_dumps(2, 60, noise=0.05, seed=3)) == []


def test_the_tensor_parallel_peer_that_waited_for_it_is_not_blamed() -> None:
    # Rank 2 reaches the world all_reduce as late as rank 3 (it waited for it in their pair), but its
    # wait over the whole step is the others', not the straggler's.
    found = detect_from_durations(_dumps(8, 60, slow=3, tp=True))
    assert [f.evidence["rank"] for f in found] == [3]


def test_with_start_times_lateness_is_relative_to_the_step() -> None:
    found = detect_from_durations(_dumps(4, 80, slow=1, factor=1.2, tp=True, timed=True))
    assert [f.evidence["rank"] for f in found] == [1]
    ev = found[0].evidence
    assert 1.15 <= ev["ratio_to_median"] <= 1.25
    assert 0.1 <= ev["cost_share"] <= 0.2  # 4 ms of a ~25 ms step
    assert "costs the job" in found[0].message


def test_with_two_ranks_the_excess_is_measured_against_the_other_rank() -> None:
    # Rank 1 computes 40 ms where rank 0 computes 20: rank 0 waits 20 ms a step, about half of it. The
    # median of both ranks would sit halfway to the straggler and overstate that by sqrt(2).
    found = detect_from_durations(_dumps(2, 60, slow=1, factor=2.0, noise=0.02, timed=True))
    assert [f.evidence["rank"] for f in found] == [1]
    ev = found[0].evidence
    assert 18.0 <= ev["excess_s"] * 1000 <= 22.0
    assert 0.42 <= ev["cost_share"] <= 0.52


def _real(case: str, clock: str | None) -> dict[int, list[tuple[str, int, float] | tuple[str, int, float, int]]]:
    dumps = load_dumps(Path(__file__).parent.parent / "fixtures" / "flightrec" / case / "dumps").dumps
    return {r: [(e.group, e.seq, float(e.duration_ms), getattr(e, clock)) if clock else
                (e.group, e.seq, float(e.duration_ms))
                for e in d.entries if e.duration_ms is not None and not e.is_p2p and e.seq > 0]
            for r, d in dumps.items()}


def test_real_nccl_dumps_with_their_enqueue_times_give_the_true_slowdown() -> None:
    # 4 x H200, TP pairs + world: rank 3 does 1.5x the compute (24 -> 36 ms) from step 10; 2 x H200:
    # rank 1 does 2x. With each collective's created_ns the step is known, so the ratio is the true one.
    for case, rank, factor in (("nccl_4gpu/straggler", 3, 1.5), ("nccl_2gpu/straggler", 1, 2.0)):
        found = detect_from_durations(_real(case, "created_ns"))
        assert [f.evidence["rank"] for f in found] == [rank]
        assert abs(found[0].evidence["ratio_to_median"] - factor) < 0.05 * factor
        # its steps end where the ranks compute: after the world all_reduce, not the TP pair's
        assert str(found[0].evidence["since_collective"]).startswith("group 0 collective #")
        assert found[0].evidence["cost_share"] > 0.3
        # The watchdog's started_ns ticks in 100 ms: refused, judged by lateness instead.
        assert [f.evidence["rank"] for f in detect_from_durations(_real(case, "started_ns"))] == [rank]
    for case in ("nccl_4gpu/healthy", "nccl_2gpu/healthy"):
        assert detect_from_durations(_real(case, "created_ns")) == []


def test_start_times_that_cannot_be_steps_fall_back_to_lateness() -> None:
    # A clock that ticks every 100 ms (NCCL's watchdog discovery time) gives zero gaps and
    # quanta, not steps: judged by lateness instead of a wrong step length.
    timed = _dumps(4, 80, slow=1, factor=1.5, tp=True, timed=True)
    coarse = {r: [(x[0], x[1], x[2], int(x[3] // 100_000_000 * 100_000_000)) for x in items]  # type: ignore[misc]
              for r, items in timed.items()}
    found = detect_from_durations(coarse)
    assert [f.evidence["rank"] for f in found] == [1]
    assert found[0].evidence["cost_share"] is None and "waits least" in found[0].message


def test_unreadable_items_are_skipped() -> None:
    dumps = _dumps(4, 40, slow=0)
    dumps[1] = [*dumps[1], ("world", "x", 1.0), ("world",), ("world", 99, float("nan")), ("world", 98, -3.0)]  # type: ignore[list-item]
    assert [f.evidence["rank"] for f in detect_from_durations(dumps)] == [0]
    assert detect_from_durations({}) == [] and detect_from_durations({0: []}) == []


# ---------------------------------------------------------------- TP × DP layouts without a world group


def _grid(tp: int, dp: int, steps: int, *, slow: int | None = None, factor: float = 1.5, noise: float = 0.05,
          buckets: int = 1, world_op: bool = False, timed: bool = True, seed: int = 0,
          spikes: dict[tuple[int, int], float] | None = None,
          ) -> dict[int, list[tuple[str, int, float] | tuple[str, int, float, int]]]:
    """Ranks d·tp + t. Per step: compute, a TP all_reduce, ``buckets`` DP all_reduces back to back (the
    first waits for the DP group's slowest TP group), optionally a world all_reduce. Groups are named in
    creation order as torch names them: world "0", TP groups "1".."dp" (if tp > 1), DP groups after them. Compute
    jitter is uniform ±``noise``; ``spikes``: (rank, step) -> compute × that once. A collective lasts from a
    rank's arrival until the last member arrived."""
    rng = np.random.default_rng(seed)
    world = tp * dp
    tp_name = {r: str(1 + r // tp) for r in range(world)}
    dp_name = {r: str(1 + (dp if tp > 1 else 0) + r % tp) for r in range(world)}
    out: dict[int, list[tuple[str, int, float] | tuple[str, int, float, int]]] = {r: [] for r in range(world)}
    seqs: dict[str, int] = {}
    clock = np.zeros(world)

    def collective(ranks: list[int], name: str, arrive: np.ndarray) -> None:
        seqs[name] = seqs.get(name, 0) + 1
        done = max(arrive[r] for r in ranks) + 0.00005
        for r in ranks:
            out[r].append((name, seqs[name], (done - arrive[r]) * 1000, int(1.7e18 + arrive[r] * 1e9)))
            arrive[r] = done

    for step in range(steps):
        clock += 0.05 * (1 + rng.uniform(-noise, noise, world))
        if slow is not None:
            clock[slow] += 0.05 * (factor - 1)
        for (r, at), times in (spikes or {}).items():
            clock[r] += 0.05 * (times - 1) if at == step else 0.0
        for d in range(dp if tp > 1 else 0):
            collective(list(range(d * tp, d * tp + tp)), tp_name[d * tp], clock)
        for _ in range(buckets):
            for t in range(tp):
                collective(list(range(t, world, tp)), dp_name[t], clock)
        if world_op:
            collective(list(range(world)), "0", clock)
    if not timed:
        return {r: [(x[0], x[1], x[2]) for x in items] for r, items in out.items()}
    return out


@pytest.mark.parametrize("timed", [True, False])
@pytest.mark.parametrize(("tp", "dp", "buckets", "slow"), [(8, 3, 1, 13), (2, 4, 3, 6), (4, 4, 2, 0), (2, 2, 1, 3)])
def test_a_straggler_is_named_without_a_group_that_spans_the_job(tp: int, dp: int, buckets: int, slow: int,
                                                                   timed: bool) -> None:
    # No collective spans the job: the largest groups are a different group on every rank. Its TP peers
    # wait least in their own DP groups (they reach them with it) but long in the TP group: not named.
    found = detect_from_durations(_grid(tp, dp, 20, slow=slow, buckets=buckets, timed=timed))
    assert [f.evidence["rank"] for f in found] == [slow]
    if timed:
        assert 1.4 <= found[0].evidence["ratio_to_median"] <= 1.6


@pytest.mark.parametrize("timed", [True, False])
@pytest.mark.parametrize(("tp", "dp", "buckets"), [(8, 3, 1), (2, 4, 3), (4, 2, 2), (8, 8, 2)])
def test_a_healthy_tp_dp_job_with_jitter_is_quiet(tp: int, dp: int, buckets: int, timed: bool) -> None:
    for seed in range(3):
        assert detect_from_durations(_grid(tp, dp, 40, noise=0.15, buckets=buckets, timed=timed, seed=seed)) == []


@pytest.mark.parametrize("timed", [True, False])
def test_one_slow_step_is_not_split_between_two_steps(timed: bool) -> None:
    # Ranks 3 and 12 (TP groups 1 and 2) compute 4x once, two steps apart. Every rank waits for each — its
    # TP peers in the TP all_reduce, everyone else in the DP all_reduce after it — in one step, because
    # every rank's step is cut where it computes (after the DP all_reduce). Cut after the TP all_reduce,
    # its TP peers would wait in one step and the others in the next: each half of the job slower than
    # the other by a whole step of compute in four of eight steps.
    for noise in (0.0, 0.05):
        spikes = {(3, 20): 4.0, (12, 22): 4.0}
        assert detect_from_durations(_grid(8, 2, 40, noise=noise, spikes=spikes, timed=timed)) == []


@pytest.mark.parametrize("before", [0, 1, 3])
def test_without_start_times_the_cut_does_not_trust_sequence_ids_to_count_steps(before: int) -> None:
    # DDP broadcasts the parameters in the DP group before the first step: its sequence ids run ahead of the
    # TP groups'. Counting steps by them would cut after the TP all_reduce; the cut where the waits for a
    # slow step fall in one step for every rank is after the DP all_reduce, whatever the ids say.
    def shifted(dumps: dict[int, list[tuple[str, int, float] | tuple[str, int, float, int]]],
                ) -> dict[int, list[tuple[str, int, float]]]:
        dp_groups = {str(3 + t) for t in range(8)}
        return {r: [(g, seq + (before if g in dp_groups else 0), ms) for g, seq, ms, *_ in items]
                for r, items in dumps.items()}

    for seed in range(3):
        healthy = _grid(8, 2, 40, spikes={(3, 20): 4.0, (12, 22): 4.0}, timed=False, seed=seed)
        assert detect_from_durations(shifted(healthy)) == []
        slow = _grid(8, 2, 40, slow=9, factor=1.3, timed=False, seed=seed)
        assert [f.evidence["rank"] for f in detect_from_durations(shifted(slow))] == [9]


def test_a_step_is_every_bucket_of_the_step_not_each_collective() -> None:
    # Three DP buckets per step: the step is the three of them (after the TP all_reduce), so a 1.2x rank is
    # judged against whole steps — each bucket on its own would read as three noisy steps.
    dumps = _grid(2, 4, 60, slow=5, factor=1.2, buckets=3)
    found = detect_from_durations(dumps)
    assert [f.evidence["rank"] for f in found] == [5]
    assert 1.15 <= found[0].evidence["ratio_to_median"] <= 1.25
    # Named in the rank's own DP group (the larger family), by the bucket that ends a step: the third.
    since = str(found[0].evidence["since_collective"])
    assert since.startswith("group 6 collective #") and int(since.rsplit("#", 1)[1]) % 3 == 0


def test_buckets_back_to_back_in_the_only_group_are_told_apart_by_time() -> None:
    # Data parallel alone, two buckets per step in one group: nothing in the order of collectives shows
    # where a step ends; the time outside collectives does (none between the buckets, compute after).
    dumps = _grid(1, 8, 30, slow=7, buckets=2)
    assert {g for items in dumps.values() for g, *_ in items} == {"1"}
    found = detect_from_durations(dumps)
    assert [f.evidence["rank"] for f in found] == [7]
    assert 1.4 <= found[0].evidence["ratio_to_median"] <= 1.6
    assert str(found[0].evidence["since_collective"]).startswith("group 1 collective #")


def test_a_ring_buffer_that_kept_eight_steps_is_enough() -> None:
    # Five collectives per step, 40 kept per rank (NCCL's buffer was cut): eight whole steps, the first
    # one too — the dump holds a full cycle of collectives before its first mark.
    dumps = _grid(8, 2, 20, slow=11, buckets=3, world_op=True)
    cut = {r: items[-40:] for r, items in dumps.items()}
    found = detect_from_durations(cut)
    assert [f.evidence["rank"] for f in found] == [11]


def _synth_grid_case(klass: str) -> synth.Case:
    """The first case of ``klass`` whose job has TP and DP groups and no world all_reduce."""
    for seed in range(500):
        try:
            case = synth.make_case(random.Random(seed), klass, 0)
        except LookupError:
            continue
        if case.job.tp > 1 and case.job.dp > 1 and not case.job.loss_all_reduce:
            return case
    raise AssertionError(f"no {klass} case without a world collective")


def test_triage_names_the_straggler_of_a_tp_dp_job_from_its_dumps(tmp_path: Path) -> None:
    case = _synth_grid_case("straggler_fr")
    report = triage(synth.write(case, tmp_path) / "dumps")
    assert report.verdict.value == "straggler"
    assert report.culprits == case.expected["root_ranks"]
    healthy = _synth_grid_case("healthy_timed")
    report = triage(synth.write(healthy, tmp_path) / "dumps")
    assert report.verdict.value == "healthy" and report.culprits == []


_SPARSE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_stragglers_fr import _dumps
from gpuhealth.model import StepRecord
from gpuhealth.stragglers import detect_from_durations, detect_stragglers
far = 1_048_575  # the last rank a dump may have
dumps = {(r if r < 3 else far): items for r, items in _dumps(4, 100, slow=3, timed=True).items()}
records = [StepRecord("job", r if r < 3 else far, s, 0.0, 0.03,
                      compute_s=0.02 * (1.5 if r == 3 else 1.0 + 0.01 * ((s + r) % 3)))
           for s in range(100) for r in range(4)]
print(json.dumps([[f.evidence["rank"] for f in detect_from_durations(dumps)],
                  [f.evidence["rank"] for f in detect_stragglers(records)],
                  detect_from_durations(dumps)[0].message]))
"""


def test_sparse_rank_ids_do_not_size_the_analysis() -> None:
    # Dumps of ranks 0, 1, 2 and 1,048,575 of a huge job (what an operator copied): four columns, not a
    # million — within 2 GiB of address space (a steps × million matrix of 100 steps is 800 MB, several
    # of them were made).
    from capped import run_capped  # here: the child imports this module with only its own folder on the path

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = run_capped([sys.executable, "-c", _SPARSE, str(Path(__file__).parent)], mem_bytes=2 << 30,
                      capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from_durations, from_records, message = json.loads(proc.stdout)
    assert from_durations == [1_048_575] and from_records == [1_048_575]
    assert message.startswith("rank 1048575 is a straggler")
