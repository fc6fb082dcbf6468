"""Straggler detection quality on a synthetic corpus of synchronous data-parallel jobs, judged
through the entry points a user has: ``detect_stragglers`` (step records), ``detect_from_durations``
(flight-recorder ``duration_ms`` only) and, for a sample, ``gpuhealth triage --steps``.

The corpus model (per case): compute[r, s] = base × factor[r, s] × job[s] × noise[r, s];
wall[s] = max_r compute[r, s] + collective[s] (every rank waits for the slowest);
wait[r, s] = wall[s] − compute[r, s]. Noise is independent per (rank, step): normal, lognormal or
Student-t (3 dof) with CV 0–30 %, plus rare heavy-tail spikes (1.5–5×). Families:

    const       one rank slower by 1.05–2× from step 0 or from mid-run (4–64 ranks)
    large       1,024 ranks, three stragglers of 1.1–2×
    alternate   a rank slow on every other step
    transient   a rank slow for 40–70 steps, then back to normal (expected: found, and recovered)
    fr          flight-recorder durations only (one world all_reduce, or a TP pair + world per step), without
                start times: (group, seq, ms)
    fr_timed    the same with each collective's start time: (group, seq, ms, start_ns)
    fr_grid     flight-recorder durations of a TP × DP job with no collective that spans it (4–64 ranks:
                per step a TP all_reduce, then 1–3 DP gradient buckets back to back; groups named "1",
                "2", … in creation order as torch names them), with or without start times; 1.1–2×
    fr_grid_healthy  the same layouts without a straggler (noise 0–30 %): false alarms
    small_graded     3–7 ranks (step records), two or three stragglers slowed by different amounts (1.1–2×), so
                     they hide each other from the median (1×, 1.1×, 1.2×, 1.3× among four): all must be named
    small_one_fast   3–7 ranks, no straggler, one rank 5–20 % *faster* than the rest: nobody is named
    healthy     no straggler, noise 0–30 %, 2–1,024 ranks, some with data-dependent step times
    spikes      no straggler, heavy-tail spikes on random (rank, step)s
    checkpoint  no straggler, every 50th step slow on every rank (or on rank 0 alone: it saves)
    job_slow    no straggler, the whole job slows down (sustained or gradual): never a straggler

Tune on seeds 0–4, report on 100–104 (``--seed``); the held-out corpus uses other seeds.

    .venv/bin/python benchmarks/straggler_quality.py [--seed 100 101 102 103 104] [--cli-sample 6]
        [--no-delay] [--json OUT.json]
    .venv/bin/python benchmarks/straggler_quality.py --online 100000 [--online-steps 120]

``--online N``: the coordinator's feed (``BudgetedStragglerFeed``) alone on one core, for an N-rank job
whose agents send 1,000 ranks × 1 step per batch at 200,000 rank-steps/s of simulated time: CPU
seconds per rank-step fed, with every step judged (no budget) and under the default budget, and
the step at which a 1.2× rank (5 % noise) is named.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpuhealth.model import Finding, StepRecord
from gpuhealth.stragglers import detect_from_durations, detect_stragglers

STEPS = 200
BASES = (0.005, 0.05, 1.0)  # step compute of 5 ms, 50 ms, 1 s
NOISE_KINDS = ("normal", "lognormal", "t3")
SPLITS = ("compute", "wait", "both")


@dataclass(frozen=True, slots=True)
class Slow:
    """One straggler: ``factor`` × compute on steps [onset, end) (every other step if alternate)."""

    rank: int
    factor: float
    onset: int
    end: int = STEPS
    alternate: bool = False


@dataclass(slots=True)
class Case:
    name: str
    family: str
    world: int
    base: float
    noise: float
    seed: int
    slow: tuple[Slow, ...] = ()
    noise_kind: str = "normal"
    split: str = "compute"
    spike_p: float = 0.002
    job: str = ""  # "", "checkpoint", "checkpoint_rank0", "sustained", "gradual", "data"
    fr: str = ""  # "", "world", "tp", "grid" (flight-recorder durations instead of step records)
    steps: int = STEPS
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- corpus


def build_corpus(seed: int) -> list[Case]:
    rng = np.random.default_rng(seed)
    cases: list[Case] = []

    def pick(options: Sequence[Any]) -> Any:
        return options[int(rng.integers(len(options)))]

    def mid() -> int:
        return int(rng.integers(60, 141))

    # One straggler, every factor × noise, onset at 0 and mid-run.
    for factor in (1.05, 1.1, 1.2, 1.3, 1.5, 2.0):
        for noise in (0.0, 0.05, 0.15, 0.30):
            for onset_kind in ("start", "mid"):
                world = pick((4, 8, 16, 32, 64))
                onset = 0 if onset_kind == "start" else mid()
                cases.append(Case(f"const f={factor} cv={noise} n={world} {onset_kind}", "const", world, pick(BASES),
                                  noise, seed, (Slow(int(rng.integers(world)), factor, onset),),
                                  pick(NOISE_KINDS), pick(SPLITS), extra={"onset_kind": onset_kind}))
    # 1,024 ranks: three stragglers each.
    for noise in (0.05, 0.15, 0.05, 0.15):
        ranks = rng.choice(1024, size=3, replace=False)
        factors = rng.choice((1.1, 1.2, 1.3, 1.5, 2.0), size=3)
        slow = tuple(Slow(int(r), float(f), 0 if i == 0 else mid()) for i, (r, f) in enumerate(zip(ranks, factors,
                                                                                                   strict=True)))
        cases.append(Case(f"large n=1024 cv={noise}", "large", 1024, pick(BASES), noise, seed, slow,
                          pick(NOISE_KINDS), pick(SPLITS)))
    # A rank slow on every other step.
    for factor in (1.25, 1.5, 2.0):
        for noise in (0.05, 0.15):
            world = pick((4, 16, 64))
            cases.append(Case(f"alternate f={factor} cv={noise} n={world}", "alternate", world, pick(BASES), noise,
                              seed, (Slow(int(rng.integers(world)), factor, pick((0, mid())), alternate=True),),
                              pick(NOISE_KINDS), pick(SPLITS)))
    # Transient: slow for 40–70 steps, then recovered.
    for factor, noise in ((1.3, 0.05), (1.5, 0.15), (2.0, 0.05), (2.0, 0.15)):
        world = pick((4, 16, 64))
        onset = int(rng.integers(30, 90))
        end = onset + int(rng.integers(40, 71))
        cases.append(Case(f"transient f={factor} cv={noise} n={world}", "transient", world, pick(BASES), noise, seed,
                          (Slow(int(rng.integers(world)), factor, onset, end),), pick(NOISE_KINDS), pick(SPLITS)))
    # Flight-recorder durations only (with and without start times).
    for family in ("fr", "fr_timed"):
        for factor in (1.1, 1.2, 1.5, 2.0):
            for noise in (0.05, 0.15):
                world = pick((2, 4, 8))
                cases.append(Case(f"{family} f={factor} cv={noise} n={world}", family, world, pick(BASES), noise,
                                  seed, (Slow(int(rng.integers(world)), factor, pick((0, mid()))),),
                                  pick(NOISE_KINDS), fr=pick(("world", "tp"))))
    # ---- no straggler (47 per seed) ----
    for world in (4, 16, 64, 256, 1024):
        for noise in (0.0, 0.05, 0.15, 0.30):
            cases.append(Case(f"healthy cv={noise} n={world}", "healthy", world, pick(BASES), noise, seed,
                              noise_kind=pick(NOISE_KINDS), split=pick(SPLITS)))
    for noise in (0.05, 0.15, 0.30):
        cases.append(Case(f"healthy n=2 cv={noise}", "healthy", 2, pick(BASES), noise, seed,
                          noise_kind=pick(NOISE_KINDS), split=pick(SPLITS)))
    for noise in (0.05, 0.15, 0.30):
        cases.append(Case(f"healthy data-dependent cv={noise}", "healthy", pick((4, 16, 64)), pick(BASES), noise,
                          seed, noise_kind=pick(NOISE_KINDS), split=pick(SPLITS), job="data"))
    for world in (4, 16, 64):
        for noise in (0.05, 0.15, 0.30):
            cases.append(Case(f"spikes cv={noise} n={world}", "spikes", world, pick(BASES), noise, seed,
                              noise_kind=pick(NOISE_KINDS), split=pick(SPLITS), spike_p=0.03))
    for world in (4, 16, 64):
        for job in ("checkpoint", "checkpoint_rank0"):
            cases.append(Case(f"{job} n={world}", "checkpoint", world, pick(BASES), pick((0.05, 0.15)), seed,
                              noise_kind=pick(NOISE_KINDS), split=pick(SPLITS), job=job))
    for world in (4, 16, 64):
        for job in ("sustained", "gradual"):
            cases.append(Case(f"job slowdown {job} n={world}", "job_slow", world, pick(BASES), pick((0.05, 0.15)),
                              seed, noise_kind=pick(NOISE_KINDS), split=pick(SPLITS), job=job))
    return cases + grid_corpus(seed) + small_corpus(seed)


def grid_corpus(seed: int) -> list[Case]:
    """TP × DP jobs seen through flight-recorder durations alone, with no collective that spans the job.
    Drawn from a generator of their own, so the families above are the same cases as before they existed."""
    rng = np.random.default_rng([seed, 0x67726964])
    cases: list[Case] = []

    def mid() -> int:
        return int(rng.integers(60, 141))

    def layout() -> dict[str, Any]:
        while True:
            tp, dp = int(rng.choice((2, 4, 8))), int(rng.choice((2, 3, 4, 8)))
            if tp * dp <= 64:
                return {"tp": tp, "dp": dp, "buckets": int(rng.integers(1, 4)), "timed": bool(rng.integers(2))}

    for factor in (1.1, 1.2, 1.5, 2.0):
        for noise in (0.05, 0.15):
            for _ in range(2):
                g = layout()
                world = g["tp"] * g["dp"]
                cases.append(Case(f"fr_grid f={factor} cv={noise} tp={g['tp']} dp={g['dp']} b={g['buckets']} "
                                  f"timed={g['timed']} #{len(cases)}", "fr_grid", world,
                                  float(rng.choice(BASES)), noise, seed,
                                  (Slow(int(rng.integers(world)), factor, int(rng.choice((0, mid())))),),
                                  str(rng.choice(NOISE_KINDS)), fr="grid", extra=g))
    for noise in (0.0, 0.05, 0.15, 0.30):
        for _ in range(2):
            g = layout()
            cases.append(Case(f"fr_grid_healthy cv={noise} tp={g['tp']} dp={g['dp']} b={g['buckets']} "
                              f"timed={g['timed']} #{len(cases)}", "fr_grid_healthy", g["tp"] * g["dp"],
                              float(rng.choice(BASES)), noise, seed, noise_kind=str(rng.choice(NOISE_KINDS)),
                              fr="grid", extra=g))
    return cases


def small_corpus(seed: int) -> list[Case]:
    """Jobs of 3–7 ranks where the median of the other ranks misleads: several stragglers of different
    factors, or one fast rank. A generator of their own, so the families above are the same cases as before."""
    rng = np.random.default_rng([seed, 0x736D616C])
    cases: list[Case] = []
    for i in range(12):
        world = int(rng.integers(3, 8))
        n_slow = int(rng.integers(2, min(3, world - 1) + 1))
        factors = sorted(float(f) for f in rng.choice((1.1, 1.2, 1.3, 1.5, 2.0), size=n_slow, replace=False))
        ranks = rng.choice(world, size=n_slow, replace=False)
        noise = float(rng.choice((0.02, 0.05, 0.10)))
        onset = int(rng.choice((0, int(rng.integers(60, 141)))))
        slow = tuple(Slow(int(r), f, onset) for r, f in zip(ranks, factors, strict=True))
        cases.append(Case(f"small_graded n={world} f={factors} cv={noise} #{i}", "small_graded", world,
                          float(rng.choice(BASES)), noise, seed, slow, str(rng.choice(NOISE_KINDS)),
                          str(rng.choice(SPLITS))))
    for i in range(8):
        world = int(rng.integers(3, 8))
        fast = (int(rng.integers(world)), float(rng.choice((0.8, 0.9, 0.95))))
        noise = float(rng.choice((0.02, 0.05, 0.15)))
        cases.append(Case(f"small_one_fast n={world} f={fast[1]} cv={noise} #{i}", "small_one_fast", world,
                          float(rng.choice(BASES)), noise, seed, (), str(rng.choice(NOISE_KINDS)),
                          str(rng.choice(SPLITS)), extra={"fast": fast}))
    return cases


def simulate(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(compute[rank, step], wall[step]) in seconds."""
    rng = np.random.default_rng([case.seed, zlib.crc32(case.name.encode())])
    n, s = case.world, case.steps
    cv = case.noise
    if cv == 0:
        noise = np.ones((n, s))
    elif case.noise_kind == "lognormal":
        sigma = np.sqrt(np.log1p(cv * cv))
        noise = np.exp(rng.normal(-sigma * sigma / 2, sigma, (n, s)))
    elif case.noise_kind == "t3":
        noise = 1.0 + cv * rng.standard_t(3, (n, s)) / np.sqrt(3.0)
    else:
        noise = 1.0 + cv * rng.normal(0.0, 1.0, (n, s))
    noise = np.maximum(noise, 0.2)
    spikes = rng.random((n, s)) < case.spike_p
    noise[spikes] *= rng.uniform(1.5, 5.0, int(spikes.sum()))
    factor = np.ones((n, s))
    for sl in case.slow:
        cols = np.arange(sl.onset, min(sl.end, s))
        if sl.alternate:
            cols = cols[(cols - sl.onset) % 2 == 1]
        factor[sl.rank, cols] = sl.factor
    if "fast" in case.extra:
        rank, f = case.extra["fast"]
        factor[rank, :] = f
    job = np.ones(s)
    if case.job in ("checkpoint", "checkpoint_rank0"):
        ckpt = np.arange(49, s, 50)
        if case.job == "checkpoint":
            job[ckpt] = rng.uniform(3.0, 10.0, len(ckpt))
        else:
            factor[0, ckpt] *= rng.uniform(3.0, 10.0, len(ckpt))
    elif case.job == "sustained":
        job[s // 2:] = 1.3
    elif case.job == "gradual":
        job = np.linspace(1.0, 1.5, s)
    elif case.job == "data":
        job = rng.uniform(0.6, 1.4, s)  # sequence lengths vary per step, the same on every rank
    compute = case.base * factor * job[None, :] * noise
    collective = case.base * 0.15 * np.maximum(0.5, 1.0 + 0.1 * rng.normal(0.0, 1.0, s))
    wall = compute.max(axis=0) + collective
    return compute, wall


def step_records(case: Case, compute: np.ndarray, wall: np.ndarray) -> list[StepRecord]:
    n, s = compute.shape
    start = 1.7e9 + np.concatenate(([0.0], np.cumsum(wall)[:-1]))
    wait = wall[None, :] - compute
    out = []
    for step in range(s):
        w = float(wall[step])
        t = float(start[step])
        for r in range(n):
            c = float(compute[r, step])
            q = float(wait[r, step])
            out.append(StepRecord("bench", r, step, t, w, compute_s=None if case.split == "wait" else c,
                                  comm_wait_s=None if case.split == "compute" else q))
    return out


def durations(case: Case, compute: np.ndarray, wall: np.ndarray) -> dict[int, list[tuple[Any, ...]]]:
    """{rank: [(group, seq, ms[, start_ns]), …]}: each rank's collectives in its own order."""
    if case.fr == "grid":
        return grid_durations(case, compute, wall)
    n, s = compute.shape
    rng = np.random.default_rng([case.seed, 7])
    coll = wall - compute.max(axis=0)
    begin = np.concatenate(([0.0], np.cumsum(wall)[:-1]))  # step start times (s)
    out: dict[int, list[tuple[Any, ...]]] = {r: [] for r in range(n)}

    def put(r: int, group: str, step: int, ms: float, arrive: float) -> None:
        item = (group, step + 1, float(max(ms, 0.001)))
        out[r].append((*item, int((1.7e9 + begin[step] + arrive) * 1e9)) if case.family == "fr_timed" else item)

    for step in range(s):
        c = compute[:, step]
        arrive_world = c.copy()
        if case.fr == "tp" and n >= 2:
            # A TP all_reduce within each pair first: the pair leaves it when its slower member arrives.
            for p in range(0, n - 1, 2):
                done = max(c[p], c[p + 1]) + coll[step] * 0.3
                for r in (p, p + 1):
                    put(r, f"tp{p // 2}", step, (done - c[r]) * 1000 * (1 + 0.02 * rng.normal()), c[r])
                    arrive_world[r] = done
        done = arrive_world.max() + coll[step]
        for r in range(n):
            put(r, "world", step, (done - arrive_world[r]) * 1000 * (1 + 0.02 * rng.normal()), arrive_world[r])
    return out


def grid_durations(case: Case, compute: np.ndarray, wall: np.ndarray) -> dict[int, list[tuple[Any, ...]]]:
    """TP × DP, rank = d·tp + t: per step a TP all_reduce (the TP group leaves when its slowest member
    arrived), then the DP buckets back to back (the first waits for the slowest TP group: every DP group
    meets every TP group, so the step ends together). No collective spans the job."""
    n, s = compute.shape
    tp, dp, buckets = case.extra["tp"], case.extra["dp"], case.extra["buckets"]
    timed = case.extra["timed"]
    rng = np.random.default_rng([case.seed, 11])
    coll = wall - compute.max(axis=0)
    begin = np.concatenate(([0.0], np.cumsum(wall)[:-1]))
    out: dict[int, list[tuple[Any, ...]]] = {r: [] for r in range(n)}
    ranks = np.arange(n)
    tp_of, dp_of = ranks // tp, ranks % tp  # group index in each family
    for step in range(s):
        c = compute[:, step]
        tp_done = np.array([c[tp_of == k].max() for k in range(dp)])[tp_of] + 0.3 * coll[step]
        bucket = 0.7 * coll[step] / buckets
        for r in range(n):
            ops = [(str(1 + tp_of[r]), step + 1, c[r], tp_done[r])]  # (group, seq, arrival, end)
            arrive = tp_done[r]
            for b in range(buckets):
                end = tp_done.max() + (b + 1) * bucket
                ops.append((str(1 + dp + dp_of[r]), step * buckets + b + 1, arrive, end))
                arrive = end
            for group, seq, start, end in ops:
                item = (group, seq, float(max((end - start) * 1000 * (1 + 0.02 * rng.normal()), 0.001)))
                out[r].append((*item, int((1.7e9 + begin[step] + start) * 1e9)) if timed else item)
    return out


# ---------------------------------------------------------------------------------------- running


def _flagged(findings: Sequence[Finding]) -> dict[int, Finding]:
    return {int(f.evidence["rank"]): f for f in findings if f.code == "rank.straggler"}


def _run(case: Case, compute: np.ndarray, wall: np.ndarray) -> tuple[list[Finding], float, Callable[[int], set[int]]]:
    """Findings on the whole run, detection seconds, and a function: flagged ranks on the first p steps."""
    if case.fr:
        dur = durations(case, compute, wall)
        t0 = time.perf_counter()
        found = detect_from_durations(dur)
        elapsed = time.perf_counter() - t0

        def prefix_fr(p: int) -> set[int]:
            # Every rank runs the same collectives each step: the first p steps' worth.
            return set(_flagged(detect_from_durations({r: v[: p * len(v) // case.steps] for r, v in dur.items()})))

        return found, elapsed, prefix_fr
    recs = step_records(case, compute, wall)
    t0 = time.perf_counter()
    found = detect_stragglers(recs, job_slowdown=True)
    elapsed = time.perf_counter() - t0
    n = case.world

    def prefix(p: int) -> set[int]:
        return set(_flagged(detect_stragglers(recs[: p * n])))

    return found, elapsed, prefix


def _first_flag(prefix: Callable[[int], set[int]], rank: int, lo: int, hi: int) -> int | None:
    """Smallest p in (lo, hi] with ``rank`` flagged on the first p steps (bisection; None if never)."""
    if rank not in prefix(hi):
        return None
    while hi - lo > 1:
        m = (lo + hi) // 2
        if rank in prefix(m):
            hi = m
        else:
            lo = m
    return hi


@dataclass(slots=True)
class Outcome:
    case: Case
    flagged: dict[int, Finding]
    seconds: float
    delays: dict[int, int] = field(default_factory=dict)
    other: list[Finding] = field(default_factory=list)


def evaluate(cases: Sequence[Case], delay: bool) -> list[Outcome]:
    out = []
    for case in cases:
        compute, wall = simulate(case)
        found, seconds, prefix = _run(case, compute, wall)
        o = Outcome(case, _flagged(found), seconds, other=[f for f in found if f.code != "rank.straggler"])
        if delay:
            for sl in case.slow:
                if sl.rank in o.flagged and sl.end >= case.steps and case.world <= 64:
                    first = _first_flag(prefix, sl.rank, sl.onset, case.steps)
                    if first is not None:
                        o.delays[sl.rank] = first - 1 - sl.onset  # steps after the onset step
        out.append(o)
    return out


def triage_cli(case: Case, tmp: Path) -> dict[str, Any]:
    compute, wall = simulate(case)
    path = tmp / f"{zlib.crc32(case.name.encode())}.jsonl"
    path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in step_records(case, compute, wall)))
    proc = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "triage", "--steps", str(path), "--json"],
                          capture_output=True, text=True, timeout=600)
    try:
        doc: dict[str, Any] = json.loads(proc.stdout)
    except ValueError:
        return {"verdict": "error", "culprits": [], "stderr": proc.stderr[-400:]}
    return doc


# ---------------------------------------------------------------------------------------- scoring


def report(outcomes: Sequence[Outcome], cli: list[tuple[Case, dict[str, Any], set[int]]]) -> dict[str, Any]:
    grid = [o for o in outcomes if o.case.fr == "grid"]
    small = [o for o in outcomes if o.case.family.startswith("small_")]
    # the figures below as before the grid and small-job families
    outcomes = [o for o in outcomes if o.case.fr != "grid" and not o.case.family.startswith("small_")]
    pos_by: dict[tuple[float, float], list[bool]] = defaultdict(list)
    fam_hits: dict[str, list[bool]] = defaultdict(list)
    onset_err: list[int] = []
    delays: list[int] = []
    negatives = flagged_neg = 0
    wrong_ranks = 0
    exact = 0
    recovered_ok: list[bool] = []
    job_slow_found: list[bool] = []
    flagged_names: list[str] = []
    for o in outcomes:
        c = o.case
        expected = {sl.rank for sl in c.slow}
        got = set(o.flagged)
        exact += got == expected
        wrong_ranks += len(got - expected)
        if not c.slow:
            negatives += 1
            if got:
                flagged_neg += 1
                flagged_names.append(f"{c.name} seed={c.seed}: ranks {sorted(got)}")
            if c.family == "job_slow" and c.job == "sustained":
                job_slow_found.append(any(f.code == "job.slowdown" for f in o.other))
            continue
        for sl in c.slow:
            hit = sl.rank in got
            fam_hits[c.family].append(hit)
            if c.family == "const":
                pos_by[(sl.factor, c.noise)].append(hit)
            if hit and c.family in ("const", "large"):
                since = o.flagged[sl.rank].evidence.get("since_step", o.flagged[sl.rank].evidence.get("onset_step"))
                if isinstance(since, int):
                    onset_err.append(abs(since - sl.onset))
            if c.family == "transient" and hit:
                recovered_ok.append(o.flagged[sl.rank].evidence.get("active") is False)
        delays += list(o.delays.values())
    factors = sorted({k[0] for k in pos_by})
    noises = sorted({k[1] for k in pos_by})

    def rate(xs: Sequence[bool]) -> float | None:
        return round(sum(xs) / len(xs), 3) if xs else None

    table = {f"{f}": {f"{cv}": rate(pos_by[(f, cv)]) for cv in noises} for f in factors}
    recall_factor = {f"{f}": rate([h for cv in noises for h in pos_by[(f, cv)]]) for f in factors}
    recall_factor_le15 = {f"{f}": rate([h for cv in noises if cv <= 0.15 for h in pos_by[(f, cv)]]) for f in factors}
    large_time = [o.seconds for o in outcomes if o.case.world == 1024 and not o.case.fr]
    return {
        "cases": len(outcomes),
        "recall_by_factor_and_noise": table,
        "recall_by_factor": recall_factor,
        "recall_by_factor_noise_le_15pct": recall_factor_le15,
        "recall_by_family": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(fam_hits.items())},
        "negative_cases_flagged": f"{flagged_neg}/{negatives}",
        "negative_cases_flagged_names": flagged_names,
        "wrong_ranks_flagged_total": wrong_ranks,
        "headline_correct": f"{exact}/{len(outcomes)}",
        "transient_reported_recovered": f"{sum(recovered_ok)}/{len(recovered_ok)}",
        "job_slowdown_reported_sustained": f"{sum(job_slow_found)}/{len(job_slow_found)}",
        "onset_abs_error_median_steps": statistics.median(onset_err) if onset_err else None,
        "delay_steps_median": statistics.median(delays) if delays else None,
        "delay_steps_p90": sorted(delays)[int(0.9 * (len(delays) - 1))] if delays else None,
        "delays_measured": len(delays),
        "seconds_1024x200_median": round(statistics.median(large_time), 3) if large_time else None,
        "seconds_1024x200_max": round(max(large_time), 3) if large_time else None,
        "seconds_total_detection": round(sum(o.seconds for o in outcomes), 2),
        "fr_grid": grid_report(grid),
        "small_jobs": small_report(small),
        "cli_agrees": f"{sum(1 for c, d, lib in cli if set(d.get('culprits') or []) == lib)}/{len(cli)}",
        "cli_verdicts": [(c.name, d.get("verdict"), d.get("culprits")) for c, d, _ in cli],
    }


def grid_report(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """TP × DP without a spanning collective: recall by factor and by start times, false alarms, delays."""
    by_factor: dict[str, list[bool]] = defaultdict(list)
    by_timed: dict[str, list[bool]] = defaultdict(list)
    healthy = flagged = wrong = exact = 0
    delays: list[int] = []
    missed: list[str] = []
    for o in outcomes:
        c = o.case
        expected = {sl.rank for sl in c.slow}
        got = set(o.flagged)
        exact += got == expected
        wrong += len(got - expected)
        delays += list(o.delays.values())
        if not c.slow:
            healthy += 1
            if got:
                flagged += 1
                missed.append(f"{c.name} seed={c.seed}: flagged {sorted(got)}")
            continue
        for sl in c.slow:
            by_factor[f"{sl.factor}"].append(sl.rank in got)
            by_timed["start times" if c.extra["timed"] else "durations only"].append(sl.rank in got)
            if sl.rank not in got:
                missed.append(f"{c.name} seed={c.seed}: rank {sl.rank} missed")
    return {
        "recall_by_factor": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_factor.items())},
        "recall_by_input": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_timed.items())},
        "healthy_flagged": f"{flagged}/{healthy}",
        "wrong_ranks_flagged_total": wrong,
        "headline_correct": f"{exact}/{len(outcomes)}",
        "delay_steps_median": statistics.median(delays) if delays else None,
        "delay_steps_p90": sorted(delays)[int(0.9 * (len(delays) - 1))] if delays else None,
        "not_right": missed,
    }


