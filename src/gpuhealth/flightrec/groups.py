"""Process groups across ranks: identity, membership, progress and each rank's calls.

A group is keyed by its *name* — the one id that is the same on every rank (``pg_id`` is a
per-process counter) — and, when two groups share a name, by name and members. Older torch named
split groups with a shared counter, so ranks {0,1} and {2,3} may both call their group "1": each
rank's own ``pg_config`` says which one it is in, and the two are kept apart (merging them would
invent a 2-vs-2 mismatch and hide a real hang).

Membership: the job's description when given, else ``pg_config`` when it names real ranks (NCCL),
else "every rank" for the default group, else the ranks that have entries in the group (Gloo
records a useless ``{"": …}`` pg_config).

Progress comes from the entries: Gloo's ``pg_status`` counts every op (its numbers are op ids,
not collective sequence ids) and NCCL's mixes point-to-point sequence numbers into it, so it is
only a fallback for a rank whose ring buffer holds no collective of the group.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.flightrec.calls import (
    ALL_GATHER_OPS,
    COALESCED_MARKERS,
    REDUCE_SCATTER_OPS,
    Call,
    build_calls,
)
from gpuhealth.flightrec.load import Entry, PgStatus, RankDump
from gpuhealth.flightrec.text import format_ranks
from gpuhealth.model import MAX_RANKS

DEFAULT_GROUP_NAMES = frozenset({"0", "default_pg"})
# Collectives that complete on one member only once every member has posted them (not broadcast, reduce,
# gather, scatter: a root may finish first; not all_to_all: a rank may expect nothing from some peer).
# Posted, not completed: with mismatched sizes one member finishes while another waits for more.
EVERY_MEMBER_OPS = ALL_GATHER_OPS | REDUCE_SCATTER_OPS | frozenset(
    {"all_reduce", "allreduce", "allreduce_coalesced", "barrier"})
# Membership we trust enough to reason from one member's completion about another's progress.
_KNOWN_MEMBERS = frozenset({"job", "pg_config", "world"})


@dataclass(frozen=True, slots=True)
class P2POp:
    """One send or recv of one rank (global ranks; ``peer`` None: any source)."""

    rank: int
    peer: int | None
    kind: str  # "send" | "recv"
    entry: Entry
    batch: int  # ops posted together (batch_isend_irecv) share this id
    batch_done: bool | None = None  # a batch's completion, from its end marker (its ops' states never move)

    @property
    def done(self) -> bool:
        if self.batch_done is not None:
            return self.batch_done
        return self.entry.retired or self.entry.state == "completed"


@dataclass(slots=True)
class GroupView:
    """One process group across all ranks that dumped."""

    name: str  # unique key: the pg name, or "name[members]" when two groups share a name
    pg_name: str
    desc: str
    members: tuple[int, ...]
    membership_source: str  # "job" | "pg_config" | "world" | "entries"
    dumped: tuple[int, ...]
    missing_dumps: tuple[int, ...]
    enqueued: dict[int, int] = field(default_factory=dict)
    completed: dict[int, int] = field(default_factory=dict)
    calls: dict[int, dict[int, Call]] = field(default_factory=dict)  # rank -> seq -> call
    oldest_seq: dict[int, int] = field(default_factory=dict)  # oldest loaded seq per rank (ring buffer)
    p2p: dict[int, list[P2POp]] = field(default_factory=dict)  # rank -> its send/recv ops, in order
    whole_history: dict[int, bool] = field(default_factory=dict)  # rank -> its ring buffer still holds record 0
    # The newest collective every member is proven to have posted (a kernel of it ran to completion
    # somewhere: ``_credit_joined``); 0 when nothing proves it.
    joined: int = 0
    # Members whose dump ends before ``joined`` (rank → the last collective its dump shows it posted): the
    # dump was taken before the rank went on, so it shows nothing of what came after.
    stale: dict[int, int] = field(default_factory=dict)

    def pending(self, rank: int) -> bool:
        return self.enqueued.get(rank, 0) > self.completed.get(rank, 0)

    def call(self, rank: int, seq: int) -> Call | None:
        return self.calls.get(rank, {}).get(seq)

    def entry(self, rank: int, seq: int) -> Entry | None:
        c = self.call(rank, seq)
        return c.head if c is not None else None

    def global_rank(self, local: int | None) -> int | None:
        if local is None or not 0 <= local < len(self.members):
            return None
        return sorted(self.members)[local]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "pg_name": self.pg_name, "desc": self.desc, "members": list(self.members),
            "membership_source": self.membership_source, "ranks_dumped": list(self.dumped),
            "ranks_missing": list(self.missing_dumps),
            "last_enqueued": {str(r): v for r, v in sorted(self.enqueued.items())},
            "last_completed": {str(r): v for r, v in sorted(self.completed.items())},
        }


def build_groups(dumps: Mapping[int, RankDump], job: Mapping[str, Any] | None = None,
                 known_ranks: Sequence[int] = ()) -> tuple[dict[str, GroupView], int]:
    """Group views and the world size. ``job`` may give ``world_size`` and ``groups`` {name: [ranks]};
    ``known_ranks``: ranks known to exist without a readable dump (a file named for them)."""
    job = job or {}
    # The job's description is input too: only ranks a job can have (the coordinator and the CLI check it).
    job_groups = {str(k): tuple(r for r in (int(x) for x in v) if 0 <= r < MAX_RANKS)
                  for k, v in (job.get("groups") or {}).items()}
    configured = _configured_members(dumps)
    ambiguous = {name for name, sets in configured.items() if len(sets) > 1}
    per_group: dict[str, dict[int, list[Entry]]] = defaultdict(lambda: defaultdict(list))
    desc: dict[str, str] = {}
    pg_names: dict[str, str] = {}
    cfg_members: dict[str, tuple[int, ...]] = {}
    for rank, d in dumps.items():
        own = {name: members for name in ambiguous for members in configured[name] if rank in members} \
            if ambiguous else {}
        for e in d.entries:
            key = e.group
            if e.group in ambiguous and e.group in own:
                key = f"{e.group}[{format_ranks(own[e.group])}]"
                cfg_members[key] = own[e.group]
            per_group[key][rank].append(e)
            desc.setdefault(key, e.group_desc)
            pg_names.setdefault(key, e.group)
    for name, sets in configured.items():
        if name not in ambiguous:
            cfg_members[name] = next(iter(sets))
    world = min(int(job.get("world_size") or 0), MAX_RANKS)
    for name, members in cfg_members.items():
        if pg_names.get(name, name) in DEFAULT_GROUP_NAMES or desc.get(name) == "default_pg":
            world = max(world, len(members))
    # Every rank any pg_config lists exists — even Gloo's unnamed entry (it lists the last group created,
    # often the world): a rank that left no dump is then known to be missing, not unheard of.
    tops: dict[int, int] = {}  # one max per distinct list (every rank repeats the world's)
    for d in dumps.values():
        for cfg in d.pg_config.values():
            if cfg.ranks and id(cfg.ranks) not in tops:
                tops[id(cfg.ranks)] = max(cfg.ranks)
    listed = max(tops.values(), default=-1)
    top = max([*dumps, *known_ranks, listed], default=-1)
    world = max(world, top + 1)
    seen_in = {key: tuple(sorted(per_group[key])) for key in per_group
               if key not in job_groups and key not in cfg_members
               and not (pg_names.get(key, key) in DEFAULT_GROUP_NAMES or desc.get(key) == "default_pg")}
    blocks = _sibling_blocks(seen_in)
    if not job.get("world_size"):
        world = max([world, *(max(m) + 1 for m in blocks.values())])
    groups: dict[str, GroupView] = {}
    for key in sorted(set(per_group) | set(job_groups), key=group_sort_key):
        if key in job_groups:
            members, source = job_groups[key], "job"
        elif key in cfg_members:
            members, source = cfg_members[key], "pg_config"
        elif pg_names.get(key, key) in DEFAULT_GROUP_NAMES or desc.get(key) == "default_pg":
            members, source = tuple(range(world)), "world"
        elif key in blocks:
            members, source = blocks[key], "siblings"
        else:
            members, source = tuple(sorted(per_group[key])), "entries"
        dumped = tuple(r for r in members if r in dumps)
        view = GroupView(name=key, pg_name=pg_names.get(key, key), desc=desc.get(key, ""), members=members,
                         membership_source=source, dumped=dumped,
                         missing_dumps=tuple(r for r in members if r not in dumps))
        for rank in dumped:
            _fill(view, rank, dumps[rank], per_group[key].get(rank, []))
        _credit_joined(view)
        groups[key] = view
    return groups, world


def _sibling_blocks(seen_in: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Groups whose members only the entries tell (Gloo) and that look like a short block of equal siblings:
    TP groups {0,1} {2,3} {4,5} where only rank 2 of the middle one left a dump. Contiguous blocks of one
    size k, each starting at a multiple of k, are how torch jobs build subgroups; a group seen with fewer
    ranks than its siblings, inside such a block, is completed to the block (its other ranks left no dump)."""
    sizes = [len(m) for m in seen_in.values()]
    if len(sizes) < 2:
        return {}
    k = max(sizes)
    full = [m for m in seen_in.values() if len(m) == k]
    blocky = all(m == tuple(range(m[0], m[0] + k)) and m[0] % k == 0 for m in full)
    if k < 2 or not blocky or len(full) * 2 < len(sizes):
        return {}
    out = {}
    for key, m in seen_in.items():
        start = m[0] - m[0] % k
        if len(m) < k and all(start <= r < start + k for r in m):
            out[key] = tuple(range(start, start + k))
    return out


