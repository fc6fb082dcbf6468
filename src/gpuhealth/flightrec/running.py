"""Were the dumps taken from a job that was still running? (pure)

The agent dumps a running job's ranks through their FIFOs for straggler scoring, and an operator may
dump a job that only looks stuck. Each rank writes its dump when its own process gets to it, so one
rank's may end before a collective that another, dumped a moment later, already waits in: read as a
hang, that blames the rank dumped first. A hang is a wait that lasted: when every op still pending in
the dumps was younger, at its own rank's dump, than the job's ordinary pauses between ops (and than
one second), nothing has been waiting long enough to call it a hang.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from gpuhealth.flightrec.load import RankDump

FLOOR_S = 1.0  # a wait shorter than this is never called a hang (FIFO dumps of one job land up to ~1 s apart)
QUIET_FACTOR = 2.0  # ... nor one shorter than this many times the job's usual longest pause
_QUIET_PERCENTILE = 99  # the usual longest pause: not the rare checkpoint or first-dump stall


@dataclass(frozen=True, slots=True)
class StillRunning:
    oldest_pending_s: float  # the oldest pending op's age at its own rank's dump
    limit_s: float  # waits shorter than this are ordinary in this job

    def note(self) -> str:
        return (f"the dumps were taken while the job ran: the oldest op still pending was "
                f"{1000 * self.oldest_pending_s:.0f} ms old when its rank dumped (ordinary pauses here reach "
                f"{1000 * self.limit_s:.0f} ms), so no wait has lasted long enough to call a hang")


def still_running(dumps: Mapping[int, RankDump]) -> StillRunning | None:
    """``StillRunning`` when every dump's time is known, some op is pending, and every pending op was
    younger at its rank's dump than ``max(FLOOR_S, QUIET_FACTOR × the job's usual longest pause)``;
    else None (a hang may be read from the dumps)."""
    if len(dumps) < 2 or any(not d.dump_time_ns for d in dumps.values()):
        return None
    oldest = 0.0
    gaps: list[np.ndarray] = []
    for d in dumps.values():
        created = np.array([e.created_ns for e in d.entries if e.created_ns], dtype=np.int64)
        if created.size > 1:
            gaps.append(np.diff(np.sort(created)))
        pending = [e.created_ns for e in d.entries
                   if e.created_ns and not e.retired and e.state != "completed"]
        if pending:
            assert d.dump_time_ns is not None
            oldest = max(oldest, (d.dump_time_ns - min(pending)) / 1e9)
    if oldest <= 0.0:
        return None
    quiet = float(np.percentile(np.concatenate(gaps), _QUIET_PERCENTILE)) / 1e9 if gaps else 0.0
    limit = max(FLOOR_S, QUIET_FACTOR * quiet)
    return StillRunning(oldest, limit) if oldest < limit else None
