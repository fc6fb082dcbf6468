"""Fabric probe: which rounds to run, and which node, NIC direction or link the measurements name.

Pure and torch-free (the agent, the CLI and the benchmark import it); the ranks that measure live in
``fabric_rank.py`` and the picture in ``heatmap.py``.

Schedule. ``full``: the round-robin tournament (circle method) — N−1 rounds (N odd: N rounds, one node
idle in each) of disjoint pairs, every pair exactly once, every node busy in every round. ``nodes``:
when the question is only "which node", each node needs a few peers, not all: the recursive-halving
exchange (round d pairs i with i XOR 2^d; log2 N rounds) when N is a power of two, else the first
rounds of the tournament; at least ``MIN_PEERS`` rounds either way.

Measurements, per round and pair (a, b): a round-trip time of a small message (a pair property: one
clock cannot time one direction of it), then bandwidth a→b, then b→a (each message timed by its sender up to
the receiver's acknowledgement, the best of a few kept), so each direction is measured alone.

Judgement (``judge``), relative to this probe's own fleet, never to a line rate:
- reference R = over nodes, the median of each node's better side (its median send or median receive
  bandwidth, the higher): a slow node moves one value of N, a NIC slow one way none, a slow link barely
  a node's median — so a minority of faults, and a busy host's noise, cannot drag it;
- a direction i→j is slow when its bandwidth is below ``slow_fraction`` × R;
- node i: when at least ``node_quorum`` of its measured sends AND of its receives are slow →
  ``netprobe.node_slow``; only its sends → ``netprobe.nic_send_slow``; only its receives →
  ``netprobe.nic_recv_slow``;
- every slow direction not explained by its sender's send side or its receiver's receive side names
  that link and direction → ``netprobe.link_slow``;
- a pair's round trip above ``latency_factor`` × the median round trip (and ``latency_floor_us``
  above it) → ``netprobe.latency_high``;
- a node with fewer than ``MIN_PEERS`` measured peers is not judged (said in the result and as
  ``netprobe.unjudged``), nor is a probe of fewer than ``MIN_PEERS + 1`` nodes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.model import Action, Entity, EntityKind, Finding, Severity

SOURCE = "diag/fabric.py"
MIN_PEERS = 3  # a node's median send/receive must survive one slow peer
SCHEDULES = ("full", "nodes")

Pair = tuple[int, int]


def tournament(n: int) -> list[list[Pair]]:
    """Round-robin rounds (circle method): every unordered pair once, pairs within a round disjoint.
    For odd ``n`` a phantom node makes the count even and its partner idles that round."""
    if n < 2:
        return []
    slots = list(range(n)) + ([-1] if n % 2 else [])
    m = len(slots)
    rounds: list[list[Pair]] = []
    for _ in range(m - 1):
        pairs = []
        for k in range(m // 2):
            a, b = slots[k], slots[m - 1 - k]
            if a >= 0 and b >= 0:
                pairs.append((min(a, b), max(a, b)))
        rounds.append(sorted(pairs))
        slots = [slots[0], slots[-1], *slots[1:-1]]  # keep the first fixed, rotate the rest
    return rounds


def halving(n: int) -> list[list[Pair]]:
    """Fewer rounds for "which node": recursive halving for a power of two (i with i XOR 2^d), else
    the first max(MIN_PEERS, ceil(log2 n)) tournament rounds."""
    if n < 2:
        return []
    depth = max(1, math.ceil(math.log2(n)))
    if n & (n - 1) == 0 and depth >= MIN_PEERS:
        return [sorted((i, i ^ (1 << d)) for i in range(n) if i < i ^ (1 << d)) for d in range(depth)]
    full = tournament(n)
    return full[:min(len(full), max(MIN_PEERS, depth))]


def schedule(n: int, kind: str = "full") -> list[list[Pair]]:
    if kind == "full":
        return tournament(n)
    if kind == "nodes":
        return halving(n)
    raise ValueError(f"unknown schedule {kind!r} (known: {', '.join(SCHEDULES)})")


@dataclass(frozen=True)
class Thresholds:
    slow_fraction: float = 0.6   # a direction under 0.6 × the fleet's reference is slow
    node_quorum: float = 0.75    # share of a node's sends (receives) that must be slow to blame its side
    latency_factor: float = 4.0  # a round trip over 4 × the median ...
    latency_floor_us: float = 500.0  # ... and at least this much over it (scheduler noise on small ones)


@dataclass
class Measurements:
    """What the ranks measured: bandwidth per ordered pair (bytes/s) and round trip per unordered pair."""

    names: list[str]
    bandwidth: dict[Pair, float] = field(default_factory=dict)  # (src, dst) → bytes per second
    rtt_us: dict[Pair, float] = field(default_factory=dict)     # (low, high) → microseconds

    def to_dict(self) -> dict[str, Any]:
        return {"names": self.names,
                "bandwidth": [[s, d, round(v, 1)] for (s, d), v in sorted(self.bandwidth.items())],
                "rtt_us": [[a, b, round(v, 1)] for (a, b), v in sorted(self.rtt_us.items())]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Measurements:
        return cls(list(d["names"]), {(int(s), int(t)): float(v) for s, t, v in d.get("bandwidth", [])},
                   {(int(a), int(b)): float(v) for a, b, v in d.get("rtt_us", [])})


@dataclass
class Verdict:
    """The judgement: named culprits plus what could not be judged."""

    reference_bps: float | None
    slow: list[Pair]
    nodes: dict[str, str]          # name → node_slow | nic_send_slow | nic_recv_slow
    links: list[tuple[str, str]]   # (src, dst) of slow links not explained by a node
    latency_high: list[tuple[str, str, float]]
    not_judged: dict[str, str]     # name → why
    per_node: dict[str, dict[str, Any]]
    findings: list[Finding]

    def to_dict(self) -> dict[str, Any]:
        return {"reference_bytes_per_second": self.reference_bps,
                "slow_directions": [list(p) for p in self.slow],
                "nodes": self.nodes,
                "links": [{"src": s, "dst": d} for s, d in self.links],
                "latency_high": [{"a": a, "b": b, "rtt_us": r} for a, b, r in self.latency_high],
                "not_judged": self.not_judged, "per_node": self.per_node,
                "findings": [f.to_dict() for f in self.findings]}


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def reference(m: Measurements) -> float | None:
    """The fleet's healthy speed: over nodes, the median of each node's better side (its median send or its
    median receive bandwidth, whichever is higher). A slow node moves one value of N, a NIC slow in one
    direction none (its other side is fine), a slow link barely a node's median."""
    n = len(m.names)
    sends: dict[int, list[float]] = {i: [] for i in range(n)}
    recvs: dict[int, list[float]] = {i: [] for i in range(n)}
    for (s, d), bw in m.bandwidth.items():
        sends[s].append(bw)
        recvs[d].append(bw)
    best = [max(meds) for i in range(n) if (meds := [x for side in (sends[i], recvs[i])
                                                      if (x := _median(side)) is not None])]
    return _median(best)


