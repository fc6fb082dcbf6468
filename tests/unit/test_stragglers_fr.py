"""Stragglers from flight-recorder ``duration_ms`` alone: the rank whose collectives take least
(it arrives last) is named; a tensor-parallel peer that waited for it is not; with start times the
lateness is judged relative to the step."""

from __future__ import annotations

import numpy as np

from gpuhealth.stragglers import detect_from_durations


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


def test_unreadable_items_are_skipped() -> None:
    dumps = _dumps(4, 40, slow=0)
    dumps[1] = [*dumps[1], ("world", "x", 1.0), ("world",), ("world", 99, float("nan")), ("world", 98, -3.0)]  # type: ignore[list-item]
    assert [f.evidence["rank"] for f in detect_from_durations(dumps)] == [0]
    assert detect_from_durations({}) == [] and detect_from_durations({0: []}) == []
