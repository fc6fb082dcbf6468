"""Who waits for whom: the wait-for graph of a hung job and its root causes (pure).

Every rank that is stuck has a *head*: its oldest pending piece of work — one collective call (a single
op or a coalesced group) or one batch of send/recv ops. Later work on that rank is queued behind the head
(NCCL runs a rank's work in order), so the head alone says why the rank does not progress. The head
waits for other ranks:

* a member that never posted that collective, or a peer that never posted the matching send/recv
  (``not_posted``) — that rank is late, stuck elsewhere, or skipped it;
* a member/peer that posted it but is held by an older head of its own (``held``);
* a rank that left no dump (``no_dump``) — whether it posted is unknown.

Nodes are ranks and the work items they wait in (rank → its head → the ranks that head needs), so a
collective of 16,384 ranks costs one node, not 16,384² edges. The roots are the graph's sinks:

* a rank that waits for nothing (no pending work) yet others wait for it — stuck on the host;
* a work item every participant posted and has as its head, that still does not complete — a GPU or
  network stall (or, when the participants disagree on its arguments, a mismatch);
* a rank that left no dump — the prime suspect, evidence incomplete;
* a cycle — ranks that each wait for the other. The rank that *never posted* what the others wait in
  (while they merely hold) is the culprit: it skipped a collective. When several ranks in the cycle
  never posted something, their own histories decide (see :mod:`gpuhealth.flightrec.history`); else it
  is a circular wait naming them.

Everything that reaches a root through the graph is a consequence of it, never a root of its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuhealth.flightrec.groups import GroupView, P2POp, group_sort_key
from gpuhealth.flightrec.history import order_break, ran_past, stream_break
from gpuhealth.flightrec.p2p import P2PPair
from gpuhealth.flightrec.report import EVIDENCE_GAP_KINDS, Blocked, RootCause, RootKind
from gpuhealth.flightrec.text import format_ranks

# Past this many candidate ranks in one cycle, histories are not read (a pipeline-wide cycle): counting decides.
MAX_HISTORY_CANDIDATES = 64
_NEVER = 1 << 62



@dataclass(frozen=True, slots=True)
class Work:
    """A pending work item: one collective call of a group, or one rank's batch of send/recv ops."""

    group: str
    seq: int | None  # collective sequence id; None for p2p
    p2p_rank: int | None = None  # p2p: the rank whose batch this is
    batch: int | None = None

    @property
    def is_p2p(self) -> bool:
        return self.seq is None


# Node ids: ("r", rank) a rank; ("u", work) a work item; ("x", rank) a rank that left no (readable) dump.
Node = tuple[str, "int | Work"]


def _int(node: Node) -> int:
    key = node[1]
    assert isinstance(key, int)
    return key


def _work(node: Node) -> Work:
    key = node[1]
    assert isinstance(key, Work)
    return key


@dataclass(frozen=True, slots=True)
class Need:
    """The work item ``work`` needs ``rank`` (``why``: not_posted | held | no_dump | any_source)."""

    work: Work
    rank: int
    why: str
    p2p: P2PPair | None = None


@dataclass(slots=True)
class WaitGraph:
    heads: dict[int, Work]  # rank -> its head (dumped ranks with pending work)
    head_order: dict[int, tuple[int, int | None]]  # rank -> (record id, created ns) of its head
    needs: dict[Work, list[Need]]
    waiters: dict[Work, list[int]]  # work item -> ranks whose head it is
    p2p_heads: dict[int, list[P2PPair]]  # rank -> the pairs of its head batch
    dumped: frozenset[int]
    unreadable: frozenset[int]
    reverse: dict[Node, list[Node]] = field(default_factory=dict)
    absent: frozenset[int] = frozenset()  # ranks of the job with no (readable) dump
    needed_from: dict[int, list[Need]] = field(default_factory=dict)  # rank -> the needs that name it

    def edges(self, node: Node) -> list[Node]:
        kind = node[0]
        if kind == "r":
            head = self.heads.get(_int(node))
            return [("u", head)] if head is not None else []
        if kind == "u":
            return [("r", n.rank) if n.rank in self.dumped else ("x", n.rank) for n in self.needs.get(_work(node), [])]
        return []