def small_report(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """3–7 ranks: graded stragglers (every one named?) and one fast rank (anybody named?)."""
    by_factor: dict[str, list[bool]] = defaultdict(list)
    graded = exact = one_fast = flagged = wrong = 0
    not_right: list[str] = []
    for o in outcomes:
        c = o.case
        expected = {sl.rank for sl in c.slow}
        got = set(o.flagged)
        wrong += len(got - expected)
        if c.family == "small_one_fast":
            one_fast += 1
            if got:
                flagged += 1
                not_right.append(f"{c.name} seed={c.seed}: flagged {sorted(got)}")
            continue
        graded += 1
        exact += got == expected
        for sl in c.slow:
            by_factor[f"{sl.factor}"].append(sl.rank in got)
        if got != expected:
            not_right.append(f"{c.name} seed={c.seed}: expected {sorted(expected)}, flagged {sorted(got)}")
    return {
        "graded_all_named_exactly": f"{exact}/{graded}",
        "graded_recall_by_factor": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_factor.items())},
        "one_fast_rank_flagged": f"{flagged}/{one_fast}",
        "wrong_ranks_flagged_total": wrong,
        "not_right": not_right,
    }


def online(world: int, steps: int, budget: float | None) -> dict[str, Any]:
    from gpuhealth.coordinator.straggler_feed import BudgetedStragglerFeed
    from gpuhealth.proto.convert import StepColumns

    rng = np.random.default_rng(0)
    feed = BudgetedStragglerFeed("bench", budget_records_s=budget or float("inf"))
    feed.set_world_size(world)
    slow, onset, per_batch, rate = world // 3, 20, 1000, 200_000.0
    ranks = [list(range(a, min(world, a + per_batch))) for a in range(0, world, per_batch)]
    t_sim, cpu, named = 0.0, 0.0, None
    for step in range(steps):
        comp = 0.1 * (1 + 0.05 * rng.normal(size=world))
        if step >= onset:
            comp[slow] *= 1.2
        batches = [StepColumns("bench", r, [step] * len(r), [1.7e9] * len(r), [0.13] * len(r),
                               comp[r[0]:r[-1] + 1].tolist(), None) for r in ranks]
        t0 = time.process_time()
        for cols in batches:
            t_sim += len(cols) / rate
            feed.feed(cols, now=t_sim)
        found = feed.evaluate()
        cpu += time.process_time() - t0
        if named is None and any(f.evidence["rank"] == slow for f in found):
            named = step
    return {"ranks": world, "steps": steps, "budget_records_s": budget, "stride": feed.stride,
            "cpu_s_per_rank_step_us": round(cpu / (world * steps) * 1e6, 3),
            "rank_steps_per_cpu_s": round(world * steps / cpu), "straggler_named_at_step": named, "onset_step": onset,
            "history_steps": int(feed.detector._cap)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, nargs="+", default=[100, 101, 102, 103, 104])
    p.add_argument("--cli-sample", type=int, default=6, help="cases also run through `gpuhealth triage --steps`")
    p.add_argument("--no-delay", action="store_true", help="skip the detection-delay bisection (faster)")
    p.add_argument("--family", default="", help="only this family (tuning)")
    p.add_argument("--json", default="", help="write the report here too")
    p.add_argument("--online", type=int, default=0, metavar="RANKS", help="time the coordinator's feed instead")
    p.add_argument("--online-steps", type=int, default=120)
    args = p.parse_args()
    if args.online:
        from gpuhealth.config import CoordinatorConfig

        rows = [online(args.online, args.online_steps, None),
                online(args.online, args.online_steps, CoordinatorConfig().straggler_budget_records_s)]
        print(json.dumps({"online": rows, "date": time.strftime("%Y-%m-%d"), "machine": platform.machine()}, indent=2))
        return 0
    t0 = time.perf_counter()
    cases = [c for s in args.seed for c in build_corpus(s) if not args.family or c.family == args.family]
    outcomes = evaluate(cases, delay=not args.no_delay)
    cli = []
    if args.cli_sample:
        # the small-job families came later: the sample stays the cases it was
        sample = [c for c in cases if not c.fr and c.world <= 64 and not c.family.startswith("small_")]
        step = max(1, len(sample) // args.cli_sample)
        lib = {id(o.case): set(o.flagged) for o in outcomes}
        with tempfile.TemporaryDirectory() as tmp:
            for c in sample[::step][: args.cli_sample]:
                cli.append((c, triage_cli(c, Path(tmp)), lib[id(c)]))
    rep = report(outcomes, cli)
    rep.update(seeds=args.seed, date=time.strftime("%Y-%m-%d"), python=platform.python_version(),
               machine=platform.machine(), wall_s=round(time.perf_counter() - t0, 1))
    print(json.dumps(rep, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(rep, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
