"""A multi-node job judged by node: communication that slowed (``job.comm_slow``) and a node cut off
(``node.cut_off``). Pure state and arithmetic, no I/O: the service feeds it and asks it questions.

Communication time is what the Tracker measures inside collectives (its ``comm_wait_s``; wall − compute
where only compute came). ``CommWatch`` keeps, per job, each step's mean communication and compute across
ranks and per node, its own baseline (a low quantile of its recent windows' medians) and the
current window. Communication slowed when the current median is ``ratio`` × the baseline and the growth is a
real share of a step, while compute held (else it is a whole-job slowdown, ``job.slowdown``). The baseline
is a low quantile of the medians of recent windows outside episodes: it follows a job whose pace drifts over
hours (and a box whose load changes) but never takes a slow link for the pace.

Which node? In a ring or tree every rank waits on the slowest hop, so per-rank times barely point at it
(docs/multinode.md). The evidence, strongest first: a node's own NIC findings (``nic.*``, ``ib.*``); a node
whose ranks' wait stands apart from the others' in the slow window and not before it (the wait pattern);
else the candidates are all the job's nodes, said plainly, with a fabric probe (``gpuhealth diag fabric``) as the
way to tell them apart.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuhealth.model import Finding, Severity

NIC_CODE_PREFIXES = ("nic.", "ib.")  # node-local findings about the node's network interfaces
MAX_OPEN_STEPS = 64  # steps still waiting for ranks; the oldest is judged with what it has beyond this
MAX_NODES_NAMED = 16  # a verdict lists at most this many candidate nodes (the rest are counted)


@dataclass(frozen=True, slots=True)
class CommSettings:
    window: int = 12  # steps per median (the current window, and each window of the baseline)
    min_steps: int = 36  # closed steps before any judgement (the baseline needs a history)
    history: int = 64  # windows the baseline is taken over (the most recent, outside episodes)
    baseline_quantile: float = 0.25  # the baseline: this quantile of the windows' medians
    ratio: float = 3.0  # communication per step against its baseline
    min_share: float = 0.5  # ... and the growth at least this share of the baseline step (compute + communication)
    compute_hold: float = 1.5  # compute within this ratio of its baseline: "compute holds"
    close_ratio: float = 1.5  # an open episode ends when the ratio falls below this
    pattern_min: float = 0.15  # a node's wait must differ from the nodes' median by this share to stand apart
    pattern_margin: float = 3.0  # ... and shift this many times more than any other node's


@dataclass(frozen=True, slots=True)
class CommSlow:
    """An open episode: the numbers of the current window against the baseline (refreshed while it lasts)."""

    comm_s: float
    best_comm_s: float
    compute_s: float
    best_compute_s: float
    since_step: int
    at_step: int
    pattern: dict[str, float]  # node -> relative wait deviation from the nodes' median (slow window)
    pattern_before: dict[str, float]  # the same over the latest baseline window

    @property
    def ratio(self) -> float:
        return self.comm_s / self.best_comm_s if self.best_comm_s > 0 else math.inf


@dataclass(slots=True)
class _Open:
    n: int = 0
    comm: float = 0.0
    comp: float = 0.0
    node_n: dict[int, int] = field(default_factory=dict)
    node_comm: dict[int, float] = field(default_factory=dict)


class CommWatch:
    """One job's communication against its own baseline, per step and per node."""

    def __init__(self, settings: CommSettings | None = None) -> None:
        self.settings = settings or CommSettings()
        self.world_size = 0
        self._nodes: list[str] = []
        self._node_ids: dict[str, int] = {}
        self._rank_node = np.full(0, -1, np.int64)  # rank -> index into _nodes (-1: not placed)
        self._open: dict[int, _Open] = {}
        self._last_closed = -1
        w = self.settings.window
        self.comm: deque[float] = deque(maxlen=4 * w)
        self.comp: deque[float] = deque(maxlen=4 * w)
        self.steps: deque[int] = deque(maxlen=4 * w)
        self.node_dev: deque[dict[int, float]] = deque(maxlen=w)
        self.closed = 0
        self.windows: deque[tuple[float, float]] = deque(maxlen=self.settings.history)  # (comm, compute) medians
        self.best_comm = math.inf  # the baseline (a low quantile of the windows' medians)
        self.best_comp = math.inf
        self.best_pattern: dict[str, float] = {}
        self.episode: CommSlow | None = None

    def place(self, rank: int, node: str) -> None:
        """Rank ``rank`` runs on ``node`` (its agent reported it)."""
        nid = self._node_ids.get(node)
        if nid is None:
            nid = self._node_ids[node] = len(self._nodes)
            self._nodes.append(node)
        if rank >= len(self._rank_node):
            grown = np.full(max(rank + 1, 2 * len(self._rank_node)), -1, np.int64)
            grown[: len(self._rank_node)] = self._rank_node
            self._rank_node = grown
        self._rank_node[rank] = nid

    def feed(self, ranks: Sequence[int], steps: Sequence[int], wall: Sequence[float], compute: Sequence[float] | None,
             comm: Sequence[float] | None) -> None:
        """One batch of rank-steps (ranks of unknown placement count for the job, not for a node). Vectorised per
        batch (about 1 µs a rank-step on the 2-core CPU box, 2026-12-08): ingest stays columnar."""
        if compute is None and comm is None:
            return  # wall time alone cannot tell communication from compute
        w = np.asarray(wall, np.float64)
        c = np.asarray(compute, np.float64) if compute is not None else np.full(len(w), np.nan)
        m = np.asarray(comm, np.float64) if comm is not None else np.full(len(w), np.nan)
        m = np.where(np.isnan(m), np.maximum(0.0, w - c), m)
        c = np.where(np.isnan(c), np.maximum(0.0, w - m), c)
        s = np.asarray(steps, np.int64)
        r = np.asarray(ranks, np.int64)
        ok = np.isfinite(m) & np.isfinite(c) & (s > self._last_closed)  # a late step was judged already
        if not ok.all():
            s, r, m, c = s[ok], r[ok], m[ok], c[ok]
        if not len(s):
            return
        uniq, inv = np.unique(s, return_inverse=True)
        n = np.bincount(inv)
        msum = np.bincount(inv, m)
        csum = np.bincount(inv, c)
        inside = (r >= 0) & (r < len(self._rank_node))
        nodes = np.full(len(r), -1, np.int64)
        nodes[inside] = self._rank_node[r[inside]]
        known = nodes >= 0
        width = max(1, len(self._nodes))
        key = inv[known] * width + nodes[known]
        size = len(uniq) * width
        node_n = np.bincount(key, minlength=size).reshape(len(uniq), width)
        node_m = np.bincount(key, m[known], minlength=size).reshape(len(uniq), width)
        for k, step in enumerate(uniq.tolist()):
            acc = self._open.get(step)
            if acc is None:
                acc = self._open[step] = _Open()
            acc.n += int(n[k])
            acc.comm += float(msum[k])
            acc.comp += float(csum[k])
            for node in np.flatnonzero(node_n[k]).tolist():
                acc.node_n[node] = acc.node_n.get(node, 0) + int(node_n[k, node])
                acc.node_comm[node] = acc.node_comm.get(node, 0.0) + float(node_m[k, node])
        self._close_ready()

    def _close_ready(self) -> None:
        if not self._open:
            return
        newest = max(self._open)
        for step in sorted(self._open):
            acc = self._open[step]
            full = self.world_size > 0 and acc.n >= self.world_size
            # A step some rank never reported is judged once later steps have come (or too many are open).
            stale = step < newest - 2 or len(self._open) > MAX_OPEN_STEPS
            if not (full or stale):
                break
            del self._open[step]
            self._last_closed = step
            self._close(step, acc)

    def _close(self, step: int, acc: _Open) -> None:
        self.comm.append(acc.comm / acc.n)
        self.comp.append(acc.comp / acc.n)
        self.steps.append(step)
        means = {node: acc.node_comm[node] / cnt for node, cnt in acc.node_n.items() if cnt}
        if len(means) >= 2:
            mid = statistics.median(means.values())
            self.node_dev.append({node: (v - mid) / mid for node, v in means.items()} if mid > 0 else {})
        self.closed += 1
        w = self.settings.window
        if self.closed % w == 0 and self.episode is None:
            # One more window for the baseline, unless it is slow itself (judged or not yet): a slow link never
            # becomes the job's pace.
            cm, cp = statistics.median(list(self.comm)[-w:]), statistics.median(list(self.comp)[-w:])
            if len(self.windows) < 3 or cm < self.settings.ratio * self.best_comm:
                self.windows.append((cm, cp))
                q = self.settings.baseline_quantile
                self.best_comm = _quantile([x for x, _ in self.windows], q)
                self.best_comp = _quantile([x for _, x in self.windows], q)
                self.best_pattern = self.pattern()

    def pattern(self) -> dict[str, float]:
        """Each node's mean relative deviation of its ranks' wait from the nodes' median, over the last window."""
        sums: dict[int, list[float]] = {}
        for dev in self.node_dev:
            for node, v in dev.items():
                sums.setdefault(node, []).append(v)
        return {self._nodes[node]: round(sum(vs) / len(vs), 4) for node, vs in sums.items()}

    def judge(self) -> tuple[CommSlow | None, bool]:
        """The open episode (or None) and whether it opened just now."""
        st = self.settings
        w = st.window
        if self.closed < st.min_steps or len(self.windows) < 3 or len(self.comm) < w:
            return self.episode, False
        cur_comm = statistics.median(list(self.comm)[-w:])
        cur_comp = statistics.median(list(self.comp)[-w:])
        best_step = self.best_comm + self.best_comp
        if self.episode is not None:
            if cur_comm < st.close_ratio * self.best_comm:
                self.episode = None
                return None, False
            self.episode = CommSlow(cur_comm, self.best_comm, cur_comp, self.best_comp, self.episode.since_step,
                                    self.steps[-1], self.pattern(), self.best_pattern)
            return self.episode, False
        slow = (cur_comm >= st.ratio * self.best_comm and cur_comm - self.best_comm >= st.min_share * best_step
                and cur_comp <= st.compute_hold * self.best_comp + 0.005)
        if not slow:
            return None, False
        recent = list(zip(list(self.steps)[-w:], list(self.comm)[-w:], strict=True))
        since = next(step for step, v in recent if v >= st.ratio * self.best_comm)  # the first slow step
        self.episode = CommSlow(cur_comm, self.best_comm, cur_comp, self.best_comp, since, self.steps[-1],
                                self.pattern(), self.best_pattern)
        return self.episode, True


