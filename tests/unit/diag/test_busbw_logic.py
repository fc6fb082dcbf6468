"""nccl-tests formulas, size sweeps, reference curves and judging (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhealth.diag.busbw import (
    REFERENCE_CURVES,
    Point,
    bus_factor,
    judge,
    load_curves,
    make_point,
    reference_at,
    sweep_sizes,
)
from gpuhealth.model import Action, Severity

MiB, GiB = 1 << 20, 1 << 30


def test_bus_factors_are_those_of_nccl_tests() -> None:
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_reduce", 2) == pytest.approx(1.0)
    for c in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(c, 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == bus_factor("sendrecv", 8) == 1.0
    with pytest.raises(ValueError):
        bus_factor("allgatherv", 2)


def test_algbw_and_busbw_from_size_and_time() -> None:
    # nccl-tests: 2 GiB all_reduce on 8 ranks in 10 ms → algbw 214.7 GB/s, busbw × 1.75
    p = make_point("all_reduce", 2 * GiB, 8, 0.010, 0, True)
    assert p.algbw_gbps == pytest.approx(2 * GiB / 0.010 / 1e9)
    assert p.busbw_gbps == pytest.approx(p.algbw_gbps * 1.75)
    assert p.time_us == pytest.approx(10_000)
    assert Point.from_dict(p.to_dict()) == p


def test_sweep_sizes() -> None:
    assert sweep_sizes(MiB, GiB) == [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, GiB]
    assert sweep_sizes(MiB, MiB) == [MiB]
    with pytest.raises(ValueError):
        sweep_sizes(2 * MiB, MiB)


def test_reference_curve_interpolates_in_log_size_and_is_flat_outside() -> None:
    curve = REFERENCE_CURVES["nvlink@2"]["all_reduce"]
    assert reference_at(curve, 64 * MiB) == 270
    assert reference_at(curve, 8 * GiB) == 340
    assert reference_at(curve, 1024) == 70
    mid = reference_at(curve, 8 * MiB)  # halfway between 1 MiB and 64 MiB in log size
    assert mid == pytest.approx((70 + 270) / 2)


def _pt(coll: str, size: int, busbw: float, errors: int = 0, world: int = 2) -> Point:
    return Point(coll, size, world, 1.0, busbw, busbw, errors, True)


def test_healthy_numbers_pass_and_slow_links_are_flagged_at_large_sizes_only() -> None:
    healthy = [_pt("all_reduce", MiB, 20.0), _pt("all_reduce", 64 * MiB, 266.0), _pt("all_reduce", 2 * GiB, 339.0)]
    findings, summary = judge(healthy, topology="nvlink", node="n1")
    assert findings == []  # the slow 1 MiB point is latency, not judged
    assert [j["size_bytes"] for j in summary["judged"]] == [64 * MiB, 2 * GiB]
    degraded = [_pt("all_reduce", 2 * GiB, 240.0), _pt("sendrecv", 2 * GiB, 100.0)]
    findings, _ = judge(degraded, topology="nvlink", node="n1")
    by_coll = {f.evidence["collective"]: f for f in findings}
    assert by_coll["all_reduce"].code == "busbw.low" and by_coll["all_reduce"].severity is Severity.WARNING
    assert by_coll["sendrecv"].severity is Severity.CRITICAL and by_coll["sendrecv"].action is Action.DRAIN
    assert "27%" in by_coll["sendrecv"].message and by_coll["sendrecv"].entity.id == "n1"


def test_wrong_data_is_critical_at_any_size_and_unknown_topologies_are_not_judged() -> None:
    findings, summary = judge([_pt("broadcast", MiB, 1.0, errors=3)], topology="pcie", node="n")
    assert [f.code for f in findings] == ["busbw.data_corrupt"]
    assert findings[0].severity is Severity.CRITICAL
    findings, summary = judge([_pt("broadcast", GiB, 1.0)], topology="pcie", node="n")
    assert summary["unjudged"] == ["broadcast"]
    assert [(f.code, f.severity) for f in findings] == [("busbw.unjudged", Severity.INFO)]


def test_threshold_file(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("pcie:\n  all_reduce: {1073741824: 20.0}\n")
    curves = load_curves(f)
    findings, _ = judge([_pt("all_reduce", GiB, 10.0)], topology="pcie", node="n", curves=curves)
    assert [x.code for x in findings] == ["busbw.low"]
    f.write_text("pcie: [1, 2]\n")
    with pytest.raises(ValueError, match="expected"):
        load_curves(f)


def test_each_rank_count_is_judged_against_its_own_curve() -> None:
    # Measured on 4 x H200: sendrecv at 64 MiB is 157 GB/s across 4 ranks (nccl-tests: 156) — healthy,
    # though 2 ranks reach 268. Judged against the 2-rank curve it was a false "busbw.low".
    four = [_pt("sendrecv", 64 * MiB, 157.7, world=4), _pt("all_reduce", 64 * MiB, 312.8, world=4)]
    findings, summary = judge(four, topology="nvlink", node="n")
    assert findings == []
    assert {j["reference"] for j in summary["judged"]} == {"nvlink@4"}
    findings, _ = judge([_pt("sendrecv", 64 * MiB, 157.7, world=2)], topology="nvlink", node="n")
    assert [f.code for f in findings] == ["busbw.low"] and "nvlink@2" in findings[0].message


def test_a_rank_count_without_a_curve_is_judged_on_the_plateau_of_the_nearest_one() -> None:
    eight = [_pt("sendrecv", 64 * MiB, 90.0, world=8), _pt("all_reduce", 2 * GiB, 200.0, world=8),
             _pt("all_gather", 256 * MiB, 10.0, world=8)]
    findings, summary = judge(eight, topology="nvlink", node="n")
    # 64 MiB and 256 MiB are below the plateau: their value depends on the rank count, so no verdict.
    assert sorted(summary["unjudged"]) == ["all_gather", "sendrecv"]
    low = [f for f in findings if f.code == "busbw.low"]
    assert [(f.evidence["collective"], f.evidence["size_bytes"]) for f in low] == [("all_reduce", 2 * GiB)]
    assert low[0].evidence["reference"].startswith("nvlink@4")
    assert low[0].evidence["reference_gbps"] == 359
    # What was not judged is said, not silently passed (INFO: it does not change the verdict).
    unjudged = {f.evidence["collective"]: f for f in findings if f.code == "busbw.unjudged"}
    assert sorted(unjudged) == ["all_gather", "sendrecv"]
    assert unjudged["sendrecv"].severity is Severity.INFO and "8 ranks" in unjudged["sendrecv"].message


def test_a_curve_without_a_rank_count_applies_to_every_rank_count(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("pcie:\n  all_reduce: {67108864: 20.0}\npcie@8:\n  all_reduce: {67108864: 40.0}\n")
    curves = load_curves(f)
    findings, _ = judge([_pt("all_reduce", 64 * MiB, 30.0, world=4)], topology="pcie", node="n", curves=curves)
    assert findings == []
    findings, _ = judge([_pt("all_reduce", 64 * MiB, 30.0, world=8)], topology="pcie", node="n", curves=curves)
    assert [x.evidence["reference"] for x in findings] == ["pcie@8"]


def test_real_four_rank_sweep_from_h200_is_healthy() -> None:
    # The busbw step of a real `qualify --level standard` on 4 x H200 (1 MiB to 1 GiB, six collectives).
    import json

    doc = json.loads((Path(__file__).parents[2] / "fixtures" / "diag" / "busbw_4xh200_standard.json").read_text())
    points = [Point.from_dict(p) for p in doc["points"]]
    assert {p.world for p in points} == {4}
    findings, summary = judge(points, topology="nvlink", node="n")
    assert findings == [], [f.message for f in findings]
    assert len(summary["judged"]) == 18 and min(j["ratio"] for j in summary["judged"]) > 0.95
    # What the node got before curves were per rank count: sendrecv at 64 MiB "59 % of the reference".
    two_rank = {"nvlink": REFERENCE_CURVES["nvlink@2"]}
    findings, _ = judge(points, topology="nvlink", node="n", curves=two_rank)
    assert [(f.evidence["collective"], f.evidence["size_bytes"]) for f in findings] == [("sendrecv", 64 * MiB)]