RETEST_MARGIN = 1.5  # directions up to 1.5 × the slow line are retested: noise near the line is what a retest clears


def suspects_of(m: Measurements, slow_fraction: float) -> list[Pair]:
    """Directions below ``RETEST_MARGIN`` × ``slow_fraction`` of the reference, nearest the line first (a
    retest can clear those; one far below it is a fault however often it is measured)."""
    ref = reference(m)
    if not ref:
        return []
    line = min(1.0, RETEST_MARGIN * slow_fraction) * ref
    return sorted((p for p, v in m.bandwidth.items() if v < line), key=lambda p: -m.bandwidth[p])


def rtt_suspects(m: Measurements, th: Thresholds) -> list[Pair]:
    """Pairs whose round trip the judgement would call high, highest first."""
    rtts = list(m.rtt_us.values())
    if len(rtts) < MIN_PEERS:
        return []
    med = statistics.median(rtts)
    return sorted((p for p, v in m.rtt_us.items() if v > th.latency_factor * med and v - med > th.latency_floor_us),
                  key=lambda p: -m.rtt_us[p])


def judge(m: Measurements, th: Thresholds = Thresholds()) -> Verdict:
    n = len(m.names)
    sends: dict[int, list[Pair]] = {i: [] for i in range(n)}
    recvs: dict[int, list[Pair]] = {i: [] for i in range(n)}
    for (s, d) in m.bandwidth:
        sends[s].append((s, d))
        recvs[d].append((s, d))
    peers = {i: {p[1] for p in sends[i]} & {p[0] for p in recvs[i]} for i in range(n)}
    not_judged: dict[str, str] = {}
    for i in range(n):
        if len(peers[i]) < MIN_PEERS:
            not_judged[m.names[i]] = (f"{len(peers[i])} peer(s) measured in both directions; "
                                      f"judging needs {MIN_PEERS}")
    ref = reference(m) if n > MIN_PEERS else None
    per_node: dict[str, dict[str, Any]] = {}
    if ref is None or ref <= 0:
        for name in m.names:
            not_judged.setdefault(name, f"a probe of {n} node(s): judging needs at least {MIN_PEERS + 1}")
        findings = [_unjudged(name, why) for name, why in sorted(not_judged.items())]
        return Verdict(None, [], {}, [], [], not_judged, per_node, findings)
    limit = th.slow_fraction * ref
    slow = sorted(p for p, v in m.bandwidth.items() if v < limit)
    slow_set = set(slow)
    nodes: dict[str, str] = {}
    send_bad: set[int] = set()
    recv_bad: set[int] = set()
    for i in range(n):
        s_med = _median([m.bandwidth[p] for p in sends[i]])
        r_med = _median([m.bandwidth[p] for p in recvs[i]])
        s_share = sum(p in slow_set for p in sends[i]) / len(sends[i]) if sends[i] else 0.0
        r_share = sum(p in slow_set for p in recvs[i]) / len(recvs[i]) if recvs[i] else 0.0
        per_node[m.names[i]] = {"send_ratio": None if s_med is None else round(s_med / ref, 4),
                                "recv_ratio": None if r_med is None else round(r_med / ref, 4),
                                "slow_sends": sum(p in slow_set for p in sends[i]), "sends": len(sends[i]),
                                "slow_recvs": sum(p in slow_set for p in recvs[i]), "recvs": len(recvs[i]),
                                "judged": m.names[i] not in not_judged}
        if m.names[i] in not_judged:
            continue
        s_bad, r_bad = s_share >= th.node_quorum, r_share >= th.node_quorum
        if s_bad:
            send_bad.add(i)
        if r_bad:
            recv_bad.add(i)
        if s_bad and r_bad:
            nodes[m.names[i]] = "node_slow"
        elif s_bad:
            nodes[m.names[i]] = "nic_send_slow"
        elif r_bad:
            nodes[m.names[i]] = "nic_recv_slow"
        per_node[m.names[i]]["verdict"] = nodes.get(m.names[i], "ok")
    links = [(m.names[s], m.names[d]) for s, d in slow if s not in send_bad and d not in recv_bad]
    rtt_med = _median(list(m.rtt_us.values()))
    lat = [(m.names[a], m.names[b], round(m.rtt_us[(a, b)], 1)) for a, b in sorted(rtt_suspects(m, th))]
    findings = _findings(m, ref, nodes, per_node, links, lat, rtt_med, th)
    findings += [_unjudged(name, why) for name, why in sorted(not_judged.items())]
    return Verdict(ref, slow, nodes, links, lat, not_judged, per_node, findings)