def _quantile(values: Sequence[float], q: float) -> float:
    data = sorted(values)
    return data[min(len(data) - 1, int(q * len(data)))]


@dataclass(frozen=True, slots=True)
class Localisation:
    nodes: list[str]  # the nodes the evidence names (empty: it cannot separate the candidates)
    basis: str  # "nic_findings", "wait_pattern" or "none"
    candidates: list[str]  # every node that may be the cause
    nic: dict[str, list[dict[str, Any]]]  # node -> its NIC findings (code, severity, entity, message)


def nic_findings(findings: Iterable[Finding]) -> list[Finding]:
    """A node's own findings about its network interfaces, warning or worse."""
    return [f for f in findings if f.code.startswith(NIC_CODE_PREFIXES) and f.severity >= Severity.WARNING]


def standing_apart(pattern: Mapping[str, float], before: Mapping[str, float], st: CommSettings) -> str | None:
    """The one node whose ranks' wait differs from the others' now (and did not before): the largest deviation,
    at least ``pattern_min`` beyond what it was in the baseline and ``pattern_margin`` × any other node's."""
    if len(pattern) < 3:
        return None  # two nodes: each deviates as much as the other
    shift = sorted(((abs(v - before.get(n, 0.0)), n) for n, v in pattern.items()), reverse=True)
    (top, node), (second, _) = shift[0], shift[1]
    return node if top >= st.pattern_min and top >= st.pattern_margin * second else None


