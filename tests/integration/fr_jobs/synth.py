"""Synthetic flight-recorder dumps with known answers, in the shapes real torch 2.11-2.13 jobs write.

A random job (world 2-64 = TP x PP x DP, groups named in creation order as torch names them) runs a few
training steps; one fault of one class is injected on one rank at one step. A small simulator plays the
job — Gloo: every op blocks the host; NCCL: a step's ops are enqueued at once and the host waits at the
step's end; an op completes when every participant posted it and the rank's earlier ops are done — and
each rank's dump is written as torch writes it: JSON (``rank<R>.json``) or pickle (``nccl_trace_rank_<R>``),
a ring buffer of the last entries, and the backend's quirks. Gloo: no p2p entries, state always
"scheduled", a useless pg_config, op-id based pg_status. NCCL: p2p entries named with group-local ranks,
coalesced groups with an end marker, "started" and "scheduled" states, durations. The answer
(``expected.json``) comes from the injected fault, never from the simulation's outcome; see corpus.py for
the rules it is judged by.

Classes (``CLASSES``; Gloo jobs have no pipeline stages, since Gloo records no p2p):
    healthy              no fault; a random extra op each step (none, gather, scatter, uneven all_to_all,
                         FSDP all_gather/reduce_scatter, coalesced all_reduce, pipeline p2p)
    healthy_timed        NCCL with durations and +-15 % compute jitter on every rank (no straggler)
    host_stuck           the culprit stops before one of its collectives (host stuck)
    skip                 the culprit skips one collective and goes on
    size_mismatch        the culprit passes other sizes (completes silently, or hangs)
    dtype_mismatch       the culprit passes another dtype of the same size (completes silently)
    type_mismatch        the culprit calls all_gather where the others call all_reduce (hangs)
    coalesced_mismatch   one op inside a coalesced group differs on the culprit (NCCL: broadcasts with an end
                         marker; Gloo: one coalesced all_reduce entry)
    p2p_unmatched        NCCL pipeline: the culprit never posts its send to the next stage (host stuck, or a
                         batched isend/irecv with the isend left out and the job going on)
    p2p_size_mismatch    NCCL pipeline: the culprit posts a recv of another size (the send completes, the recv
                         never does)
    alltoall_split       all_to_all_single whose split totals do not add up on the culprit
    silent_then_stall    a size mismatch that completes, then the culprit stops two steps later
    self_inconsistent    the culprit's all_gather record says input x group size != output
    same_named_groups    NCCL, older torch: every TP group has one name; a rank stops in its TP all_reduce
    gpu_stall            NCCL: the culprit's GPU never starts a collective every rank enqueued
    dump_missing         the culprit stopped and left no dump (the operator knows the world size)
    dump_unreadable      the culprit stopped and its dump cannot be read
    straggler_fr         NCCL with durations: the culprit computes 1.5x (its collectives take least)
    healthy_live         healthy_timed, dumped while it runs: each rank's dump a moment (up to 2 steps) apart,
                         so some show a collective in flight that others finished long ago
    straggler_live       straggler_fr, dumped the same way (the agent's periodic dumps of a running job)
"""

from __future__ import annotations

import json
import os
import pickle
import random
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

CLASSES = ("healthy", "healthy_timed", "host_stuck", "skip", "size_mismatch", "dtype_mismatch", "type_mismatch",
           "coalesced_mismatch", "p2p_unmatched", "p2p_size_mismatch", "alltoall_split", "silent_then_stall",
           "self_inconsistent", "same_named_groups", "gpu_stall", "dump_missing", "dump_unreadable", "straggler_fr",
           "healthy_live", "straggler_live")
VERDICTS = {"healthy": "healthy", "healthy_timed": "healthy", "host_stuck": "hang", "skip": "hang",
            "size_mismatch": "mismatch", "dtype_mismatch": "mismatch", "type_mismatch": "mismatch",
            "coalesced_mismatch": "mismatch", "p2p_unmatched": "hang", "p2p_size_mismatch": "mismatch",
            "alltoall_split": "mismatch", "silent_then_stall": "mismatch", "self_inconsistent": "mismatch",
            "same_named_groups": "hang", "gpu_stall": "hang", "dump_missing": "incomplete",
            "dump_unreadable": "incomplete", "straggler_fr": "straggler",
            "healthy_live": "healthy", "straggler_live": "straggler"}
assert set(VERDICTS) == set(CLASSES)
NCCL_ONLY = {"healthy_timed", "p2p_unmatched", "p2p_size_mismatch", "same_named_groups", "gpu_stall", "straggler_fr",
             "healthy_live", "straggler_live"}
