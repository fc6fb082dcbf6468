"""The coordinator's SQLite store (WAL): node inventory, acknowledged seqs, step batches, jobs and
rank placement, current findings per node, SDC digests, verdicts, open straggler episodes, and the
fleet's screens (per GPU the last screen of each level and result plus a bounded history, when each
GPU was first seen, the screening turns).

Durability contract: a record is acknowledged to an agent only after the transaction that wrote it
*and* moved that agent's acked seq has committed, so a coordinator killed at any point loses no
acknowledged record and re-ingests nothing twice. ``synchronous=NORMAL`` in WAL mode survives a
killed process (the case we promise); after a power loss the last commits may be gone although
acknowledged. ``durable=True`` (``synchronous=FULL``) closes that gap at some ingest cost.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` moves version i → i+1.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuhealth.coordinator.screening import GpuKey, Screen, Turn
from gpuhealth.model import Finding, RankIdentity

MIGRATIONS: tuple[str, ...] = (
    # 0 → 1
    """
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY, incarnation TEXT NOT NULL, registered_at REAL NOT NULL,
        last_seen REAL NOT NULL, agent_version TEXT NOT NULL DEFAULT '',
        versions_json TEXT NOT NULL DEFAULT '{}', gpus_json TEXT NOT NULL DEFAULT '[]',
        topology_json TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE acks (
        node TEXT NOT NULL, incarnation TEXT NOT NULL, acked_seq INTEGER NOT NULL,
        updated_at REAL NOT NULL, PRIMARY KEY (node, incarnation)
    );
    CREATE TABLE step_batches (
        id INTEGER PRIMARY KEY, node TEXT NOT NULL, seq INTEGER NOT NULL, job_id TEXT NOT NULL,
        n INTEGER NOT NULL, received_at REAL NOT NULL, payload BLOB NOT NULL
    );
    CREATE INDEX step_batches_job ON step_batches (job_id, id);
    CREATE INDEX step_batches_time ON step_batches (received_at);
    CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY, world_size INTEGER NOT NULL, first_seen REAL NOT NULL,
        last_seen REAL NOT NULL
    );
    CREATE TABLE ranks (
        job_id TEXT NOT NULL, rank INTEGER NOT NULL, node TEXT NOT NULL, host TEXT NOT NULL,
        pid INTEGER NOT NULL, local_rank INTEGER, gpu_uuid TEXT, gpu_index INTEGER,
        seen_at REAL NOT NULL, PRIMARY KEY (job_id, rank)
    );
    CREATE TABLE node_findings (
        node TEXT PRIMARY KEY, at REAL NOT NULL, findings_json TEXT NOT NULL
    );
    CREATE TABLE sdc_digests (
        gpu_uuid TEXT NOT NULL, key TEXT NOT NULL, node TEXT NOT NULL, digest TEXT NOT NULL,
        at REAL NOT NULL, PRIMARY KEY (gpu_uuid, key)
    );
    CREATE TABLE verdicts (
        id INTEGER PRIMARY KEY, job_id TEXT NOT NULL, kind TEXT NOT NULL, created_at REAL NOT NULL,
        json TEXT NOT NULL
    );
    CREATE INDEX verdicts_job ON verdicts (job_id, id);
    CREATE INDEX verdicts_time ON verdicts (created_at);
    """,
    # 1 → 2: SDC digests keyed per node too (simulated nodes, and CPU "devices", share ids).
    """
    CREATE TABLE sdc_digests_v2 (
        node TEXT NOT NULL, gpu_uuid TEXT NOT NULL, key TEXT NOT NULL, digest TEXT NOT NULL,
        at REAL NOT NULL, PRIMARY KEY (node, gpu_uuid, key)
    );
    INSERT INTO sdc_digests_v2 (node, gpu_uuid, key, digest, at)
        SELECT node, gpu_uuid, key, digest, at FROM sdc_digests;
    DROP TABLE sdc_digests;
    ALTER TABLE sdc_digests_v2 RENAME TO sdc_digests;
    """,
    # 2 → 3: how each rank is known ("hook" or "discovered"): a restarted coordinator must not take a
    # zero-code job, which sends no steps, for a stalled one.
    """
    ALTER TABLE ranks ADD COLUMN found_by TEXT NOT NULL DEFAULT 'hook';
    """,
    # 3 → 4: whether the agent saw kernel evidence tying the rank to its job (issue 30): a restarted
    # coordinator must still not let an unverified claim move a verified rank or count as progress.
    """
    ALTER TABLE ranks ADD COLUMN verified INTEGER NOT NULL DEFAULT 0;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)