def localise(job_nodes: Sequence[str], findings_of: Mapping[str, Sequence[Finding]], episode: CommSlow,
             settings: CommSettings) -> Localisation:
    nodes = sorted(job_nodes)
    nic = {n: [{"code": f.code, "severity": str(f.severity), "entity": str(f.entity), "message": f.message[:300]}
               for f in nic_findings(findings_of.get(n, ()))] for n in nodes}
    nic = {n: v for n, v in nic.items() if v}
    if nic and len(nic) < len(nodes):
        return Localisation(sorted(nic), "nic_findings", nodes, nic)
    apart = standing_apart(episode.pattern, episode.pattern_before, settings)
    if apart is not None:
        return Localisation([apart], "wait_pattern", nodes, nic)
    return Localisation([], "none", nodes, nic)


def comm_slow_verdict(job_id: str, episode: CommSlow, where: Localisation, created_at: float) -> dict[str, Any]:
    """The ``comm_slow`` verdict document (what ``gpuhealth jobs --json`` shows)."""
    head = (f"communication {episode.ratio:.1f}x its own baseline ({episode.comm_s:.3f} s vs "
            f"{episode.best_comm_s:.3f} s a step) while compute holds ({episode.compute_s:.3f} s vs "
            f"{episode.best_compute_s:.3f} s)")
    shown = ", ".join(where.candidates[:MAX_NODES_NAMED]) + (
        f" and {len(where.candidates) - MAX_NODES_NAMED} more" if len(where.candidates) > MAX_NODES_NAMED else "")
    if where.basis == "nic_findings":
        why = "; ".join(f"{n}: {', '.join(sorted({f['code'] for f in where.nic[n]}))}" for n in where.nodes)
        who = f"node {', '.join(where.nodes)} — its NIC findings explain it ({why})"
    elif where.basis == "wait_pattern":
        n = where.nodes[0]
        who = (f"node {n} — its ranks' wait stands apart from the other nodes' "
               f"({episode.pattern.get(n, 0.0):+.1%} of the median) since the slowdown; confirm with a fabric probe")
    else:
        who = (f"passive evidence cannot tell which of nodes {shown}; run a fabric probe across them "
               "(gpuhealth diag fabric) to name the node, direction or pair")
    return {
        "verdict": "comm_slow", "code": "job.comm_slow", "job_id": job_id, "nodes": where.nodes,
        "candidates": where.candidates[:MAX_NODES_NAMED * 16], "basis": where.basis,
        "probe_advised": where.basis != "nic_findings",
        "comm_s": round(episode.comm_s, 6), "best_comm_s": round(episode.best_comm_s, 6),
        "ratio": round(episode.ratio, 3), "compute_s": round(episode.compute_s, 6),
        "best_compute_s": round(episode.best_compute_s, 6), "since_step": episode.since_step,
        "at_step": episode.at_step, "wait_pattern": dict(sorted(episode.pattern.items())[:256]),
        "nic_findings": where.nic, "summary": f"comm_slow: {head}: {who}", "created_at": created_at,
    }


