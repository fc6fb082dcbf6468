"""A disk-backed, bounded outbox of records for the coordinator (SQLite, WAL).

Each record gets the next sequence number of this spool's *incarnation* (a random id created
with the file) and stays on disk until the coordinator acknowledges it, so neither an agent
restart nor a coordinator outage loses it. When the spool is full the oldest records are dropped
(counted, never silently): step records first, because findings are snapshots and only the newest
one matters — an older findings snapshot is dropped as soon as a newer one is spooled.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY, kind TEXT NOT NULL, created_at REAL NOT NULL, payload BLOB NOT NULL
);
"""
PayloadBuilder = Callable[[int], bytes]  # seq → the record's bytes (the record embeds its seq)
SUPERSEDING_KINDS = frozenset({"findings"})  # a newer record of these kinds replaces older ones


class SpoolError(RuntimeError):
    """The spool file cannot be opened or written."""


@dataclass(frozen=True, slots=True)
class SpoolStats:
    depth: int
    bytes: int
    dropped: int
    next_seq: int
    acked: int


class Spool:
    """Thread-safe. ``append`` with a payload builder that receives the seq (the payload embeds it)."""

    def __init__(self, path: str | Path, *, max_records: int = 200_000, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.path = str(path)
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self.incarnation = self._meta("incarnation") or self._init_meta()
            self._next_seq = int(self._meta("next_seq") or 1)
            self._acked = int(self._meta("acked") or 0)
            self._dropped = int(self._meta("dropped") or 0)
            row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM outbox").fetchone()
        except (sqlite3.Error, OSError) as exc:
            raise SpoolError(f"{self.path}: cannot open the coordinator spool: {exc}") from exc
        self._depth, self._bytes = int(row[0]), int(row[1])

    def _meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set_meta(self, key: str, value: object) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, str(value)))

    def _init_meta(self) -> str:
        incarnation = secrets.token_hex(8)
        self._set_meta("incarnation", incarnation)
        return incarnation

    # -- writing ---------------------------------------------------------------------------------

    def append(self, kind: str, created_at: float, build: PayloadBuilder) -> int:
        """Store one record; ``build(seq)`` returns its bytes. Returns the seq."""
        with self._lock:
            seq = self._next_seq
            payload = build(seq)
            try:
                self._db.execute("BEGIN IMMEDIATE")
                if kind in SUPERSEDING_KINDS:
                    row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM outbox"
                                           " WHERE kind=?", (kind,)).fetchone()
                    self._db.execute("DELETE FROM outbox WHERE kind=?", (kind,))
                    self._depth -= int(row[0])
                    self._bytes -= int(row[1])
                self._db.execute("INSERT INTO outbox (seq, kind, created_at, payload) VALUES (?,?,?,?)",
                                 (seq, kind, created_at, payload))
                self._depth += 1
                self._bytes += len(payload)
                self._set_meta("next_seq", seq + 1)
                self._enforce_bounds()
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._db.execute("ROLLBACK")
                raise SpoolError(f"{self.path}: cannot spool a record: {exc}") from exc
            self._next_seq = seq + 1
            return seq

    def _enforce_bounds(self) -> None:
        while self._depth > self.max_records or self._bytes > self.max_bytes:
            row = self._db.execute(
                "SELECT seq, LENGTH(payload) FROM outbox WHERE kind NOT IN ('findings', 'ranks')"
                " ORDER BY seq LIMIT 1").fetchone() or self._db.execute(
                "SELECT seq, LENGTH(payload) FROM outbox ORDER BY seq LIMIT 1").fetchone()
            if row is None or self._depth <= 1:
                return
            self._db.execute("DELETE FROM outbox WHERE seq=?", (row[0],))
            self._depth -= 1
            self._bytes -= int(row[1])
            self._dropped += 1
            self._set_meta("dropped", self._dropped)

    def ack(self, up_to_seq: int) -> int:
        """The coordinator committed every record with seq <= ``up_to_seq``. Returns rows removed."""
        with self._lock:
            if up_to_seq <= self._acked:
                return 0
            try:
                self._db.execute("BEGIN IMMEDIATE")
                row = self._db.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM outbox WHERE seq<=?",
                                       (up_to_seq,)).fetchone()
                self._db.execute("DELETE FROM outbox WHERE seq<=?", (up_to_seq,))
                self._set_meta("acked", up_to_seq)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._db.execute("ROLLBACK")
                raise SpoolError(f"{self.path}: cannot record an ack: {exc}") from exc
            self._acked = up_to_seq
            self._depth -= int(row[0])
            self._bytes -= int(row[1])
            return int(row[0])

    # -- reading ---------------------------------------------------------------------------------

    def pending(self, after_seq: int, limit: int) -> list[tuple[int, bytes]]:
        """Unacknowledged records with seq > ``after_seq``, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT seq, payload FROM outbox WHERE seq>? ORDER BY seq LIMIT ?",
                                    (after_seq, limit)).fetchall()
        return [(int(r[0]), bytes(r[1])) for r in rows]

    def stats(self) -> SpoolStats:
        with self._lock:
            return SpoolStats(self._depth, self._bytes, self._dropped, self._next_seq, self._acked)

    @property
    def acked(self) -> int:
        return self._acked

    def close(self) -> None:
        with self._lock:
            self._db.close()