TIMED = {"healthy_timed", "straggler_fr", "healthy_live", "straggler_live"}
LIVE = {"healthy_live": "healthy_timed", "straggler_live": "straggler_fr"}  # live class -> the fault it plays
PIPELINE = {"p2p_unmatched", "p2p_size_mismatch"}
T0_NS = 1_790_000_000_000_000_000
STEP_NS = 120_000_000


@dataclass
class Group:
    name: str
    ranks: list[int]
    desc: str = "undefined"

    def local(self, rank: int) -> int:
        return self.ranks.index(rank)


@dataclass
class Op:
    """One communication call of one rank. ``kind``: coll | send | recv; ``batch``: ops of one
    batch_isend_irecv / coalescing block share it (NCCL writes an end marker)."""

    group: Group
    kind: str
    name: str
    sizes: list[list[int]]
    out: list[list[int]]
    dtypes: list[str] | None = None
    out_dtypes: list[str] | None = None
    peer: int = -1
    batch: int = 0
    step: int = 0
    hangs: bool = False  # a faulty op that can never complete
    half: bool = False  # p2p size mismatch: the sender completes, this recv never does
    gpu_stuck: bool = False  # never starts on this rank's GPU

    @property
    def in_dtypes(self) -> list[str]:
        return self.dtypes if self.dtypes is not None else ["Float"] * len(self.sizes)

    @property
    def outdt(self) -> list[str]:
        return self.out_dtypes if self.out_dtypes is not None else ["Float"] * len(self.out)


@dataclass
class Job:
    world: int
    tp: int
    pp: int
    dp: int
    backend: str
    groups: dict[str, list[Group]]  # "world", "tp", "pp", "dp" -> groups
    created: list[Group]  # creation order (names "1", "2", … in this order)
    extra: str  # the extra op of each step
    steps: int
    numel: int
    buckets: int
    loss_all_reduce: bool

    def group_of(self, kind: str, rank: int) -> Group | None:
        return next((g for g in self.groups.get(kind, []) if rank in g.ranks), None)


@dataclass
class Case:
    name: str
    klass: str
    job: Job
    programs: list[list[Op]]  # per rank, in call order
    stuck_at: dict[int, int] = field(default_factory=dict)  # rank -> index of the first op it never posts
    expected: dict[str, Any] = field(default_factory=dict)
    fmt: str = "json"  # json | pickle
    missing: set[int] = field(default_factory=set)
    unreadable: set[int] = field(default_factory=set)
    compute: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, step) -> seconds (timed cases)
    times: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)  # (rank, op) -> (arrival, end)
    buffer: int = 2000
    dumped_at: dict[int, float] = field(default_factory=dict)  # live cases: rank -> when its dump was written (s)
    dump_plan: tuple[float, dict[int, float]] | None = None  # live: (share of the run, rank -> seconds earlier)


# ------------------------------------------------------------------------------------------ the job


def _layout(rng: random.Random, pipeline: bool | None, backend: str) -> tuple[int, int, int]:
    """``pipeline``: True forces stages, False forbids them, None draws (never on Gloo: it records no p2p)."""
    while True:
        tp = rng.choice((1, 2, 2, 4, 8))
        if pipeline is None:
            pp = 1 if backend == "gloo" else rng.choice((1, 1, 2, 4))
        else:
            pp = rng.choice((2, 2, 4)) if pipeline else 1
        dp = rng.choice((1, 2, 2, 3, 4, 8))
        world = tp * pp * dp
        if 2 <= world <= 64 and (tp > 1 or dp > 1 or pp > 1):
            return tp, pp, dp


def make_job(rng: random.Random, backend: str, *, pipeline: bool | None = None, extra: str = "none", steps: int = 6,
             same_names: bool = False) -> Job:
    tp, pp, dp = _layout(rng, pipeline, backend)
    world = tp * pp * dp
    rank_of = [[[d * pp * tp + s * tp + t for t in range(tp)] for s in range(pp)] for d in range(dp)]
    created: list[Group] = []
    groups: dict[str, list[Group]] = {"world": [Group("0", list(range(world)), "default_pg")]}
    counter = 0

    def add(kind: str, members: list[list[int]]) -> None:
        nonlocal counter
        shared = str(counter + 1)
        for m in members:
            counter += 1
            g = Group(shared if same_names else str(counter), sorted(m))
            created.append(g)
            groups.setdefault(kind, []).append(g)
        if same_names:
            counter = int(shared)

    if tp > 1:
        add("tp", [rank_of[d][s] for d in range(dp) for s in range(pp)])
    if pp > 1:
        add("pp", [[rank_of[d][s][t] for s in range(pp)] for d in range(dp) for t in range(tp)])
    if dp > 1:
        add("dp", [[rank_of[d][s][t] for d in range(dp)] for s in range(pp) for t in range(tp)])
    return Job(world=world, tp=tp, pp=pp, dp=dp, backend=backend, groups=groups, created=created, extra=extra,
               steps=steps, numel=rng.choice((256, 1024, 4096)), buckets=rng.choice((1, 1, 2, 3)),
               loss_all_reduce=rng.random() < 0.7 or (tp == 1 and dp == 1))