def _configured_members(dumps: Mapping[int, RankDump]) -> dict[str, set[tuple[int, ...]]]:
    """pg name -> the distinct member lists that ranks' own pg_configs give for it (a rank's entry
    counts only when it lists that rank: Gloo's pg_config names the last group created, not its own)."""
    out: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    # Every rank repeats the world's list (the loader shares one tuple per distinct list): normalise
    # each list once, not once per rank (16k × 16k at 16k ranks).
    normal: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}
    added: set[tuple[str, int]] = set()  # (name, id of the list): hashing a 16k-rank tuple once, not per rank
    for rank, d in dumps.items():
        for key, cfg in d.pg_config.items():
            if not key or not cfg.ranks:
                continue
            got = normal.get(id(cfg.ranks))
            if got is None:
                members = tuple(sorted(set(cfg.ranks)))
                got = normal[id(cfg.ranks)] = (members, frozenset(members))
            if rank in got[1] and (key, id(got[0])) not in added:
                added.add((key, id(got[0])))
                out[key].add(got[0])
    return out


def group_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _fill(view: GroupView, rank: int, dump: RankDump, entries: Sequence[Entry]) -> None:
    colls: list[Entry] = []
    p2p: list[P2POp] = []
    batch = -1
    last_p2p_seq: int | None = None
    open_batch: list[int] = []  # indexes into p2p of the ops since the last end marker
    for e in entries:
        p2p_like = e.is_p2p or e.p2p_src is not None or e.p2p_dst is not None or e.op in ("send", "recv")
        if e.op in COALESCED_MARKERS and open_batch and (p2p_like or e.p2p_seq == last_p2p_seq):
            # The end marker of batch_isend_irecv: NCCL records it as a non-p2p "coalesced" entry that
            # carries the batch's p2p sequence id, and only it moves to completed — its ops stay scheduled.
            finished = e.retired or e.state == "completed"
            for i in open_batch:
                p2p[i] = dataclasses.replace(p2p[i], batch_done=finished)
            open_batch, last_p2p_seq = [], None
            continue
        if p2p_like or (e.op in COALESCED_MARKERS and e.seq <= 0 < e.p2p_seq):
            # The latter: the end marker of a batch whose ops are not in the window (the ring buffer cut
            # them off): it carries the batch's p2p sequence id and no collective one — not a collective.
            if e.op in COALESCED_MARKERS:
                last_p2p_seq = None
                continue
            if e.p2p_seq != last_p2p_seq or e.p2p_seq == 0:
                batch += 1
                open_batch = []
            last_p2p_seq = e.p2p_seq
            op = _p2p_op(view, rank, e, batch)
            if op is not None:
                open_batch.append(len(p2p))
                p2p.append(op)
            continue
        last_p2p_seq = None
        open_batch = []
        colls.append(e)
    # Records without sequence ids are numbered by position; otherwise ids ≤ 0 are not collectives.
    unnumbered = bool(colls) and all(e.seq <= 0 for e in colls)
    colls = _positional(colls) if unnumbered else [e for e in colls if e.seq > 0]
    calls = build_calls(colls)
    view.calls[rank] = calls
    enq = max(calls, default=0)
    done = max((s for s, c in calls.items() if c.done), default=0)
    if not calls and not p2p and dump.backend != "gloo":
        st = dump.group_status().get(view.pg_name)
        if st is not None:
            enq = st.enqueued or 0
            done = st.completed or 0
    view.enqueued[rank] = enq
    view.completed[rank] = min(done, enq) if enq else done
    if calls:
        view.oldest_seq[rank] = min(calls)
    if p2p:
        view.p2p[rank] = p2p
    view.whole_history[rank] = bool(dump.entries) and dump.entries[0].record_id == 0 and not dump.tail_only