# Additive tables an older gpuhealth can ignore: created if missing, without a version bump (so the
# database stays readable by the previous release).
ADDITIVE: tuple[str, ...] = (
    # Open straggler episodes per job: a restarted coordinator continues them instead of announcing
    # the same straggler again.
    """
    CREATE TABLE IF NOT EXISTS straggler_episodes (
        job_id TEXT NOT NULL, rank INTEGER NOT NULL, opened_at REAL NOT NULL, finding_json TEXT NOT NULL,
        PRIMARY KEY (job_id, rank)
    )
    """,
    # Screens (issue 18): per GPU the newest screen of each level and result (at most 16 rows a GPU,
    # what coverage and the fleet view read after a restart) and the last few screens whatever they were.
    """
    CREATE TABLE IF NOT EXISTS screen_last (
        node TEXT NOT NULL, gpu_uuid TEXT NOT NULL, level TEXT NOT NULL, result TEXT NOT NULL,
        gpu_index INTEGER, trigger TEXT NOT NULL, started_at REAL NOT NULL, finished_at REAL NOT NULL,
        received_at REAL NOT NULL, reason TEXT NOT NULL, digests_json TEXT NOT NULL,
        PRIMARY KEY (node, gpu_uuid, level, result)
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS screen_history (
        id INTEGER PRIMARY KEY, node TEXT NOT NULL, gpu_uuid TEXT NOT NULL, level TEXT NOT NULL,
        result TEXT NOT NULL, gpu_index INTEGER, trigger TEXT NOT NULL, started_at REAL NOT NULL,
        finished_at REAL NOT NULL, received_at REAL NOT NULL, reason TEXT NOT NULL, digests_json TEXT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS screen_history_gpu ON screen_history (node, gpu_uuid, id)",
    # When the coordinator first saw each GPU: a never-screened GPU's age counts from it.
    """
    CREATE TABLE IF NOT EXISTS gpus_seen (
        node TEXT NOT NULL, gpu_uuid TEXT NOT NULL, first_seen REAL NOT NULL, PRIMARY KEY (node, gpu_uuid)
    )
    """,
    # What each node's agent reads (issue 33): a replayed recording is marked SIMULATED in the fleet view, also
    # after a restart.
    """
    CREATE TABLE IF NOT EXISTS node_backends (
        node TEXT PRIMARY KEY, simulated INTEGER NOT NULL, backend TEXT NOT NULL
    )
    """,
    # Each node's latest screening turn: a restarted coordinator continues the rotation.
    """
    CREATE TABLE IF NOT EXISTS screen_turns (
        node TEXT PRIMARY KEY, started_at REAL NOT NULL, until REAL NOT NULL
    )
    """,
)
_SCREEN_COLUMNS = ("node, gpu_uuid, level, result, gpu_index, trigger, started_at, finished_at, received_at, reason,"
                   " digests_json")


class StoreError(RuntimeError):
    """The database cannot be opened or has a schema this version does not understand."""


@dataclass(frozen=True, slots=True)
class NodeRow:
    name: str
    incarnation: str
    registered_at: float
    last_seen: float
    agent_version: str
    versions: dict[str, str]
    gpus: list[dict[str, Any]]
    topology_json: str


@dataclass(frozen=True, slots=True)
class RankRow:
    identity: RankIdentity
    node: str


class Store:
    """One connection, used from one thread at a time (the coordinator's event loop); a lock
    guards the rare reads from other threads (CLI queries run on the loop too)."""

    def __init__(self, path: str | Path, *, durable: bool = False) -> None:
        self.path = str(path)
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._migrate()
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"{self.path}: cannot open the coordinator database: {exc}") from exc
        self._lock = threading.RLock()
        self._in_tx = False

    # -- schema --------------------------------------------------------------------------------

    def _migrate(self) -> None:
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: schema version {version} is newer than this gpuhealth understands "
                f"({SCHEMA_VERSION}); upgrade gpuhealth or point --db at another file")
        for target in range(version, SCHEMA_VERSION):
            self._db.execute("BEGIN IMMEDIATE")
            for statement in _split_sql(MIGRATIONS[target]):
                self._db.execute(statement)
            self._db.execute(f"PRAGMA user_version={target + 1}")
            self._db.execute("COMMIT")
        for statement in ADDITIVE:
            self._db.execute(statement)

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Everything inside commits together or not at all. Inside an open group (``begin``), it
        is a savepoint: undone alone on error, committed with the group."""
        with self._lock:
            if self._in_tx:
                self._db.execute("SAVEPOINT inner_tx")
                try:
                    yield
                except BaseException:
                    self._db.execute("ROLLBACK TO inner_tx")
                    self._db.execute("RELEASE inner_tx")
                    raise
                self._db.execute("RELEASE inner_tx")
                return
            self._db.execute("BEGIN")
            self._in_tx = True
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            else:
                self._db.execute("COMMIT")
            finally:
                self._in_tx = False

    # Group commit: many records, one COMMIT (a commit costs ~100 µs; a small record ~10 µs).
    @property
    def in_transaction(self) -> bool:
        return self._in_tx

    def begin(self) -> None:
        with self._lock:
            if not self._in_tx:
                self._db.execute("BEGIN")
                self._in_tx = True

    def commit(self) -> None:
        with self._lock:
            if self._in_tx:
                try:
                    self._db.execute("COMMIT")
                finally:
                    self._in_tx = False

    def rollback(self) -> None:
        with self._lock:
            if self._in_tx:
                try:
                    self._db.execute("ROLLBACK")
                finally:
                    self._in_tx = False

    # -- nodes and acks --------------------------------------------------------------------------

    def upsert_node(self, name: str, incarnation: str, now: float, agent_version: str,
                    versions: dict[str, str], gpus: list[dict[str, Any]], topology_json: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO nodes (name, incarnation, registered_at, last_seen, agent_version, versions_json,"
                " gpus_json, topology_json) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE SET"
                " incarnation=excluded.incarnation, registered_at=excluded.registered_at,"
                " last_seen=excluded.last_seen, agent_version=excluded.agent_version,"
                " versions_json=excluded.versions_json, gpus_json=excluded.gpus_json,"
                " topology_json=excluded.topology_json",
                (name, incarnation, now, now, agent_version, json.dumps(versions), json.dumps(gpus), topology_json))

    def set_node_backend(self, name: str, simulated: bool, backend: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO node_backends (node, simulated, backend) VALUES (?,?,?) ON CONFLICT(node) DO UPDATE SET"
                " simulated=excluded.simulated, backend=excluded.backend", (name, int(simulated), backend))

    def node_backends(self) -> dict[str, tuple[bool, str]]:
        """node → (simulated, backend) as its agent last registered."""
        with self._lock:
            rows = self._db.execute("SELECT node, simulated, backend FROM node_backends").fetchall()
        return {str(r[0]): (bool(r[1]), str(r[2])) for r in rows}

    def touch_node(self, name: str, now: float) -> None:
        with self._lock:
            self._db.execute("UPDATE nodes SET last_seen=? WHERE name=?", (now, name))

    def nodes(self) -> list[NodeRow]:
        with self._lock:
            rows = self._db.execute(
                "SELECT name, incarnation, registered_at, last_seen, agent_version, versions_json, gpus_json,"
                " topology_json FROM nodes ORDER BY name").fetchall()
        return [NodeRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), json.loads(r[6]), r[7]) for r in rows]

    def acked_seq(self, node: str, incarnation: str) -> int:
        with self._lock:
            row = self._db.execute("SELECT acked_seq FROM acks WHERE node=? AND incarnation=?",
                                   (node, incarnation)).fetchone()
        return int(row[0]) if row else 0

    def set_acked(self, node: str, incarnation: str, seq: int, now: float) -> None:
        self._db.execute(
            "INSERT INTO acks (node, incarnation, acked_seq, updated_at) VALUES (?,?,?,?)"
            " ON CONFLICT(node, incarnation) DO UPDATE SET acked_seq=MAX(acked_seq, excluded.acked_seq),"
            " updated_at=excluded.updated_at", (node, incarnation, seq, now))

    # -- records ---------------------------------------------------------------------------------

    def add_step_batch(self, node: str, seq: int, job_id: str, n: int, payload: bytes, now: float) -> None:
        self._db.execute("INSERT INTO step_batches (node, seq, job_id, n, received_at, payload) VALUES (?,?,?,?,?,?)",
                         (node, seq, job_id, n, now, payload))
        self._db.execute(
            "INSERT INTO jobs (job_id, world_size, first_seen, last_seen) VALUES (?, 0, ?, ?)"
            " ON CONFLICT(job_id) DO UPDATE SET last_seen=excluded.last_seen", (job_id, now, now))

    def step_batches(self, job_id: str | None = None, since: float = 0.0) -> Iterator[tuple[str, int, bytes]]:
        """(node, seq, payload) of stored batches, oldest first."""
        with self._lock:
            if job_id is None:
                rows = self._db.execute("SELECT node, seq, payload FROM step_batches WHERE received_at>=? ORDER BY id",
                                        (since,)).fetchall()
            else:
                rows = self._db.execute("SELECT node, seq, payload FROM step_batches WHERE job_id=? AND "
                                        "received_at>=? ORDER BY id", (job_id, since)).fetchall()
        yield from ((r[0], int(r[1]), bytes(r[2])) for r in rows)

    def step_record_count(self, job_id: str | None = None) -> int:
        with self._lock:
            if job_id is None:
                row = self._db.execute("SELECT COALESCE(SUM(n), 0) FROM step_batches").fetchone()
            else:
                row = self._db.execute("SELECT COALESCE(SUM(n), 0) FROM step_batches WHERE job_id=?",
                                       (job_id,)).fetchone()
        return int(row[0])

    def upsert_ranks(self, node: str, identities: Sequence[RankIdentity], now: float) -> None:
        for i in identities:
            self._db.execute(
                "INSERT INTO jobs (job_id, world_size, first_seen, last_seen) VALUES (?,?,?,?) ON CONFLICT(job_id)"
                " DO UPDATE SET world_size=MAX(world_size, excluded.world_size), last_seen=excluded.last_seen",
                (i.job_id, i.world_size, now, now))
            self._db.execute(
                "INSERT OR REPLACE INTO ranks (job_id, rank, node, host, pid, local_rank, gpu_uuid, gpu_index, seen_at,"
                " found_by, verified) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (i.job_id, i.rank, node, i.host, i.pid, i.local_rank, i.gpu_uuid, i.gpu_index, now, i.found_by,
                 int(i.verified)))

    def jobs(self) -> list[tuple[str, int, float, float]]:
        with self._lock:
            rows = self._db.execute("SELECT job_id, world_size, first_seen, last_seen FROM jobs ORDER BY first_seen")
            return [(r[0], int(r[1]), float(r[2]), float(r[3])) for r in rows.fetchall()]

    def ranks(self, job_id: str | None = None) -> list[RankRow]:
        with self._lock:
            sql = "SELECT job_id, rank, node, host, pid, local_rank, gpu_uuid, gpu_index, found_by, verified FROM ranks"
            rows = (self._db.execute(sql + " ORDER BY job_id, rank") if job_id is None
                    else self._db.execute(sql + " WHERE job_id=? ORDER BY rank", (job_id,))).fetchall()
        out = []
        for r in rows:
            ident = RankIdentity(job_id=r[0], rank=int(r[1]), world_size=0, host=r[3], pid=int(r[4]),
                                 local_rank=r[5], gpu_uuid=r[6], gpu_index=r[7],
                                 found_by="discovered" if r[8] == "discovered" else "hook", verified=bool(r[9]))
            out.append(RankRow(ident, r[2]))
        return out

    def set_node_findings(self, node: str, findings: Sequence[Finding], now: float) -> None:
        self._db.execute("INSERT OR REPLACE INTO node_findings (node, at, findings_json) VALUES (?,?,?)",
                         (node, now, json.dumps([f.to_dict() for f in findings], default=str)))

    def node_findings(self) -> dict[str, tuple[float, list[Finding]]]:
        with self._lock:
            rows = self._db.execute("SELECT node, at, findings_json FROM node_findings").fetchall()
        return {r[0]: (float(r[1]), [Finding.from_dict(d) for d in json.loads(r[2])]) for r in rows}

    def add_sdc_digest(self, node: str, gpu_uuid: str, key: str, digest: str, at: float) -> None:
        self._db.execute("INSERT OR REPLACE INTO sdc_digests (node, gpu_uuid, key, digest, at) VALUES (?,?,?,?,?)",
                         (node, gpu_uuid, key, digest, at))

    def sdc_digests(self) -> list[tuple[str, str, str, str, float]]:
        """(node, gpu_uuid, key, digest, at)."""
        with self._lock:
            rows = self._db.execute("SELECT node, gpu_uuid, key, digest, at FROM sdc_digests").fetchall()
        return [(r[0], r[1], r[2], r[3], float(r[4])) for r in rows]

    # -- screens ---------------------------------------------------------------------------------

    def add_screens(self, screens: Sequence[Screen], keep_history: int) -> None:
        """Store screens (inside the caller's transaction): the newest per GPU, level and result, and the
        history trimmed to the last ``keep_history`` screens of each GPU."""
        marks = ",".join("?" * 11)
        for s in screens:
            row = (s.node, s.gpu_uuid, s.level, s.result, s.gpu_index, s.trigger, s.started_at, s.finished_at,
                   s.received_at, s.reason, json.dumps(s.digests))
            self._db.execute(
                f"INSERT INTO screen_last ({_SCREEN_COLUMNS}) VALUES ({marks}) ON CONFLICT(node, gpu_uuid, level,"
                " result) DO UPDATE SET gpu_index=excluded.gpu_index, trigger=excluded.trigger,"
                " started_at=excluded.started_at, finished_at=excluded.finished_at, received_at=excluded.received_at,"
                " reason=excluded.reason, digests_json=excluded.digests_json"
                " WHERE excluded.finished_at >= screen_last.finished_at", row)
            self._db.execute(f"INSERT INTO screen_history ({_SCREEN_COLUMNS}) VALUES ({marks})", row)
        for node, uuid in sorted({(s.node, s.gpu_uuid) for s in screens}):
            self._db.execute(
                "DELETE FROM screen_history WHERE node=? AND gpu_uuid=? AND id <= (SELECT id FROM screen_history"
                " WHERE node=? AND gpu_uuid=? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                (node, uuid, node, uuid, keep_history))

    def screens_last(self) -> list[Screen]:
        """The newest screen of each GPU, level and result."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_SCREEN_COLUMNS} FROM screen_last").fetchall()
        return [_screen_row(r) for r in rows]

    def screen_history(self, node: str, gpu_uuid: str, limit: int = 100) -> list[Screen]:
        """A GPU's screens, newest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_SCREEN_COLUMNS} FROM screen_history WHERE node=? AND gpu_uuid=?"
                                    " ORDER BY id DESC LIMIT ?", (node, gpu_uuid, limit)).fetchall()
        return [_screen_row(r) for r in rows]

    def note_gpus_seen(self, node: str, gpu_uuids: Sequence[str], now: float) -> None:
        for uuid in gpu_uuids:
            self._db.execute("INSERT OR IGNORE INTO gpus_seen (node, gpu_uuid, first_seen) VALUES (?,?,?)",
                             (node, uuid, now))

    def gpus_first_seen(self) -> dict[GpuKey, float]:
        with self._lock:
            rows = self._db.execute("SELECT node, gpu_uuid, first_seen FROM gpus_seen").fetchall()
        return {(r[0], r[1]): float(r[2]) for r in rows}

    def set_turn(self, turn: Turn) -> None:
        self._db.execute("INSERT OR REPLACE INTO screen_turns (node, started_at, until) VALUES (?,?,?)",
                         (turn.node, turn.started_at, turn.until))

    def end_turn(self, node: str, now: float) -> None:
        self._db.execute("UPDATE screen_turns SET until=MIN(until, ?) WHERE node=?", (now, node))

    def turns(self) -> list[Turn]:
        """Each node's latest turn (ended ones too: when a node last held one orders the rotation)."""
        with self._lock:
            rows = self._db.execute("SELECT node, started_at, until FROM screen_turns ORDER BY node").fetchall()
        return [Turn(r[0], float(r[1]), float(r[2])) for r in rows]

    def prune_screens(self, before: float, keep: set[GpuKey]) -> dict[str, int]:
        """History older than ``before``; a GPU's last screens and first sighting only once the GPU is
        gone from every registration (``keep``: the registered ones) and its rows are old."""
        removed: dict[str, int] = {}
        with self.transaction():
            removed["screen_history"] = self._db.execute("DELETE FROM screen_history WHERE received_at<?",
                                                         (before,)).rowcount
            gone = [(n, u) for n, u, at in self._db.execute(
                "SELECT node, gpu_uuid, MAX(received_at) FROM screen_last GROUP BY node, gpu_uuid").fetchall()
                if (n, u) not in keep and float(at) < before]
            gone += [(n, u) for n, u, at in self._db.execute("SELECT node, gpu_uuid, first_seen FROM gpus_seen")
                     .fetchall() if (n, u) not in keep and float(at) < before]
            for n, u in set(gone):
                self._db.execute("DELETE FROM screen_last WHERE node=? AND gpu_uuid=?", (n, u))
                self._db.execute("DELETE FROM gpus_seen WHERE node=? AND gpu_uuid=?", (n, u))
            removed["screen_gpus"] = len(set(gone))
            removed["screen_turns"] = self._db.execute("DELETE FROM screen_turns WHERE until<?", (before,)).rowcount
        return removed

    # -- verdicts --------------------------------------------------------------------------------

    def add_verdict(self, job_id: str, kind: str, doc: dict[str, Any], now: float) -> int:
        with self._lock:
            cur = self._db.execute("INSERT INTO verdicts (job_id, kind, created_at, json) VALUES (?,?,?,?)",
                                   (job_id, kind, now, json.dumps(doc, default=str)))
            return int(cur.lastrowid or 0)

    def verdicts(self, job_id: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        with self._lock:
            if job_id is None:
                rows = self._db.execute("SELECT id, job_id, kind, created_at, json FROM verdicts ORDER BY id DESC"
                                        " LIMIT ?", (limit,)).fetchall()
            else:
                rows = self._db.execute("SELECT id, job_id, kind, created_at, json FROM verdicts WHERE job_id=?"
                                        " ORDER BY id DESC LIMIT ?", (job_id, limit)).fetchall()
        return [{"id": r[0], "job_id": r[1], "kind": r[2], "created_at": r[3], **json.loads(r[4])} for r in rows]

    # -- straggler episodes ----------------------------------------------------------------------

    def straggler_episodes(self, job_id: str) -> dict[int, Finding]:
        """The job's open straggler episodes: rank → the finding that opened (or last described) it."""
        with self._lock:
            rows = self._db.execute("SELECT rank, finding_json FROM straggler_episodes WHERE job_id=? ORDER BY rank",
                                    (job_id,)).fetchall()
        out: dict[int, Finding] = {}
        for rank, text in rows:
            try:
                out[int(rank)] = Finding.from_dict(json.loads(text))
            except (ValueError, KeyError, TypeError):
                continue  # a row this version cannot read: the episode is judged afresh
        return out

    def set_straggler_episodes(self, job_id: str, findings: Mapping[int, Finding], now: float) -> None:
        """Make the job's open episodes exactly ``findings`` (rank → finding)."""
        with self._lock:
            keep = sorted(findings)
            marks = ",".join("?" * len(keep))
            self._db.execute(f"DELETE FROM straggler_episodes WHERE job_id=? AND rank NOT IN ({marks})",
                             (job_id, *keep))
            for rank in keep:
                self._db.execute(
                    "INSERT INTO straggler_episodes (job_id, rank, opened_at, finding_json) VALUES (?,?,?,?)"
                    " ON CONFLICT(job_id, rank) DO UPDATE SET finding_json=excluded.finding_json",
                    (job_id, rank, now, json.dumps(findings[rank].to_dict(), default=str)))

    # -- retention -------------------------------------------------------------------------------

    def prune(self, now: float, *, keep_days: float, keep_steps_hours: float) -> dict[str, int]:
        """Delete what is older than the retention windows; returns rows removed per table."""
        removed: dict[str, int] = {}
        steps_before = now - keep_steps_hours * 3600.0
        before = now - keep_days * 86_400.0
        with self.transaction():
            removed["step_batches"] = self._db.execute("DELETE FROM step_batches WHERE received_at<?",
                                                       (steps_before,)).rowcount
            removed["verdicts"] = self._db.execute("DELETE FROM verdicts WHERE created_at<?", (before,)).rowcount
            removed["sdc_digests"] = self._db.execute("DELETE FROM sdc_digests WHERE at<?", (before,)).rowcount
            old_jobs = [r[0] for r in self._db.execute("SELECT job_id FROM jobs WHERE last_seen<?", (before,))]
            for job in old_jobs:
                self._db.execute("DELETE FROM ranks WHERE job_id=?", (job,))
                self._db.execute("DELETE FROM straggler_episodes WHERE job_id=?", (job,))
                self._db.execute("DELETE FROM jobs WHERE job_id=?", (job,))
            removed["jobs"] = len(old_jobs)
        return removed


def _screen_row(r: Sequence[Any]) -> Screen:
    digests = tuple((str(k), str(d)) for k, d in json.loads(r[10]))
    return Screen(node=r[0], gpu_uuid=r[1], level=r[2], result=r[3], gpu_index=r[4], trigger=r[5],
                  started_at=float(r[6]), finished_at=float(r[7]), received_at=float(r[8]), reason=r[9],
                  digests=digests)


def _split_sql(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