@dataclass(frozen=True, slots=True)
class CutOff:
    node: str
    silent_s: float  # how long its agent has said nothing
    stalled_s: float  # how long no rank of the job progressed
    ranks: list[int]  # the job's ranks on that node


def cut_off_nodes(job_nodes: Mapping[str, list[int]], heard_at: Mapping[str, float], progress_at: float, now: float,
                  silent_after_s: float, step_s: float | None, heard_every_s: float) -> list[CutOff]:
    """Nodes of a job whose agent and ranks went silent together while the others wait.

    A node is cut off when its agent has said nothing for ``silent_after_s`` while at least one other node of
    the job is still heard, no rank of the job progressed since about when it went quiet (its last word came
    no later than a few steps after the job's last progress: the job stopped because of it, not before it;
    and no earlier than one ``heard_every_s`` — its heartbeat — before it: an agent silent long before the
    stall says nothing about this one), and the job has been stalled for at least that long too."""
    stalled = now - progress_at
    if stalled < silent_after_s or len(job_nodes) < 2:
        return []
    slack = max(5.0, 4 * (step_s or 0.0))
    heard = {n: now - heard_at.get(n, -math.inf) for n in job_nodes}
    alive = [n for n, quiet in heard.items() if quiet < silent_after_s]
    if not alive:
        return []  # nobody heard: the coordinator's own network, not a node's
    return [CutOff(n, quiet, stalled, sorted(job_nodes[n])) for n, quiet in sorted(heard.items())
            if quiet >= silent_after_s
            and progress_at - heard_every_s - slack <= heard_at.get(n, -math.inf) <= progress_at + slack]


def cut_off_verdict(job_id: str, cuts: Sequence[CutOff], waiting: Sequence[str], created_at: float,
                    at_step: int | None) -> dict[str, Any]:
    names = ", ".join(c.node for c in cuts)
    ranks = sorted(r for c in cuts for r in c.ranks)
    lines = [f"{c.node} (ranks {', '.join(map(str, c.ranks)) or 'none known'}; silent {c.silent_s:.0f} s)"
             for c in cuts]
    return {
        "verdict": "cut_off", "code": "node.cut_off", "job_id": job_id, "nodes": [c.node for c in cuts],
        "culprits": ranks, "cause": "network",
        "silent_s": {c.node: round(c.silent_s, 1) for c in cuts}, "stalled_s": round(max(c.stalled_s for c in cuts), 1),
        "waiting_nodes": sorted(waiting)[:MAX_NODES_NAMED * 16],
        "summary": (f"cut_off: node {names} lost its network — its agent and its ranks went silent together while "
                    f"the ranks on {len(waiting)} other node(s) wait: {'; '.join(lines)}. A node that lost power "
                    "looks the same from here: check its link (cable, switch port) and its console"),
        "created_at": created_at, "at_step": at_step,
    }
