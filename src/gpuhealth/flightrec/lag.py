"""Groups where nobody waits any more, yet a rank is behind (pure).

After a process-group timeout Gloo marks the failed collective completed on the ranks that waited, so a
dump taken late shows nobody pending: only that one rank never enqueued a collective the others ran.
When the ranks ahead issued nothing for longer than the collective's timeout before their dump, that is
a timed-out hang (``timed_out``); otherwise it is most likely dumps taken a moment apart in a running
job (``behind``, information only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpuhealth.flightrec.groups import GroupView
from gpuhealth.flightrec.load import RankDump


@dataclass(frozen=True, slots=True)
class Laggard:
    group: str
    seq: int
    rank: int
    ahead: tuple[int, ...]
    timed_out: bool
    idle_s: float | None
    timeout_s: float | None
    created_ns: int | None


def find_laggards(view: GroupView, idle_s: Mapping[int, float]) -> list[Laggard]:
    if any(view.pending(r) for r in view.dumped) or len(view.dumped) < 2:
        return []
    top = max(view.enqueued.get(r, 0) for r in view.dumped)
    out = []
    for rank in (r for r in view.dumped if view.enqueued.get(r, 0) < top):
        seq = view.enqueued.get(rank, 0) + 1
        ahead = tuple(sorted(r for r in view.dumped if view.enqueued.get(r, 0) >= seq))
        heads = [e for r in ahead if (e := view.entry(r, seq)) is not None]
        timeouts = [e.timeout_ms for e in heads if e.timeout_ms]
        timeout_s = min(timeouts) / 1000.0 if timeouts else None
        idles = [idle_s[r] for r in ahead if r in idle_s]
        idle = min(idles) if idles else None
        # A rank proven to have posted this collective (``view.joined``: a kernel of a later one ran whole)
        # was only dumped earlier, however old the dumps look (a copied file's mtime is when it was copied).
        timed_out = (timeout_s is not None and idle is not None and len(idles) * 2 >= len(ahead)
                     and idle >= timeout_s and seq > view.joined)
        created = min((e.created_ns for e in heads if e.created_ns), default=None)
        out.append(Laggard(view.name, seq, rank, ahead, timed_out, idle, timeout_s, created))
    return out


def idle_seconds(dumps: Mapping[int, RankDump]) -> dict[int, float]:
    """Per rank: seconds between its newest entry and its dump (when the dump time is known)."""
    out = {}
    for rank, d in dumps.items():
        newest = max((e.created_ns for e in d.entries if e.created_ns), default=None)
        if newest and d.dump_time_ns:
            out[rank] = max(0.0, (d.dump_time_ns - newest) / 1e9)
    return out