def _extra_ops(job: Job, rank: int, step: int) -> list[Op]:
    world = job.groups["world"][0]
    w, b = job.world, job.backend
    if job.extra == "gather":
        root = rank == 0
        if b == "nccl":
            return [Op(world, "coll", "gather", [[4]], [[4]] * w if root else [[0]],
                       out_dtypes=None if root else ["UNKNOWN_SCALAR"], step=step)]
        return [Op(world, "coll", "gather", [[4]], [[w, 4]] if root else [], out_dtypes=None if root else [],
                   step=step)]
    if job.extra == "scatter":
        root = rank == 0
        if b == "nccl":
            return [Op(world, "coll", "scatter", [[4]], [[4]] * w if root else [[0]],
                       out_dtypes=None if root else ["UNKNOWN_SCALAR"], step=step)]
        return [Op(world, "coll", "scatter", [[w, 4]] if root else [], [[4]], dtypes=None if root else [],
                   step=step)]
    if job.extra == "alltoall":
        ins = [1 + (rank + 2 * j) % w for j in range(w)]
        outs = [1 + (j + 2 * rank) % w for j in range(w)]
        return [Op(world, "coll", "all_to_all", [[sum(ins)]], [[sum(outs)]], step=step)]
    if job.extra == "fsdp":
        g = job.group_of("dp", rank) or world
        n = len(g.ranks)
        if b == "nccl":
            return [Op(g, "coll", "all_gather_into_tensor_coalesced", [[3], [5]], [[3 * n], [5 * n]], batch=1,
                       step=step),
                    Op(g, "coll", "_reduce_scatter_base", [[3 * n]], [[3]], step=step)]
        return [Op(g, "coll", "all_gather", [[3], [5]], [[2, 3]], step=step),
                Op(g, "coll", "all_reduce", [[3 * n]], [[3 * n]], step=step)]
    if job.extra == "coalesced":
        if b == "nccl":
            return [Op(world, "coll", "allreduce_coalesced", [[4, 4], [7]], [[4, 4], [7]], batch=1, step=step)]
        return [Op(world, "coll", "all_reduce", [[4, 4], [7]], [[4, 4], [7]], step=step)]
    if job.extra == "coalesced_broadcast":  # NCCL only: two broadcasts in one coalescing block
        return [Op(world, "coll", "broadcast", [[4, 4]], [[4, 4]], batch=1, step=step),
                Op(world, "coll", "broadcast", [[7]], [[7]], batch=1, step=step)]
    return []


def program(job: Job, rank: int, *, batched: bool = False) -> list[Op]:
    """One rank's calls over the whole run: per step, the pipeline recv, TP all_reduce, pipeline send, the
    DP gradient buckets, the job's extra op and the loss all_reduce."""
    ops: list[Op] = []
    tp, pp, dp = (job.group_of(k, rank) for k in ("tp", "pp", "dp"))
    world = job.groups["world"][0]
    for step in range(job.steps):
        if pp is not None:
            stage = pp.local(rank)
            prev = pp.ranks[stage - 1] if stage > 0 else None
            nxt = pp.ranks[stage + 1] if stage < len(pp.ranks) - 1 else None
            if batched:
                if prev is not None:
                    ops.append(Op(pp, "recv", "recv", [[64]], [[64]], peer=prev, batch=2, step=step))
                if nxt is not None:
                    ops.append(Op(pp, "send", "send", [[64]], [[64]], peer=nxt, batch=2, step=step))
            elif prev is not None:
                ops.append(Op(pp, "recv", "recv", [[64]], [[64]], peer=prev, step=step))
        if tp is not None:
            ops.append(Op(tp, "coll", "all_reduce", [[16]], [[16]], step=step))
        if pp is not None and not batched and nxt is not None:
            ops.append(Op(pp, "send", "send", [[64]], [[64]], peer=nxt, step=step))
        if dp is not None:
            ops += [Op(dp, "coll", "all_reduce", [[job.numel]], [[job.numel]], step=step) for _ in range(job.buckets)]
        ops += _extra_ops(job, rank, step)
        if job.loss_all_reduce:
            ops.append(Op(world, "coll", "all_reduce", [[1]], [[1]], step=step))
    return ops