def _credit_joined(view: GroupView) -> None:
    """Dumps of a running job are taken a moment apart: rank 1's may show all_reduce #4434 in flight
    while rank 0's, taken later, shows #4434…#4465 completed (real: 2 × H200, live FIFO dumps). An
    all-reduce-like collective whose kernel ran to completion anywhere (a measured duration, shorter
    than its timeout: not a kernel ended by an abort) was posted by every member. A member whose dump
    ends before that collective was dumped earlier: everything it shows pending went through, and it is
    never blamed for a later collective it does not show (``waits._collective_needs``).
    Without measured durations (Gloo, NCCL without timing) nothing is credited: a library that ends a
    collective with an error also marks it completed."""
    if view.membership_source not in _KNOWN_MEMBERS or len(view.dumped) < 2:
        return
    joined = max((seq for calls in view.calls.values() for seq, c in calls.items() if _ran_whole(c)), default=0)
    view.joined = joined
    for rank in view.dumped:
        enq = view.enqueued.get(rank, 0)
        if 0 < enq < joined:
            view.completed[rank] = enq
            view.stale[rank] = enq


def _ran_whole(call: Call) -> bool:
    if not call.done or not call.ops or not all(e.op in EVERY_MEMBER_OPS for e in call.ops):
        return False
    e = call.last
    return e.duration_ms is not None and 0 <= e.duration_ms < (e.timeout_ms or 60_000)