def build_graph(groups: Mapping[str, GroupView], pairs: Sequence[P2PPair], dumped: Iterable[int],
                unreadable: Iterable[int] = (), world: int = 0) -> WaitGraph:
    dumped_set = frozenset(dumped)
    heads: dict[int, Work] = {}
    order: dict[int, tuple[int, int | None]] = {}

    def offer(rank: int, work: Work, record_id: int, created: int | None) -> None:
        if rank not in order or record_id < order[rank][0]:
            heads[rank], order[rank] = work, (record_id, created)

    for g in groups.values():
        for r in g.dumped:
            if g.pending(r):
                seq = g.completed.get(r, 0) + 1
                call = g.call(r, seq)
                offer(r, Work(g.name, seq), call.record_id if call else _NEVER, call.created_ns if call else None)
    by_batch: dict[tuple[int, str, int], list[P2PPair]] = defaultdict(list)
    for p in pairs:
        by_batch[(p.op.rank, p.group, p.op.batch)].append(p)
    for (rank, gname, batch), ps in by_batch.items():
        first = min(ps, key=lambda p: p.op.entry.record_id)
        offer(rank, Work(gname, None, rank, batch), first.op.entry.record_id, first.op.entry.created_ns)
    p2p_heads = {r: by_batch[(r, w.group, w.batch)] for r, w in heads.items() if w.is_p2p and w.batch is not None}

    needs: dict[Work, list[Need]] = {}
    waiters: dict[Work, list[int]] = defaultdict(list)
    for r, w in heads.items():
        waiters[w].append(r)
    partner_at_head: list[tuple[Work, P2PPair]] = []
    for w in waiters:
        if w.is_p2p:
            needs[w] = _p2p_needs(w, p2p_heads.get(w.p2p_rank or 0, []), groups[w.group], heads, dumped_set,
                                  partner_at_head)
        else:
            needs[w] = _collective_needs(w, groups[w.group], heads, dumped_set)
    # A partner op at its rank's head is still held when that head batch itself waits for someone
    # (batch_isend_irecv: the batch completes as a whole).
    for w, p in partner_at_head:
        assert p.partner is not None
        peer_head = heads.get(p.partner.rank)
        if peer_head is not None and needs.get(peer_head):
            needs[w].append(Need(w, p.partner.rank, "held", p))
    graph = WaitGraph(heads, order, needs, dict(waiters), p2p_heads, dumped_set, frozenset(unreadable),
                      absent=frozenset(set(range(world)) - dumped_set))
    rev: dict[Node, list[Node]] = defaultdict(list)
    for r in heads:
        node: Node = ("r", r)
        for nxt in graph.edges(node):
            rev[nxt].append(node)
    for w in needs:
        node = ("u", w)
        for nxt in graph.edges(node):
            rev[nxt].append(node)
    graph.reverse = dict(rev)
    by_rank: dict[int, list[Need]] = defaultdict(list)
    for ns in needs.values():
        for n in ns:
            by_rank[n.rank].append(n)
    graph.needed_from = dict(by_rank)
    return graph


def _collective_needs(w: Work, g: GroupView, heads: Mapping[int, Work], dumped: frozenset[int]) -> list[Need]:
    assert w.seq is not None
    out = []
    for m in g.members:
        if m not in dumped:
            out.append(Need(w, m, "no_dump"))
        elif g.enqueued.get(m, 0) < w.seq:
            if m in g.stale:
                continue  # its dump predates collectives it went on to join: it shows nothing of this one
            out.append(Need(w, m, "not_posted"))
        elif g.completed.get(m, 0) >= w.seq:
            continue  # it already finished there: this side will follow
        elif heads.get(m) != w:
            out.append(Need(w, m, "held"))
    return out


def _p2p_needs(w: Work, batch: Sequence[P2PPair], g: GroupView, heads: Mapping[int, Work], dumped: frozenset[int],
               partner_at_head: list[tuple[Work, P2PPair]]) -> list[Need]:
    out: list[Need] = []
    stalled_recv = any(p.partner is None and p.op.kind == "recv" and p.op.peer is not None for p in batch)
    for p in batch:
        op = p.op
        if p.partner is None and stalled_recv and _likely_received(op, g):
            continue
        if p.partner is None:
            if op.peer is None:  # a receive from any source that nobody sends to
                out += [Need(w, s, "any_source" if s in dumped else "no_dump", p) for s in _likely_senders(g, op)]
            elif op.peer not in dumped:
                out.append(Need(w, op.peer, "no_dump", p))
            else:
                out.append(Need(w, op.peer, "not_posted", p))
            continue
        if p.partner.done:
            continue  # the other side finished: this side is not waiting for it (a stall or a mismatch of its own)
        peer = p.partner.rank
        peer_head = heads.get(peer)
        if peer_head is None or not peer_head.is_p2p or peer_head.group != g.name or peer_head.batch != p.partner.batch:
            out.append(Need(w, peer, "held", p))
        else:
            partner_at_head.append((w, p))
    return out


def _likely_received(op: P2POp, g: GroupView) -> bool:
    """A send of a batch that waits for one of its receives: NCCL never moves a batch's own ops, so the
    send reads pending though its receiver may have taken it. With the windows cut by the ring buffer only
    pending ops are paired, and it finds no partner. The receiver finished every receive from this rank
    that its window holds, and has none pending: it most likely took this one too — the batch waits for
    its receive, not for this receiver."""
    if op.kind != "send" or op.peer is None:
        return False
    if g.whole_history.get(op.rank) and g.whole_history.get(op.peer):
        return False  # whole windows pair every op: an unpaired send is really not received
    theirs = [o for o in g.p2p.get(op.peer, []) if o.kind == "recv" and o.peer == op.rank]
    return bool(theirs) and all(o.done for o in theirs)