# ------------------------------------------------------------------------------------- the simulator


@dataclass
class Played:
    posted: list[int]  # per rank, how many of its ops were posted
    done: list[list[bool]]  # per rank, per posted op


def _keys(programs: list[list[Op]]) -> list[list[tuple[Any, ...]]]:
    """The matching key of every op: a collective by (group, members, index in the group); a p2p by
    (group, members, src, dst, index of that pair's ops). Ranks match ops by order, as NCCL and Gloo do."""
    out = []
    for rank, prog in enumerate(programs):
        count: dict[tuple[Any, ...], int] = defaultdict(int)
        keys = []
        for op in prog:
            gid = (op.group.name, tuple(op.group.ranks))
            if op.kind == "coll":
                base: tuple[Any, ...] = ("c", gid)
            else:
                src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                base = ("p", gid, src, dst)
            count[base] += 1
            keys.append((*base, count[base]))
        out.append(keys)
    return out


def play(case: Case) -> Played:
    progs, backend = case.programs, case.job.backend
    keys = _keys(progs)
    n = len(progs)
    posted = [0] * n
    done = [[False] * len(p) for p in progs]
    where: dict[tuple[Any, ...], list[tuple[int, int]]] = defaultdict(list)  # key -> (rank, index) posted

    def limit(r: int) -> int:
        return case.stuck_at.get(r, len(progs[r]))

    changed = True
    while changed:
        changed = False
        for r in range(n):  # post what the host may post
            while posted[r] < limit(r):
                i = posted[r]
                if backend == "gloo":
                    if i > 0 and not done[r][i - 1]:
                        break  # Gloo blocks the host in every op
                else:
                    step = progs[r][i].step
                    if any(not done[r][j] for j in range(i) if progs[r][j].step < step):
                        break  # NCCL: the host waits for the previous step's work at the step's end
                where[keys[r][i]].append((r, i))
                posted[r] += 1
                changed = True
        for key, holders in list(where.items()):  # complete what every participant posted
            if all(done[r][i] for r, i in holders):
                continue
            r0, i0 = holders[0]
            op = progs[r0][i0]
            need = 2 if key[0] == "p" else len(op.group.ranks)
            if len(holders) < need:
                continue
            ops = [progs[r][i] for r, i in holders]
            if any(o.hangs or o.gpu_stuck for o in ops):
                continue
            if backend == "nccl" and not all(_in_order(progs[r], done[r], i) for r, i in holders):
                continue
            for (r, i), o in zip(holders, ops, strict=True):
                if not o.half and not done[r][i]:  # a recv of the wrong size never completes; its send does
                    done[r][i] = True
                    changed = True
    return Played(posted=posted, done=done)


def _in_order(prog: list[Op], done: list[bool], i: int) -> bool:
    """NCCL: an op runs once the rank's earlier ops are done. torch's blocking calls make the current stream
    wait for each op, and every later op's NCCL stream waits for the current stream (ops of one batch or
    coalescing block run together)."""
    o = prog[i]
    return all(done[j] for j in range(i) if not (o.batch and prog[j].batch == o.batch and prog[j].step == o.step))


# ------------------------------------------------------------------------------------------ the dumps


