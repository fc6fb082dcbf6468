"""Step records from ranks, on disk within one short group-commit interval of their arrival.

The coordinator stream packs a job's records into one spool record every ``batch_interval_s`` (1 s by
default: big batches cost the coordinator less per record). Until then they used to wait in memory,
and an agent killed with SIGKILL lost them (2.5 % of a job's records over three kills). Here they
are written (SQLite, WAL) in one transaction every ``commit_s`` (50 ms): a SIGKILL loses at most
that much. Packing moves a job's rows into the spool exactly once, across a crash at any point:

1. ``begin_move(job, upto, seq)`` notes the move (the spool seq its record will get) — committed;
2. the stream appends the record to the spool;
3. ``end_move`` deletes the rows and the note in one transaction.

After a crash ``recover`` looks at a leftover note: the spool's next seq past ``seq`` means step 2
happened (delete the rows), else the rows stay and are packed again. Only the stream appends to
the spool, so the seq says it exactly.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpuhealth.model import StepRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (id INTEGER PRIMARY KEY, job TEXT NOT NULL, n INTEGER NOT NULL,
                                  payload BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS steps_job ON steps (job, id);
CREATE TABLE IF NOT EXISTS moving (job TEXT NOT NULL, upto INTEGER NOT NULL, seq INTEGER NOT NULL,
                                   incarnation TEXT NOT NULL);
"""
_FIELDS = ("rank", "step", "start_time", "wall_s", "compute_s", "comm_wait_s")


class JournalError(RuntimeError):
    """The journal file cannot be opened or written."""


@dataclass(frozen=True, slots=True)
class Taken:
    """Rows of one job, oldest first, up to ``upto`` (their last id)."""

    job_id: str
    upto: int
    records: list[StepRecord]


def journal_path_for(spool_path: str) -> str:
    """Beside the spool: ``coordinator-spool.db`` → ``coordinator-spool-steps.db``."""
    if spool_path == ":memory:":
        return ":memory:"
    p = Path(spool_path)
    return str(p.with_name(f"{p.stem}-steps{p.suffix or '.db'}"))


class StepJournal:
    """Thread-safe: ``add`` from any thread (memory, instant); ``commit`` writes what was added since
    the last one (the stream calls it every ``commit_s``)."""

    def __init__(self, path: str, *, max_records: int = 2_000_000) -> None:
        self.path = path
        self.max_records = max_records  # on disk and in memory together; the oldest go first (counted)
        self._lock = threading.Lock()
        self._db_lock = threading.Lock()
        self._buffer: list[StepRecord] = []
        self.dropped = 0
        try:
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # survives a killed process (not a power cut)
            self._db.executescript(SCHEMA)
            self._on_disk = int(self._db.execute("SELECT COALESCE(SUM(n), 0) FROM steps").fetchone()[0])
        except (sqlite3.Error, OSError) as exc:
            raise JournalError(f"{path}: cannot open the step journal: {exc}") from exc

    # -- in ------------------------------------------------------------------------------------
    def add(self, records: Iterable[StepRecord]) -> None:
        with self._lock:
            self._buffer.extend(records)
            over = len(self._buffer) + self._on_disk - self.max_records
            if over > 0:  # the coordinator has been away for very long: the oldest unsent go first
                cut = min(over, len(self._buffer))
                del self._buffer[:cut]
                self.dropped += cut

    def commit(self) -> int:
        """Write what was added since the last commit, in one transaction. Returns records written."""
        with self._lock:
            records, self._buffer = self._buffer, []
        if not records:
            return 0
        by_job: dict[str, list[StepRecord]] = defaultdict(list)
        for r in records:
            by_job[r.job_id].append(r)
        rows = [(job, len(recs), _encode(recs)) for job, recs in by_job.items()]
        with self._db_lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("INSERT INTO steps (job, n, payload) VALUES (?, ?, ?)", rows)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                with self._lock:  # keep them for the next try
                    self._buffer[:0] = records
                raise JournalError(f"{self.path}: cannot write step records: {exc}") from exc
            with self._lock:
                self._on_disk += len(records)
        return len(records)

    # -- out -----------------------------------------------------------------------------------
    def jobs(self) -> list[str]:
        with self._db_lock:
            return [str(r[0]) for r in self._db.execute("SELECT DISTINCT job FROM steps ORDER BY job")]

    def take(self, job_id: str, max_records: int = 100_000) -> Taken | None:
        """The job's oldest rows, at least one and about ``max_records`` records; None when it has none."""
        records: list[StepRecord] = []
        upto = 0
        with self._db_lock:
            cursor = self._db.execute("SELECT id, payload FROM steps WHERE job=? ORDER BY id", (job_id,))
            for row_id, payload in cursor:
                records += _decode(job_id, bytes(payload))
                upto = int(row_id)
                if len(records) >= max_records:
                    break
            cursor.close()
        return Taken(job_id, upto, records) if upto else None

    def begin_move(self, taken: Taken, seq: int, incarnation: str) -> None:
        with self._db_lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("DELETE FROM moving")
                self._db.execute("INSERT INTO moving (job, upto, seq, incarnation) VALUES (?, ?, ?, ?)",
                                 (taken.job_id, taken.upto, seq, incarnation))
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise JournalError(f"{self.path}: cannot note a move: {exc}") from exc

    def end_move(self, taken: Taken) -> None:
        """The rows are in the spool (or were dropped on purpose): forget them and the note."""
        self._finish(taken.job_id, taken.upto)

    def recover(self, spool_next_seq: int, spool_incarnation: str) -> int:
        """Finish or undo a move a crash interrupted. Returns the records it found already spooled."""
        with self._db_lock:
            row = self._db.execute("SELECT job, upto, seq, incarnation FROM moving").fetchone()
        if row is None:
            return 0
        job, upto, seq, incarnation = str(row[0]), int(row[1]), int(row[2]), str(row[3])
        if incarnation == spool_incarnation and spool_next_seq > seq:
            return self._finish(job, upto)  # the record reached the spool: its rows go
        with self._db_lock:
            self._db.execute("DELETE FROM moving")  # it did not: the rows are packed again
        return 0

    def _finish(self, job_id: str, upto: int) -> int:
        with self._db_lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                n = int(self._db.execute("SELECT COALESCE(SUM(n), 0) FROM steps WHERE job=? AND id<=?",
                                         (job_id, upto)).fetchone()[0])
                self._db.execute("DELETE FROM steps WHERE job=? AND id<=?", (job_id, upto))
                self._db.execute("DELETE FROM moving")
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise JournalError(f"{self.path}: cannot finish a move: {exc}") from exc
            with self._lock:
                self._on_disk -= n
        return n

    def pending(self) -> int:
        """Records added and not yet moved to the spool (memory and disk)."""
        with self._lock:
            return len(self._buffer) + self._on_disk

    def close(self) -> None:
        with self._db_lock:
            self._db.close()

    def _rollback(self) -> None:
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass


def _encode(records: list[StepRecord]) -> bytes:
    # NaN stays NaN (JSON's extension): the stream's encoder judges records, as it did before the journal
    return json.dumps([[getattr(r, f) for f in _FIELDS] for r in records], separators=(",", ":")).encode()


def _decode(job_id: str, payload: bytes) -> list[StepRecord]:
    out = []
    for row in json.loads(payload):
        values = dict(zip(_FIELDS, row, strict=True))
        out.append(StepRecord(job_id, int(values["rank"]), int(values["step"]), float(values["start_time"]),
                              float(values["wall_s"]), values["compute_s"], values["comm_wait_s"]))
    return out


__all__ = ["JournalError", "StepJournal", "Taken", "journal_path_for"]