_NODE_WORDS = {
    "node_slow": ("netprobe.node_slow", "its sends and its receives are slow against every peer"),
    "nic_send_slow": ("netprobe.nic_send_slow", "its sends are slow against every peer, its receives are not"),
    "nic_recv_slow": ("netprobe.nic_recv_slow", "its receives are slow against every peer, its sends are not"),
}


def _findings(m: Measurements, ref: float, nodes: Mapping[str, str], per_node: Mapping[str, Mapping[str, Any]],
              links: Sequence[tuple[str, str]], lat: Sequence[tuple[str, str, float]], rtt_med: float | None,
              th: Thresholds) -> list[Finding]:
    out = []
    gbps = ref * 8 / 1e9
    for name, kind in sorted(nodes.items()):
        code, how = _NODE_WORDS[kind]
        pn = per_node[name]
        out.append(Finding(code, Severity.WARNING, Entity(EntityKind.NODE, name),
                           f"fabric probe: {name} {how} (send {pn['send_ratio']}×, receive {pn['recv_ratio']}× "
                           f"the fleet's {gbps:.3g} Gb/s)", Action.MONITOR,
                           {**pn, "reference_gbps": round(gbps, 4), "slow_fraction": th.slow_fraction}, SOURCE))
    idx = {name: i for i, name in enumerate(m.names)}
    for src, dst in links:
        bw = m.bandwidth[(idx[src], idx[dst])]
        back = m.bandwidth.get((idx[dst], idx[src]))
        both = back is not None and back < th.slow_fraction * ref
        out.append(Finding("netprobe.link_slow", Severity.WARNING, Entity(EntityKind.LINK, f"{src}->{dst}"),
                           f"fabric probe: {src} → {dst} runs at {bw / ref:.2f}× the fleet's {gbps:.3g} Gb/s"
                           + (" (the reverse direction too)" if both else "; the reverse direction is fine")
                           + "; neither node is slow with its other peers", Action.MONITOR,
                           {"src": src, "dst": dst, "ratio": round(bw / ref, 4),
                            "reverse_ratio": None if back is None else round(back / ref, 4),
                            "reference_gbps": round(gbps, 4)}, SOURCE))
    for a, b, rtt in lat:
        out.append(Finding("netprobe.latency_high", Severity.WARNING, Entity(EntityKind.LINK, f"{a}<->{b}"),
                           f"fabric probe: round trip {a} ↔ {b} {rtt:.0f} µs against a median of {rtt_med:.0f} µs",
                           Action.MONITOR, {"a": a, "b": b, "rtt_us": rtt, "median_rtt_us": rtt_med}, SOURCE))
    return out


def _unjudged(name: str, why: str) -> Finding:
    return Finding("netprobe.unjudged", Severity.INFO, Entity(EntityKind.NODE, name),
                   f"fabric probe: {name} not judged: {why}", Action.NONE, {"reason": why}, SOURCE)


__all__ = ["MIN_PEERS", "SCHEDULES", "Measurements", "Pair", "Thresholds", "Verdict", "halving", "judge",
           "reference", "rtt_suspects", "schedule", "suspects_of", "tournament"]