def _entries(case: Case, rank: int, played: Played) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    job, prog, backend = case.job, case.programs[rank], case.job.backend
    nccl = backend == "nccl"
    member = [g for g in [job.groups["world"][0], *job.created] if rank in g.ranks]
    local = {id(g): k for k, g in enumerate(member)}
    seq: dict[int, int] = defaultdict(int)
    p2p: dict[int, int] = defaultdict(int)
    opid: dict[int, int] = defaultdict(int)
    pending_seen = False  # NCCL: only the rank's first unfinished op has started on its GPU
    out: list[dict[str, Any]] = []
    n_posted = played.posted[rank]
    i = 0
    while i < n_posted:
        op = prog[i]
        # a batch (coalescing block / batch_isend_irecv) is recorded together
        j = i + 1
        while op.batch and j < n_posted and prog[j].batch == op.batch and prog[j].step == op.step \
                and prog[j].group is op.group:
            j += 1
        block = list(range(i, j))
        g = op.group
        pg = local[id(g)]
        is_coll = op.kind == "coll"
        if is_coll:
            seq[pg] += 1
        elif nccl:
            p2p[pg] += 1
        t = T0_NS + op.step * STEP_NS + i * 1_000_000
        finished = all(played.done[rank][k] for k in block)
        if not finished and not pending_seen:
            pending_seen = True
            state = "scheduled" if any(prog[k].gpu_stuck for k in block) else "started"
        else:
            state = "completed" if finished else "scheduled"
        for k in block:
            opid[pg] += 1
            o = prog[k]
            if not nccl and o.kind != "coll":
                continue  # Gloo records no send/recv
            # NCCL: the ops of a batch stay "scheduled"; their end marker carries the state
            sub = nccl and (len(block) > 1 or (bool(o.batch) and (o.kind != "coll" or o.name == "broadcast")))
            name = o.name
            if o.kind != "coll":
                a, b = g.local(rank), g.local(o.peer)
                name = f"send {a}->{b}" if o.kind == "send" else f"recv {a}<-{b}"
            e_state = ("scheduled" if sub else state) if nccl else "scheduled"
            retired = finished if not nccl else (False if sub else state == "completed")
            out.append(_entry(case, rank, o, g, pg, seq[pg], p2p[pg] if nccl else 0, opid[pg], f"{backend}:{name}",
                              e_state, retired, t + (k - i), is_p2p=o.kind != "coll", index=k))
        if nccl and op.batch:  # the coalescing block's end marker carries the state
            marker = replace(op, sizes=[], out=[], dtypes=[], out_dtypes=[])
            out.append(_entry(case, rank, marker, g, pg, seq[pg], p2p[pg], opid[pg], "nccl:coalesced", state,
                              state == "completed", t + len(block), is_p2p=False, index=block[-1]))
        i = j
    status = _status(out, nccl)
    if nccl:
        config = {g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.ranks)} for g in member}
    else:  # Gloo records pg_config before the group is named, and the last group overwrites it
        last = job.created[-1] if job.created else job.groups["world"][0]
        config = {"": {"name": "", "desc": "", "ranks": str(last.ranks) if rank in last.ranks else "[]"}}
    for record_id, e in enumerate(out):
        e["record_id"] = record_id
    return out[-case.buffer:], status, config


def _entry(case: Case, rank: int, o: Op, g: Group, pg: int, seq: int, p2p: int, opid: int, profiling: str,
           state: str, retired: bool, t: int, *, is_p2p: bool, index: int) -> dict[str, Any]:
    nccl = case.job.backend == "nccl"
    e: dict[str, Any] = {
        "collective_seq_id": seq, "p2p_seq_id": p2p, "op_id": opid, "pg_id": pg,
        "process_group": [g.name, g.desc], "profiling_name": profiling, "input_sizes": o.sizes,
        "output_sizes": o.out, "input_dtypes": o.in_dtypes, "output_dtypes": o.outdt, "state": state,
        "retired": retired, "is_p2p": is_p2p, "time_created_ns": t, "timeout_ms": 600000,
        "time_discovered_started_ns": t + 1000 if nccl and state in ("started", "completed") else 0,
        "time_discovered_completed_ns": t + 2000 if nccl and state == "completed" else 0,
        "thread_id": "140000000000000", "thread_name": "python3",
    }
    if nccl and case.times and (rank, index) in case.times:
        # timed runs: the clock of the simulated run (an op lasts from this rank's arrival to the end)
        arrival, end = case.times[(rank, index)]
        e["time_created_ns"] = T0_NS + int(arrival * 1e9) - 20_000
        if state in ("started", "completed"):
            e["time_discovered_started_ns"] = T0_NS + int(arrival * 1e9)
        if state == "completed":
            e["time_discovered_completed_ns"] = T0_NS + int(end * 1e9)
            e["duration_ms"] = round(1000 * (end - arrival), 4)
    return e


def timeline(case: Case) -> dict[tuple[int, int], tuple[float, float]]:
    """(arrival, end), in seconds from the start, of every op of a job that runs to the end (timed cases have
    no fault that stops it). Each rank's clock advances by its compute once a step's activations arrived; an
    op starts when its last participant arrives, so it lasts longest on the rank that arrived first (that is
    what NCCL's duration_ms measures). Later pipeline stages reach cross-stage collectives later by design."""
    progs = case.programs
    keys = _keys(progs)
    clock = [0.0] * len(progs)
    nxt = [0] * len(progs)
    blocked = [False] * len(progs)
    out: dict[tuple[int, int], tuple[float, float]] = {}
    waiting: dict[tuple[Any, ...], list[int]] = defaultdict(list)
    base = 0.00005
    # a stage computes once its activations arrived: before the first op of the step that is not a recv
    compute_at: list[set[int]] = []
    for prog in progs:
        firsts: dict[int, int] = {}
        for i, o in enumerate(prog):
            if o.kind != "recv":
                firsts.setdefault(o.step, i)
        compute_at.append(set(firsts.values()))
    progress = True
    while progress:
        progress = False
        for r, prog in enumerate(progs):
            if nxt[r] >= len(prog) or blocked[r]:
                continue
            i = nxt[r]
            if i in compute_at[r]:
                clock[r] += case.compute.get((r, prog[i].step), 0.0)
            key = keys[r][i]
            waiting[key].append(r)
            blocked[r] = True
            need = 2 if key[0] == "p" else len(prog[i].group.ranks)
            if len(waiting[key]) == need:
                holders = waiting.pop(key)
                start = max(clock[h] for h in holders)
                for h in holders:
                    out[(h, nxt[h])] = (clock[h], start + base)
                    clock[h] = start + base
                    nxt[h] += 1
                    blocked[h] = False
            progress = True
    return out