def _positional(entries: Sequence[Entry]) -> list[Entry]:
    """Sequence ids by position, for records that carry none (``collective_seq_id`` 0 everywhere, as in
    hand-built dumps and very old formats): each op is one call, except the run of same-kind ops right
    before a coalescing end marker, which shares the marker's number."""
    out: list[Entry] = []
    seq = 0
    i = 0
    items = list(entries)
    while i < len(items):
        e = items[i]
        j = i
        while j + 1 < len(items) and items[j + 1].op == e.op and e.op not in COALESCED_MARKERS:
            j += 1
        closes = j + 1 < len(items) and items[j + 1].op in COALESCED_MARKERS
        if closes:
            seq += 1
            out += [dataclasses.replace(x, seq=seq) for x in items[i:j + 2]]
            i = j + 2
            continue
        seq += 1
        out.append(dataclasses.replace(e, seq=seq))
        i += 1
    return out


def _p2p_op(view: GroupView, rank: int, e: Entry, batch: int) -> P2POp | None:
    kind = "send" if e.op == "send" else "recv" if e.op == "recv" else ""
    if not kind:
        return None
    local_peer = e.p2p_dst if kind == "send" else e.p2p_src
    peer = view.global_rank(local_peer) if local_peer is not None else None
    if peer == rank:
        peer = None
    return P2POp(rank, peer, kind, e, batch)


def status_of(dump: RankDump, group: str) -> PgStatus | None:
    return dump.group_status().get(group)