def _likely_senders(g: GroupView, op: P2POp) -> list[int]:
    """Who a receive from any source most likely waits for: the ranks that sent to this rank before,
    else every other member."""
    before = sorted({o.rank for ops in g.p2p.values() for o in ops
                     if o.kind == "send" and o.peer == op.rank and o.rank != op.rank})
    return before or [m for m in g.members if m != op.rank]


# ------------------------------------------------------------------------------------------- roots


@dataclass(slots=True)
class Sink:
    """A strongly connected set of nodes nothing leads out of."""

    nodes: list[Node]


def sinks(graph: WaitGraph) -> list[Sink]:
    """Sink components of the graph reached from the waiting ranks (iterative Tarjan)."""
    index: dict[Node, int] = {}
    low: dict[Node, int] = {}
    comp: dict[Node, int] = {}
    on_stack: set[Node] = set()
    stack: list[Node] = []
    comps: list[list[Node]] = []
    counter = 0

    def visit(node: Node) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)

    starts: list[Node] = [("r", r) for r in sorted(graph.heads)]
    for start in starts:
        if start in index:
            continue
        visit(start)
        todo = [(start, iter(graph.edges(start)))]
        while todo:
            node, succ = todo[-1]
            descended = False
            for nxt in succ:
                if nxt not in index:
                    visit(nxt)
                    todo.append((nxt, iter(graph.edges(nxt))))
                    descended = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if descended:
                continue
            todo.pop()
            if todo:
                parent = todo[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp[x] = len(comps)
                    members.append(x)
                    if x == node:
                        break
                comps.append(members)
    return [Sink(members) for cid, members in enumerate(comps)
            if all(comp.get(nxt) == cid for n in members for nxt in graph.edges(n))]


def affected_by(graph: WaitGraph, nodes: Iterable[Node]) -> tuple[set[int], set[Work]]:
    """Ranks (and work items) that reach ``nodes``: everyone held up by them."""
    seen: set[Node] = set(nodes)
    todo = list(seen)
    while todo:
        n = todo.pop()
        for prev in graph.reverse.get(n, ()):
            if prev not in seen:
                seen.add(prev)
                todo.append(prev)
    return {_int(n) for n in seen if n[0] == "r"}, {_work(n) for n in seen if n[0] == "u"}


def find_hang_roots(groups: Mapping[str, GroupView], graph: WaitGraph) -> list[RootCause]:
    """Root causes of what the graph shows stuck (mismatch and stall roots carry ``kind`` GPU_STALL here;
    the caller turns a stall whose participants disagree into a MISMATCH)."""
    found: list[tuple[RootCause, list[Node]]] = []
    merged: dict[tuple[RootKind, str | None, int | None], int] = {}
    p2p_stalls: set[tuple[int, ...]] = set()
    for sink in sinks(graph):
        root = _root_of(groups, graph, sink)
        if root is None:
            continue
        if root.kind is RootKind.GPU_STALL and root.op in ("send", "recv"):
            # Both sides of a stuck send/recv pair are sinks of their own: one root for the pair.
            if root.waiting_ranks in p2p_stalls:
                continue
            p2p_stalls.add(root.waiting_ranks)
        same = next((i for i, (r, _) in enumerate(found) if r.kind in EVIDENCE_GAP_KINDS
                     and root.kind in EVIDENCE_GAP_KINDS and r.ranks == root.ranks), None)
        if same is not None:
            # The same missing dump seen from another stuck group: one root, the group a consequence.
            into, nodes = found[same]
            into.consequences = tuple(sorted({*into.consequences, *(g for g in (root.group,) if g)} - {into.group},
                                             key=group_sort_key))
            nodes += sink.nodes
            continue
        if root.kind in _MERGEABLE:
            # Several ranks missing from the same op (a pipeline's downstream stages on Gloo, dumps lost
            # from a whole node): one root naming them all.
            key = (root.kind, root.group, root.seq)
            if key in merged:
                into, nodes = found[merged[key]]
                _merge(into, root)
                nodes += sink.nodes
                continue
            merged[key] = len(found)
        found.append((root, list(sink.nodes)))
    roots = []
    for root, nodes in found:
        ranks, works = affected_by(graph, nodes)
        root.affected_ranks = tuple(sorted(ranks - set(root.ranks)))
        root.consequences = tuple(sorted({w.group for w in works} - {root.group}, key=group_sort_key))
        roots.append(root)
    return roots


_MERGEABLE = frozenset({RootKind.HOST_STUCK, RootKind.P2P_UNMATCHED, RootKind.DUMP_MISSING,
                        RootKind.DUMP_UNREADABLE})


def _merge(into: RootCause, other: RootCause) -> None:
    into.ranks = tuple(sorted({*into.ranks, *other.ranks}))
    into.waiting_ranks = tuple(sorted(set(into.waiting_ranks) - set(into.ranks)))
    into.why = _why_missing(into.kind, into.ranks, into.what, into.waiting_ranks)


def _why_missing(kind: RootKind, ranks: Sequence[int], what: str, waiting: Sequence[int]) -> str:
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
    if kind in (RootKind.DUMP_MISSING, RootKind.DUMP_UNREADABLE):
        left = "left a dump that could not be read" if kind is RootKind.DUMP_UNREADABLE else "left no dump"
        return (f"rank(s) {format_ranks(waiting)} wait in {what}; {who} {left}, so whether "
                f"{'it' if len(ranks) == 1 else 'they'} reached it is unknown: the prime suspect(s) (crashed, "
                "killed, or stuck before dumping)")
    itself = "it is not waiting in any collective itself" if len(ranks) == 1 else \
        "none of them is waiting in any collective itself"
    return (f"{who} never posted {what}, and {itself}: stuck on the host (Python code, data loading, a sleep, a "
            "deadlock outside torch.distributed) or took another code path")


def _root_of(groups: Mapping[str, GroupView], graph: WaitGraph, sink: Sink) -> RootCause | None:
    rank_nodes = sorted(_int(n) for n in sink.nodes if n[0] == "r")
    work_nodes = [_work(n) for n in sink.nodes if n[0] == "u"]
    missing = [_int(n) for n in sink.nodes if n[0] == "x"]
    if missing:
        return _missing_dump_root(groups, graph, missing[0])
    if len(sink.nodes) == 1 and rank_nodes:
        return _free_rank_root(groups, graph, rank_nodes[0])
    if len(sink.nodes) == 1 and work_nodes:
        w, g = work_nodes[0], groups[work_nodes[0].group]
        if w.seq is not None and any(g.enqueued.get(m, 0) < w.seq for m in g.stale):
            return None  # a member's dump predates this collective: whether it joined is unknown, not a stall
        return _stall_root(groups, graph, w)
    return _cycle_root(groups, graph, rank_nodes, work_nodes)


def _direct_needs(graph: WaitGraph, rank: int, kinds: tuple[str, ...]) -> list[Need]:
    return [n for n in graph.needed_from.get(rank, []) if n.why in kinds]


def _primary(graph: WaitGraph, needs: Sequence[Need]) -> Need:
    """The work item that waits for this rank alone (the others missing there are themselves held up by it),
    then the one the others started waiting in first: the one this rank was due to run next."""
    def key(n: Need) -> tuple[int, int, tuple[int, int | str]]:
        others = {x.rank for x in graph.needs.get(n.work, []) if x.why != "held" and x.rank != n.rank}
        ws = graph.waiters.get(n.work, [])
        times = [graph.head_order[r][1] or _NEVER for r in ws] or [_NEVER]
        return (len(others), min(times), group_sort_key(n.work.group))
    return min(needs, key=key)


def describe_work(groups: Mapping[str, GroupView], w: Work, p: P2PPair | None = None) -> tuple[str, str | None]:
    """(human description, op name) of a work item."""
    g = groups[w.group]
    if w.is_p2p:
        if p is None:
            return f"send/recv ops in group {w.group}", None
        op = p.op
        arrow = (f"send {op.rank}→{op.peer}" if op.kind == "send"
                 else f"recv {op.rank}←{op.peer if op.peer is not None else 'any source'}")
        return f"{op.entry.profiling_name.split(' ')[0]} ({arrow}, p2p #{op.entry.p2p_seq}) in group {w.group}", \
            op.entry.op
    assert w.seq is not None
    calls = [c for r in g.dumped if (c := g.call(r, w.seq)) is not None]
    name = calls[0].name if calls else None
    desc = f" ({g.desc})" if g.desc and g.desc not in ("undefined", "default_pg") else ""
    return f"{name or 'collective'} #{w.seq} in group {w.group}{desc}", name


def _free_rank_root(groups: Mapping[str, GroupView], graph: WaitGraph, rank: int) -> RootCause | None:
    needs = _direct_needs(graph, rank, ("not_posted", "any_source"))
    if not needs:
        return None
    first = _primary(graph, needs)
    _, op = describe_work(groups, first.work, first.p2p)
    blocks = _blocks(groups, graph, rank, needs, first)
    listed = "; ".join(f"{b.what} (rank(s) {format_ranks(b.waiting_ranks)} wait)" for b in blocks[:4])
    if len(blocks) > 4:
        listed += f"; and {len(blocks) - 4} more"
    kind = RootKind.P2P_UNMATCHED if first.p2p is not None else RootKind.HOST_STUCK
    seq = first.work.seq if not first.work.is_p2p else (first.p2p.op.entry.p2p_seq if first.p2p else None)
    return RootCause(kind, (rank,), _why_missing(kind, (rank,), listed, ()), group=first.work.group, seq=seq,
                     op=op, waiting_ranks=tuple(_waiting_on(graph, first.work, rank)),
                     created_ns=_created(graph, first.work), what=listed, blocks=blocks)


def _blocks(groups: Mapping[str, GroupView], graph: WaitGraph, rank: int, needs: Sequence[Need], first: Need
            ) -> tuple[Blocked, ...]:
    """What ``rank`` holds up directly: each work item waiting for it, the primary one first."""
    out: list[Blocked] = []
    seen: set[Work] = set()
    for n in [first, *needs]:
        if n.work in seen:
            continue
        seen.add(n.work)
        if n.p2p is not None:
            want = "recv" if n.p2p.op.kind == "send" else "send"
            peer = n.p2p.op.rank
            text = (f"the {want} {'from' if want == 'recv' else 'to'} rank {peer} that matches "
                    f"{describe_work(groups, n.work, n.p2p)[0]}")
        else:
            text = describe_work(groups, n.work)[0]
        out.append(Blocked(text, n.work.group, n.work.seq, tuple(_waiting_on(graph, n.work, rank))))
    return tuple(out)


def _waiting_on(graph: WaitGraph, w: Work, rank: int) -> list[int]:
    return sorted(set(graph.waiters.get(w, [])) - {rank})


def _created(graph: WaitGraph, w: Work) -> int | None:
    times = [t for r in graph.waiters.get(w, []) if (t := graph.head_order[r][1])]
    return min(times) if times else None


def _missing_dump_root(groups: Mapping[str, GroupView], graph: WaitGraph, rank: int) -> RootCause | None:
    needs = _direct_needs(graph, rank, ("no_dump",))
    if not needs:
        return None
    first = _primary(graph, needs)
    what, op = describe_work(groups, first.work, first.p2p)
    waiting = tuple(_waiting_on(graph, first.work, rank))
    kind = RootKind.DUMP_UNREADABLE if rank in graph.unreadable else RootKind.DUMP_MISSING
    return RootCause(kind, (rank,), _why_missing(kind, (rank,), what, waiting), group=first.work.group,
                     seq=first.work.seq, op=op, waiting_ranks=waiting, created_ns=_created(graph, first.work),
                     what=what)


def _stall_root(groups: Mapping[str, GroupView], graph: WaitGraph, w: Work) -> RootCause:
    g = groups[w.group]
    ranks = sorted(graph.waiters.get(w, []))
    if w.is_p2p:
        pairs = graph.p2p_heads.get(w.p2p_rank or 0, [])
        p = next((x for x in pairs if x.partner is not None), pairs[0] if pairs else None)
        what, op = describe_work(groups, w, p)
        both = sorted({*ranks, *(x.partner.rank for x in pairs if x.partner is not None)})
        states = {x.op.rank: x.op.entry.state for x in pairs} | {
            x.partner.rank: x.partner.entry.state for x in pairs if x.partner is not None}
        suspects = _unstarted(states)
        why = (f"rank(s) {format_ranks(both)} both posted {what} and it does not complete: the GPU or network "
               "side is stuck")
        if suspects:
            why += f"; rank(s) {format_ranks(suspects)} never even started it (their GPU is busy or hung)"
        return RootCause(RootKind.GPU_STALL, tuple(suspects or both), why, group=w.group,
                         seq=p.op.entry.p2p_seq if p else None, op=op, waiting_ranks=tuple(both),
                         created_ns=_created(graph, w), what=what, decided_by="started" if suspects else None)
    assert w.seq is not None
    what, op = describe_work(groups, w)
    not_done = sorted(r for r in g.dumped if g.completed.get(r, 0) < w.seq)
    finished = sorted(r for r in g.dumped if g.completed.get(r, 0) >= w.seq)
    states = {r: c.state for r in not_done if (c := g.call(r, w.seq)) is not None}
    suspects = _unstarted(states)
    absent = sorted(graph.absent)
    if not suspects and not finished and absent and g.membership_source in ("entries", "siblings") \
            and len(absent) <= max(8, len(g.members)):
        # Gloo does not record who is in a subgroup: "every member posted" only means every rank that
        # dumped. A rank with no dump that belongs to it is the likeliest reason nothing completes.
        unread = [r for r in absent if r in graph.unreadable]
        kind = RootKind.DUMP_UNREADABLE if unread and len(unread) == len(absent) else RootKind.DUMP_MISSING
        left = "left a dump that could not be read" if kind is RootKind.DUMP_UNREADABLE else "left no (readable) dump"
        why = (f"every rank that dumped and is in group {w.group} ({format_ranks(not_done)}) posted {what} and none "
               f"completed it; the dumps do not record the group's members (Gloo), and rank(s) {format_ranks(absent)} "
               f"{left}: most likely members that never came (crashed, killed, or stuck before dumping)")
        return RootCause(kind, tuple(absent), why, group=w.group, seq=w.seq, op=op, waiting_ranks=tuple(not_done),
                         created_ns=_created(graph, w), what=what, decided_by="membership")
    if suspects:
        why = (f"every member enqueued {what} but rank(s) {format_ranks(not_done)} did not complete it; rank(s) "
               f"{format_ranks(suspects)} never even started it (their GPU is busy or hung)")
        decided = "started"
    elif finished:
        why = (f"rank(s) {format_ranks(not_done)} did not complete {what}, which rank(s) {format_ranks(finished)} "
               "completed: a peer failed in the middle of it (the library ended it with an error there), or the "
               "dumps were taken a moment apart")
        decided = "completed_elsewhere"
    else:
        why = (f"every member enqueued {what} and none of rank(s) {format_ranks(not_done)} completed it: the GPU or "
               "network side is stuck")
        decided = None
    return RootCause(RootKind.GPU_STALL, tuple(suspects or not_done), why, group=w.group, seq=w.seq, op=op,
                     waiting_ranks=tuple(not_done), created_ns=_created(graph, w), what=what, decided_by=decided)


def unmatched_behind(groups: Mapping[str, GroupView], pairs: Sequence[P2PPair], stall: RootCause,
                     dumped: Iterable[int]) -> RootCause | None:
    """Behind a send/recv pair both sides posted (a stall nothing shows has lasted, ``verdict._untimed_stall``):
    the oldest later send or recv of the stalled ranks that no peer's op matches. Once the pair goes through,
    that op blocks for good — the peer that never posted its side is the culprit."""
    if stall.group is None or stall.op not in ("send", "recv"):
        return None
    have = set(dumped)
    ranks = set(stall.waiting_ranks) | set(stall.ranks)
    lonely = [p for p in pairs if p.group == stall.group and p.op.rank in ranks and p.partner is None
              and p.op.peer is not None and p.op.peer in have]
    if not lonely:
        return None
    p = min(lonely, key=lambda x: x.op.entry.record_id)
    peer = p.op.peer
    assert peer is not None
    w = Work(p.group, None, p.op.rank, p.op.batch)
    want = "recv" if p.op.kind == "send" else "send"
    what, op = describe_work(groups, w, p)
    listed = f"the {want} {'from' if want == 'recv' else 'to'} rank {p.op.rank} that matches {what}"
    return RootCause(RootKind.P2P_UNMATCHED, (peer,), _why_missing(RootKind.P2P_UNMATCHED, (peer,), listed, ()),
                     group=p.group, seq=p.op.entry.p2p_seq, op=op, waiting_ranks=(p.op.rank,),
                     created_ns=p.op.entry.created_ns, what=listed,
                     blocks=(Blocked(listed, p.group, None, (p.op.rank,)),))


def _unstarted(states: Mapping[int, str]) -> list[int]:
    """Ranks that never started an op others started (NCCL records "started"; Gloo never does)."""
    if "started" not in states.values():
        return []
    return sorted(r for r, s in states.items() if s == "scheduled")


def _cycle_root(groups: Mapping[str, GroupView], graph: WaitGraph, ranks: list[int], works: list[Work]) -> RootCause:
    inside = set(ranks)
    # Who never posted something another member of the cycle waits in (the others merely hold).
    blamed: dict[int, list[Need]] = defaultdict(list)
    needed: dict[int, list[Need]] = defaultdict(list)
    for w in works:
        for n in graph.needs.get(w, []):
            if n.rank in inside:
                needed[n.rank].append(n)
                if n.why in ("not_posted", "any_source"):
                    blamed[n.rank].append(n)
    candidates = sorted(blamed)
    # First, the rank whose own history shows it went past an op the others need from it — whether it never
    # posted it, or (NCCL: a rank that skips one posts the next step's under the same sequence id) it posted
    # a misaligned one the others only see as "held".
    breaks: dict[int, tuple[Need, str]] = {}
    if len(needed) <= MAX_HISTORY_CANDIDATES:
        for rank in sorted(needed):
            for n in sorted(needed[rank], key=lambda x: (_created(graph, x.work) or _NEVER)):
                how = _break(rank, n, groups)
                if how:
                    breaks[rank] = (n, how)
                    break
    if len(breaks) == 1:
        (rank, (need, how)), = breaks.items()
        root = _skipped(groups, graph, rank, blamed.get(rank) or needed[rank], need, how)
        root.decided_by = "order"
        return root
    misaligned = _misaligned(groups, graph, needed, blamed)
    if misaligned is not None:
        return misaligned
    if len(candidates) == 1:
        rank = candidates[0]
        return _skipped(groups, graph, rank, blamed[rank], None,
                        "the others in this wait only hold because of it")
    history: dict[int, tuple[Need, tuple[str, int, int, int]]] = {}
    if 1 < len(candidates) <= MAX_HISTORY_CANDIDATES:
        for rank in candidates:
            for n in sorted(blamed[rank], key=lambda x: (_created(graph, x.work) or _NEVER)):
                if n.work.seq is not None and (hit := ran_past(rank, n.work.group, n.work.seq, groups)) is not None:
                    history[rank] = (n, hit)
                    break
    if len(history) == 1:
        (rank, (need, hit)), = history.items()
        hname, hseq, ran, period = hit
        what, _ = describe_work(groups, need.work)
        how = (f"after #{need.work.seq - 1 if need.work.seq else '?'} of group {need.work.group} it ran {ran} "
               f"collective(s) of group {hname} (up to #{hseq}), where its own earlier steps ran {period} at that "
               "point")
        return _skipped(groups, graph, rank, blamed[rank], need, how)
    votes = _peer_votes(groups, blamed) if 1 < len(candidates) <= MAX_HISTORY_CANDIDATES else {}
    leader = _sole_leader(votes)
    if leader is not None:
        rank, (need, score, other) = leader
        how = (f"it went on to {other} while {score} rank(s) of group {need.work.group} that share that op posted "
               f"#{need.work.seq} first and have not reached it: their programs run #{need.work.seq} before it")
        root = _skipped(groups, graph, rank, blamed[rank], need, how)
        root.decided_by = "peers"
        return root
    ahead = [r for r in candidates if _ahead_in(groups, graph, r)]
    if len(ahead) == 1:
        rank = ahead[0]
        mirror = [r for r in candidates if r != rank]
        root = _skipped(groups, graph, rank, blamed[rank], None, "it went on to work that no other member has reached")
        if mirror:
            root.ranks = tuple(sorted({rank, *mirror}))
            root.decided_by = "undecided"
            root.why += (f" — or rank(s) {format_ranks(mirror)} skipped one of theirs: the flight recorder holds too "
                         "little repeating history to tell which")
        return root
    names = candidates or ranks
    first = min(works, key=lambda w: (_created(graph, w) or _NEVER, group_sort_key(w.group)))
    what, op = describe_work(groups, first)
    why = (f"circular wait between rank(s) {format_ranks(names)}: each waits in work the other has not reached "
           f"(the oldest is {what}) — collectives issued in different orders on different ranks, or a skip the "
           "flight recorder holds too little history to pin down")
    return RootCause(RootKind.CIRCULAR, tuple(names), why, group=first.group, seq=first.seq, op=op,
                     waiting_ranks=tuple(ranks), decided_by="undecided", created_ns=_created(graph, first))


def _misaligned(groups: Mapping[str, GroupView], graph: WaitGraph, needed: Mapping[int, Sequence[Need]],
                blamed: Mapping[int, Sequence[Need]]) -> RootCause | None:
    """NCCL numbers a collective by how many the rank has posted: a rank that skipped g#s posts its next
    one of g as #s, after the ops of the next step. The others see it "holding" #s, and the rank it then
    waits on (a pipeline peer stuck in #s) looks like the one that never posted. Its own history may be
    too short to show it (``order_break`` needs two closed gaps), but its peers vote: members of g and of
    the group of an op this rank ran before its #s that posted #s and have not reached that op. Only
    that group's own members: a sibling group in another pipeline stage runs at another point of the
    step. The held rank wins only with at least two votes (a pair's other member cannot outvote it) and
    more than any rank blamed for not posting."""
    held = {r: [n for n in ns if n.why == "held" and n.work.seq is not None]
            for r, ns in needed.items() if r not in blamed}
    held = {r: ns for r, ns in held.items() if ns}
    if not held or len(held) + len(blamed) > MAX_HISTORY_CANDIDATES:
        return None
    leader = _sole_leader(_peer_votes(groups, held, siblings=False))
    if leader is None:
        return None
    rank, (need, score, other) = leader
    rivals = max((v[1] for v in _peer_votes(groups, blamed).values()), default=0) if blamed else 0
    if score < 2 or score <= rivals:
        return None
    how = (f"its #{need.work.seq} of group {need.work.group} was posted only after {other}, which {score} rank(s) "
           f"that posted #{need.work.seq} have not reached: NCCL numbered its next one #{need.work.seq}")
    root = _skipped(groups, graph, rank, held[rank], need, how)
    root.decided_by = "peers"
    return root


def _sole_leader(votes: Mapping[int, tuple[Need, int, str]]) -> tuple[int, tuple[Need, int, str]] | None:
    """The one rank with the most votes, or None (no votes, or a tie at the top)."""
    if not votes:
        return None
    top = max(v[1] for v in votes.values())
    leaders = [r for r, v in votes.items() if v[1] == top]
    return (leaders[0], votes[leaders[0]]) if len(leaders) == 1 else None


def _peer_votes(groups: Mapping[str, GroupView], blamed: Mapping[int, Sequence[Need]], *, siblings: bool = True
                ) -> dict[int, tuple[Need, int, str]]:
    """For each candidate that never posted collective (g, s): how many ranks of g that did post it — and are
    in the group of an op the candidate ran instead (since its g#(s-1)) — have not reached that op. Each such
    rank's program runs (g, s) first: the candidate went past it. Too little history for the rank's own
    pattern, the job's other ranks still vote. {rank: (need, votes, the op it went on to)}."""
    out: dict[int, tuple[Need, int, str]] = {}
    family = _sibling_families(groups) if siblings else {}
    for rank, needs in blamed.items():
        best: tuple[Need, int, str] | None = None
        for n in needs:
            w = n.work
            if w.seq is None:
                continue
            g = groups[w.group]
            prev = g.call(rank, w.seq - 1)
            if prev is None:
                continue
            since = [(name, c) for name, h in groups.items() if name != w.group
                     for c in h.calls.get(rank, {}).values() if c.record_id > prev.record_id]
            for name, c in since:
                # Voters in g and the group of the op it went on to — and, the program being the same on every
                # rank, in their sibling groups (every TP group runs its #3 at the same point): in a TP pair the
                # only other member cannot outvote the candidate, the other pairs can.
                voters = {r for g2 in family.get(w.group, (w.group,)) for h2 in family.get(name, (name,))
                          for r in _voters(groups[g2], groups[h2], rank, w.seq, c.seq)}
                if voters and (best is None or len(voters) > best[1]):
                    best = (n, len(voters), f"{c.name} #{c.seq} of group {name}")
        if best is not None:
            out[rank] = best
    return out


def _voters(g: GroupView, h: GroupView, rank: int, seq: int, went_on_to: int) -> set[int]:
    """Ranks of both groups other than ``rank`` that posted g#seq and have not reached h#went_on_to."""
    return {r for r in g.dumped if r != rank and g.enqueued.get(r, 0) >= seq and r in h.members
            and h.enqueued.get(r, 0) < went_on_to}


def _sibling_families(groups: Mapping[str, GroupView]) -> dict[str, tuple[str, ...]]:
    """group -> it and the groups that run the same program beside it: the same size and description,
    disjoint members (all TP groups, all DP groups of a grid). Gloo's come from the ranks with entries."""
    trusted = [g for g in groups.values() if g.membership_source != "world" and len(g.members) > 1]
    out: dict[str, tuple[str, ...]] = {}
    for g in trusted:
        mine = set(g.members)
        same = [h.name for h in trusted if h is not g and len(h.members) == len(g.members) and h.desc == g.desc
                and mine.isdisjoint(h.members)]
        out[g.name] = (g.name, *same)
    return out


def _break(rank: int, n: Need, groups: Mapping[str, GroupView]) -> str:
    """Why ``rank``'s own history says it went past the op ``n`` needs from it ("" when it does not)."""
    if n.work.seq is not None:
        hit = order_break(rank, n.work.group, groups)
        if hit is not None:
            other, last, ran, longest = hit
            return (f"since its last collective of group {n.work.group} it ran {ran} of group {other} (up to #{last}), "
                    f"more than it ever ran between two of group {n.work.group} before ({longest})")
        key: tuple[str, ...] = ("c", n.work.group)
        what = f"collective of group {n.work.group}"
    elif n.p2p is not None:
        kind = "recv" if n.p2p.op.kind == "send" else "send"
        key = ("p", kind, str(n.p2p.op.rank))
        what = f"{kind} {'to' if kind == 'send' else 'from'} rank {n.p2p.op.rank}"
    else:
        return ""
    seen = stream_break(rank, key, groups)
    if seen is None:
        return ""
    since, longest = seen
    return (f"since its last {what} it posted {since} other op(s), more than it ever did between two of them "
            f"({longest}): its step went on without it")


def _skipped(groups: Mapping[str, GroupView], graph: WaitGraph, rank: int, needs: Sequence[Need], need: Need | None,
             how: str) -> RootCause:
    first = need or _primary(graph, needs)
    what, op = describe_work(groups, first.work, first.p2p)
    waiting = _waiting_on(graph, first.work, rank)
    head = graph.heads.get(rank)
    head_pairs = graph.p2p_heads.get(rank) or []
    went = describe_work(groups, head, head_pairs[0] if head_pairs else None)[0] if head else "other work"
    verb = "posted the matching op for" if first.work.is_p2p else "enqueued"
    skipped = "the matching send/recv" if first.work.is_p2p else "a collective"
    why = (f"rank {rank} never {verb} {what} (rank(s) {format_ranks(waiting)} wait in it) but went on to {went}: "
           f"it skipped {skipped} (a code path that differs on this rank); {how}")
    kind = RootKind.P2P_UNMATCHED if first.work.is_p2p else RootKind.SKIPPED
    seq = first.work.seq if not first.work.is_p2p else (first.p2p.op.entry.p2p_seq if first.p2p else None)
    blocks = _blocks(groups, graph, rank, needs, first)
    return RootCause(kind, (rank,), why, group=first.work.group, seq=seq, op=op, waiting_ranks=tuple(waiting),
                     decided_by="history" if need is not None else "wait_graph", created_ns=_created(graph, first.work),
                     what=blocks[0].what if blocks else what, blocks=blocks)


def _ahead_in(groups: Mapping[str, GroupView], graph: WaitGraph, rank: int) -> bool:
    head = graph.heads.get(rank)
    if head is None or head.is_p2p:
        return False
    g = groups[head.group]
    others = [g.enqueued.get(r, 0) for r in g.dumped if r != rank]
    return bool(others) and g.enqueued.get(rank, 0) > max(others)