def _status(entries: list[dict[str, Any]], nccl: bool) -> dict[str, dict[str, int]]:
    status: dict[str, dict[str, int]] = {}
    for e in entries:
        s = status.setdefault(str(e["pg_id"]), {"last_enqueued_collective": -1, "last_started_collective": -1,
                                                 "last_completed_collective": -1})
        key = e["collective_seq_id"] if nccl else e["op_id"]
        s["last_enqueued_collective"] = max(s["last_enqueued_collective"], key)
        if nccl and e["state"] in ("started", "completed"):
            s["last_started_collective"] = max(s["last_started_collective"], key)
        if e["retired"] or e["state"] == "completed":
            s["last_completed_collective"] = max(s["last_completed_collective"], key)
    return status


def write(case: Case, folder: Path) -> Path:
    """Write the case: ``folder/<name>/dumps/…`` and ``expected.json``. Returns the case folder."""
    played = play(case)
    if case.compute:
        case.times = timeline(case)
    if case.dump_plan is not None:
        share, earlier = case.dump_plan
        newest = share * max(end for _, end in case.times.values())
        case.dumped_at = {r: newest - earlier[r] for r in range(case.job.world)}
        played = _dumped_while_running(case)
    root = folder / case.name
    dumps = root / "dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    nccl = case.job.backend == "nccl"
    for rank in range(case.job.world):
        if rank in case.missing:
            continue
        entries, status, config = _entries(case, rank, played)
        doc: dict[str, Any] = {"version": "2.10", "comm_lib_version": "2.28.9" if nccl else "",
                               "pg_config": config, "entries": entries}
        if case.fmt == "json":
            doc["pg_status"] = {k: {kk: str(vv) for kk, vv in v.items()} for k, v in status.items()}
            doc["nccl_comm_state"] = {}
            data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
            path = dumps / f"rank{rank}.json"
        else:
            doc["pg_status"] = status
            for e in entries:
                e["process_group"] = tuple(e["process_group"])
                for k in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                    e[k] = e[k] or None
                e["frames"] = [{"name": "train_step", "filename": "/workspace/train.py", "line": 100 + e["op_id"]}]
            data = pickle.dumps(doc)
            path = dumps / f"nccl_trace_rank_{rank}"
        if rank in case.unreadable:
            data = data[: len(data) // 3]  # cut short, as a dump killed mid-write
        path.write_bytes(data)
        if rank in case.dumped_at:  # the file was written when the rank dumped, as a live dump's is
            ns = T0_NS + int(case.dumped_at[rank] * 1e9)
            os.utime(path, ns=(ns, ns))
    (root / "expected.json").write_text(json.dumps(case.expected, indent=2, sort_keys=True) + "\n")
    return root


def _dumped_while_running(case: Case) -> Played:
    """What each rank's dump holds when written at ``case.dumped_at[rank]`` of a job that runs on: the ops its
    host had reached by then, those finished by then completed (with their durations), the rest in flight."""
    posted, done = [], []
    for r, prog in enumerate(case.programs):
        at = case.dumped_at[r]
        times = [case.times[(r, i)] for i in range(len(prog))]
        n = sum(1 for arrival, _ in times if arrival <= at)
        posted.append(n)
        done.append([end <= at for _, end in times[:n]] + [False] * (len(prog) - n))
    return Played(posted=posted, done=done)


# --------------------------------------------------------------------------------------- the faults


def _pick(rng: random.Random, prog: list[Op], lo_step: int, *, kinds: tuple[str, ...] = ("coll",),
          name: str | None = None, group: Group | None = None, exclude_batch: bool = True) -> int:
    """Index of a random op of the culprit at or after ``lo_step`` (not in the last step) matching the filters."""
    last = max(o.step for o in prog)
    cands = [i for i, o in enumerate(prog) if o.kind in kinds and lo_step <= o.step < last
             and (name is None or o.name == name) and (group is None or o.group is group)
             and not (exclude_batch and o.batch)]
    if not cands:
        raise LookupError("no op to fault")
    return rng.choice(cands)


def make_case(rng: random.Random, klass: str, index: int) -> Case:
    """One case of ``klass`` (raises LookupError when the drawn job cannot host it; draw again)."""
    backend = "nccl" if klass in NCCL_ONLY or rng.random() < 0.5 else "gloo"
    pipeline: bool | None = None
    if klass in PIPELINE or (klass == "healthy" and backend == "nccl" and rng.random() < 0.3):
        pipeline = True
    elif klass in TIMED:
        pipeline = False  # the simulated forward-only pipeline would put whole stages behind by design
    extra = "none"
    if klass == "healthy":
        extra = rng.choice(("none", "gather", "scatter", "alltoall", "fsdp", "coalesced"))
    elif klass == "alltoall_split":
        extra = "alltoall"
    elif klass == "coalesced_mismatch":
        extra = "coalesced_broadcast" if backend == "nccl" else "coalesced"
    elif klass == "self_inconsistent":
        extra = "fsdp" if backend == "nccl" else "none"
    steps = (40 if klass in LIVE else 20) if klass in TIMED else rng.randint(4, 8)
    job = make_job(rng, backend, pipeline=pipeline, extra=extra, steps=steps,
                   same_names=klass == "same_named_groups")
    batched = bool(pipeline) and klass in ("p2p_unmatched", "healthy") and rng.random() < 0.5
    programs = [program(job, r, batched=batched) for r in range(job.world)]
    culprit = rng.randrange(job.world)
    fault_step = rng.randint(1, max(1, steps - 2))
    case = Case(name=f"{index:04d}_{klass}", klass=klass, job=job, programs=programs,
                fmt=rng.choice(("json", "pickle")), buffer=rng.choice((2000, 2000, 64, 40)))
    why = _inject(rng, case, LIVE.get(klass, klass), culprit, fault_step)
    if klass in LIVE:
        # Dumped while the job runs, rank by rank: the newest a little after the middle of the run, each
        # other up to two steps (0.1 s) earlier.
        case.dump_plan = (rng.uniform(0.55, 0.85), {r: rng.uniform(0.0, 0.1) for r in range(job.world)})
        why += "; dumped while running, each rank's dump up to 0.1 s before the newest"
    roots = [] if klass in ("healthy", "healthy_timed", "healthy_live") else [culprit]
    verdict = VERDICTS[klass]
    case.expected = {"verdict": verdict, "root_ranks": roots, "root_code": klass, "why": why,
                     "made_by": f"synth.make_case(seed, {klass!r}, {index})", "backend": backend,
                     "world_size": job.world, "layout": {"tp": job.tp, "pp": job.pp, "dp": job.dp},
                     "format": case.fmt}
    if klass in ("dump_missing", "dump_unreadable"):
        case.expected["job"] = {"world_size": job.world}
    return case


def _inject(rng: random.Random, case: Case, klass: str, c: int, step: int) -> str:
    prog = case.programs[c]
    job = case.job
    if klass in ("healthy", "healthy_timed"):
        if klass == "healthy_timed":
            for r in range(job.world):
                for s in range(job.steps):
                    case.compute[(r, s)] = 0.05 * (1 + rng.uniform(-0.15, 0.15))
        return f"no fault ({job.extra} extra op each step)"
    if klass == "straggler_fr":
        if job.group_of("dp", c) is None:
            raise LookupError("needs DP groups for durations")
        for r in range(job.world):
            for s in range(job.steps):
                case.compute[(r, s)] = 0.05 * (1 + rng.uniform(-0.05, 0.05)) * (1.5 if r == c else 1.0)
        return f"rank {c} computes 1.5x as long every step; NCCL durations show the others waiting for it"
    if klass in ("host_stuck", "dump_missing", "dump_unreadable", "same_named_groups"):
        group = job.group_of("tp", c) if klass == "same_named_groups" else None
        if klass == "same_named_groups" and group is None:
            raise LookupError("needs TP groups")
        i = _pick(rng, prog, step, group=group)
        case.stuck_at[c] = i
        if klass == "dump_missing":
            case.missing.add(c)
        if klass == "dump_unreadable":
            case.unreadable.add(c)
        what = {"dump_missing": "; its dump is missing", "dump_unreadable": "; its dump is cut short (unreadable)",
                "same_named_groups": "; every TP group has the same name"}.get(klass, "")
        return f"rank {c} stops (host stuck) before {prog[i].name} in group {prog[i].group.name}{what}"
    if klass == "gpu_stall":
        i = _pick(rng, prog, step)
        prog[i].gpu_stuck = True
        return f"rank {c}'s GPU never starts {prog[i].name} in group {prog[i].group.name}"
    if klass == "skip":
        # a skip shifts the rank's later ops in that group by one: only where they all look alike
        i = _pick(rng, prog, step, name="all_reduce")
        g = prog[i].group
        if len({(tuple(map(tuple, o.sizes)), o.name) for o in prog if o.group is g}) > 1:
            raise LookupError("the group's ops differ: a skip would read as a mismatch")
        del prog[i]
        return f"rank {c} skips one all_reduce in group {g.name} and goes on"
    if klass in ("size_mismatch", "dtype_mismatch", "type_mismatch", "silent_then_stall"):
        i = _pick(rng, prog, step, name="all_reduce")
        o = prog[i]
        if klass == "dtype_mismatch":
            o.dtypes = o.out_dtypes = ["Int"]
            return f"rank {c} all_reduces int32 where the others use float32 (passes silently)"
        if klass == "type_mismatch":
            n = len(o.group.ranks)
            prog[i] = replace(o, name="all_gather", out=[[n * o.sizes[0][0]]], hangs=True)
            return f"rank {c} calls all_gather where group {o.group.name} calls all_reduce"
        o.sizes = o.out = [[o.sizes[0][0] * 2]]
        if klass == "silent_then_stall":
            later = [k for k, x in enumerate(prog) if x.step == o.step + 2 and x.kind == "coll" and not x.batch]
            if not later:
                raise LookupError("no later step")
            case.stuck_at[c] = later[0]
            return f"rank {c} passes twice the size in all_reduce of group {o.group.name} (completes), then stops"
        o.hangs = rng.random() < 0.5
        return f"rank {c} passes twice the size in all_reduce of group {o.group.name}" + (
            " (the op hangs)" if o.hangs else " (completes silently)")
    if klass == "coalesced_mismatch":
        o = prog[rng.choice([k for k, x in enumerate(prog) if x.sizes in ([[4, 4]], [[4, 4], [7]])
                             and step <= x.step < job.steps - 1])]
        o.sizes = o.out = [[5, 5], *o.sizes[1:]]
        o.hangs = True
        return f"rank {c} passes [5,5] where the others pass [4,4] inside a coalesced group"
    if klass == "alltoall_split":
        i = _pick(rng, prog, step, name="all_to_all")
        o = prog[i]
        o.out = [[o.out[0][0] + 2]]
        o.hangs = job.backend == "nccl"
        return f"rank {c}'s all_to_all_single output splits total 2 more than its peers send"
    if klass == "self_inconsistent":
        if job.backend == "nccl":
            i = _pick(rng, prog, step, name="_reduce_scatter_base")
            o = prog[i]
            o.sizes = [[o.sizes[0][0] + 3]]
        else:
            i = _pick(rng, prog, step, name="all_reduce")
            o = prog[i]
            o.out = [[o.sizes[0][0] + 3]]
        o.hangs = True
        return f"rank {c}'s {o.name} record is inconsistent in itself (input {o.sizes} vs output {o.out})"
    if klass == "p2p_unmatched":
        i = _pick(rng, prog, step, kinds=("send",), exclude_batch=False)
        if prog[i].batch:
            del prog[i]  # posts only its irecv and goes on
            return f"rank {c} leaves its isend to the next stage out of its batch_isend_irecv and goes on"
        case.stuck_at[c] = i
        return f"rank {c} never posts its send to the next pipeline stage (host stuck)"
    if klass == "p2p_size_mismatch":
        i = _pick(rng, prog, step, kinds=("recv",))
        prog[i].sizes = prog[i].out = [[128]]
        prog[i].half = True
        return f"rank {c} posts a recv of [128] where its sender sends [64] (as in every earlier step)"
    raise ValueError(klass)


def generate(n: int, seed: int, classes: tuple[str, ...] = CLASSES) -> list[Case]:
    """``n`` cases, round-robin over ``classes``; deterministic for a seed."""
    rng = random.Random(seed)
    out: list[Case] = []
    while len(out) < n:
        klass = classes[len(out) % len(classes)]
        for _ in range(50):
            try:
                out.append(make_case(rng, klass, len(out)))
                break
            except LookupError:
                continue
        else:
            raise RuntimeError(f"could not draw a job for class {klass}")
    return out
