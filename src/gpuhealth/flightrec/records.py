"""The normalized records a flight-recorder dump is read into (re-exported by :mod:`gpuhealth.flightrec.load`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Frame:
    name: str
    filename: str
    line: int

    def __str__(self) -> str:
        return f"{self.name} at {self.filename}:{self.line}"


@dataclass(slots=True)
class Entry:
    """One flight-recorder entry, normalized. Times are ns since the epoch or None (never 0)."""

    record_id: int
    pg_id: int  # the process-local ProcessGroup uid (NOT the same on every rank)
    group: str  # the process-group name: the same on every rank, the key to match on
    group_desc: str
    seq: int  # collective_seq_id
    p2p_seq: int
    op_id: int
    op: str  # "all_reduce", "_all_gather_base", "send", …
    backend: str  # "nccl", "gloo", "" (from the profiling name)
    in_sizes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[str, ...]
    out_sizes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[str, ...]
    state: str  # scheduled | started | completed (Gloo: always scheduled)
    retired: bool
    is_p2p: bool
    created_ns: int | None = None
    started_ns: int | None = None
    completed_ns: int | None = None
    duration_ms: float | None = None
    timeout_ms: int | None = None
    frames: tuple[Frame, ...] = ()
    p2p_src: int | None = None  # group-local ranks of a send/recv ("send 1->2", "recv 2<-1")
    p2p_dst: int | None = None

    @property
    def profiling_name(self) -> str:
        return f"{self.backend}:{self.op}" if self.backend else self.op


@dataclass(frozen=True, slots=True)
class PgStatus:
    enqueued: int | None
    started: int | None
    completed: int | None


@dataclass(frozen=True, slots=True)
class GroupConfig:
    name: str
    desc: str
    ranks: tuple[int, ...] | None  # None when the dump does not say (Gloo records "[]")
