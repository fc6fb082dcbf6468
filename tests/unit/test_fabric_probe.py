"""The fabric probe's schedule, judgement and picture (pure; the ranks are tested in namespaces:
tests/integration/test_fabric_netns.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from gpuhealth.diag import fabric, heatmap
from gpuhealth.diag.fabric import Measurements, judge, schedule


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9, 16, 17])
def test_full_schedule_meets_every_pair_once_in_n_minus_1_rounds(n: int) -> None:
    rounds = schedule(n, "full")
    assert len(rounds) == (n - 1 if n % 2 == 0 else n)
    seen = [p for r in rounds for p in r]
    assert sorted(seen) == sorted(itertools.combinations(range(n), 2))  # every pair exactly once
    for r in rounds:
        busy = [x for p in r for x in p]
        assert len(busy) == len(set(busy))  # disjoint
        assert len(busy) >= n - 1  # every node busy (odd n: one idles)


@pytest.mark.parametrize("n", [8, 16, 64, 256, 10, 100])
def test_node_schedule_is_shorter_and_gives_every_node_enough_peers(n: int) -> None:
    rounds = schedule(n, "nodes")
    assert len(rounds) < len(schedule(n, "full"))
    peers = {i: set() for i in range(n)}
    for r in rounds:
        busy = [x for p in r for x in p]
        assert len(busy) == len(set(busy))
        for a, b in r:
            peers[a].add(b)
            peers[b].add(a)
    assert min(len(p) for p in peers.values()) >= fabric.MIN_PEERS


def _fleet(n: int, rounds: list[list[tuple[int, int]]] | None = None, seed: int = 1, noise: float = 0.05,
           slow: dict[tuple[int, int], float] | None = None) -> Measurements:
    rng = random.Random(seed)
    m = Measurements([f"n{i}" for i in range(n)])
    for a, b in (p for r in (rounds or schedule(n)) for p in r):
        for s, d in ((a, b), (b, a)):
            m.bandwidth[(s, d)] = 50e9 * (1 - rng.random() * noise) * (slow or {}).get((s, d), 1.0)
        m.rtt_us[(a, b)] = 10 + rng.random()
    return m


def test_healthy_names_nothing() -> None:
    v = judge(_fleet(8))
    assert v.findings == [] and v.nodes == {} and v.links == []


def test_one_direction_of_one_pair_is_that_link() -> None:
    v = judge(_fleet(8, slow={(2, 5): 0.1}))
    assert v.nodes == {} and v.links == [("n2", "n5")]
    (f,) = v.findings
    assert f.code == "netprobe.link_slow" and f.entity.id == "n2->n5" and "reverse direction is fine" in f.message


def test_a_node_whose_sends_and_receives_are_slow_is_the_node() -> None:
    slow = {p: 0.2 for p in itertools.permutations(range(8), 2) if 3 in p}
    v = judge(_fleet(8, slow=slow))
    assert v.nodes == {"n3": "node_slow"} and v.links == []
    assert [f.code for f in v.findings] == ["netprobe.node_slow"]


@pytest.mark.parametrize("side,code", [(0, "nic_send_slow"), (1, "nic_recv_slow")])
def test_one_direction_of_a_nic(side: int, code: str) -> None:
    slow = {p: 0.3 for p in itertools.permutations(range(6), 2) if p[side] == 4}
    v = judge(_fleet(6, slow=slow))
    assert v.nodes == {"n4": code} and v.links == []


def test_halving_schedule_still_names_the_node() -> None:
    slow = {p: 0.1 for p in itertools.permutations(range(16), 2) if 9 in p}
    v = judge(_fleet(16, rounds=schedule(16, "nodes"), slow=slow))
    assert v.nodes == {"n9": "node_slow"} and v.links == []


def test_too_few_nodes_are_not_judged_never_healthy() -> None:
    v = judge(_fleet(3, slow={(0, 1): 0.1}))
    assert v.reference_bps is None and v.nodes == {} and v.links == []
    assert {f.code for f in v.findings} == {"netprobe.unjudged"} and len(v.not_judged) == 3


def test_a_node_with_too_few_peers_is_not_judged() -> None:
    m = _fleet(8)
    for p in [p for p in m.bandwidth if 7 in p and 0 not in p]:
        del m.bandwidth[p]  # n7 met only n0
    v = judge(m)
    assert "n7" in v.not_judged and any(f.code == "netprobe.unjudged" and f.entity.id == "n7" for f in v.findings)


def test_high_round_trip_is_named() -> None:
    m = _fleet(6)
    m.rtt_us[(1, 4)] = 5000.0
    v = judge(m)
    assert [(f.code, f.entity.id) for f in v.findings] == [("netprobe.latency_high", "n1<->n4")]


def test_measurements_round_trip_through_json() -> None:
    m = _fleet(4)
    again = Measurements.from_dict(m.to_dict())
    assert again.names == m.names and set(again.bandwidth) == set(m.bandwidth)


def test_heatmap_is_a_png_with_the_slow_cell_red_and_healthy_cells_green() -> None:
    n = 5
    ratios = {(i, j): 1.0 for i in range(n) for j in range(n) if i != j}
    ratios[(1, 3)] = 0.05
    png = heatmap.render(n, ratios, 0.6)
    w, h, rows = heatmap.read_png_rgb(png)
    assert w >= 100 and h >= 100
    left, top, cell, _ = heatmap.layout(n)

    def at(i: int, j: int) -> tuple[int, ...]:
        x, y = left + j * cell + cell // 2, top + i * cell + cell // 2
        return tuple(rows[y][3 * x:3 * x + 3])

    r, g, _ = at(1, 3)
    assert r > 200 and g < 60  # the slow direction (row = sender 1, column = receiver 3) is red
    r, g, _ = at(3, 1)
    assert g > 150 and r < 60  # its reverse is green
    assert at(2, 2) == heatmap.DIAGONAL
