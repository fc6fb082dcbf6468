"""The coordinator's SQLite store: WAL, versioned schema, ack monotonicity, retention."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gpuhealth.coordinator.store import SCHEMA_VERSION, Store, StoreError
from gpuhealth.model import Entity, Finding, RankIdentity, Severity


def test_wal_schema_version_and_reopen(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    s = Store(db)
    assert s.schema_version == SCHEMA_VERSION
    with s.transaction():
        s.add_step_batch("n1", 1, "job", 16, b"x", 100.0)
        s.set_acked("n1", "inc", 1, 100.0)
    s.close()
    s = Store(db)  # migrations are idempotent
    assert s.acked_seq("n1", "inc") == 1 and s.acked_seq("n1", "other") == 0
    assert s.step_record_count("job") == 16
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_newer_schema_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    with sqlite3.connect(db) as con:
        con.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError, match="newer than this gpuhealth"):
        Store(db)


def test_ack_never_moves_backwards_and_rollback_keeps_nothing(tmp_path: Path) -> None:
    s = Store(tmp_path / "c.db")
    with s.transaction():
        s.set_acked("n1", "i", 10, 1.0)
    with s.transaction():
        s.set_acked("n1", "i", 4, 2.0)
    assert s.acked_seq("n1", "i") == 10
    with pytest.raises(RuntimeError), s.transaction():
        s.add_step_batch("n1", 11, "job", 5, b"x", 3.0)
        s.set_acked("n1", "i", 11, 3.0)
        raise RuntimeError("disk full")
    assert s.acked_seq("n1", "i") == 10 and s.step_record_count() == 0


def test_retention_prunes_old_rows_only(tmp_path: Path) -> None:
    s = Store(tmp_path / "c.db")
    day = 86_400.0
    with s.transaction():
        s.add_step_batch("n1", 1, "old", 4, b"x", 0.0)
        s.add_step_batch("n1", 2, "new", 4, b"x", 40 * day)
        s.upsert_ranks("n1", [RankIdentity("old", 0, 2, "h", 1)], 0.0)
        s.set_node_findings("n1", [Finding("throttle.hw_slowdown", Severity.WARNING, Entity.gpu("GPU-1", 1), "m")],
                            0.0)
    s.add_verdict("old", "hang", {"summary": "x"}, 0.0)
    s.add_verdict("new", "hang", {"summary": "y"}, 40 * day)
    removed = s.prune(41 * day, keep_days=30, keep_steps_hours=48)
    assert removed == {"step_batches": 1, "verdicts": 1, "sdc_digests": 0, "jobs": 1}
    assert s.step_record_count() == 4
    assert [v["job_id"] for v in s.verdicts()] == ["new"]
    assert s.ranks("old") == []
    assert s.node_findings()["n1"][1][0].code == "throttle.hw_slowdown"  # current state is not history


def test_migration_from_version_1_keeps_sdc_digests(tmp_path: Path) -> None:
    from gpuhealth.coordinator.store import MIGRATIONS, _split_sql

    db = tmp_path / "v1.db"
    with sqlite3.connect(db) as con:  # a database written by schema version 1
        for statement in _split_sql(MIGRATIONS[0]):
            con.execute(statement)
        con.execute("INSERT INTO sdc_digests (gpu_uuid, key, node, digest, at) VALUES ('GPU-1', 'k', 'n1', 'aa', 1)")
        con.execute("PRAGMA user_version=1")
    s = Store(db)
    assert s.schema_version == SCHEMA_VERSION == 4
    assert s.sdc_digests() == [("n1", "GPU-1", "k", "aa", 1.0)]
    with s.transaction():  # the same GPU id on another node is another vote now
        s.add_sdc_digest("n2", "GPU-1", "k", "aa", 2.0)
    assert len(s.sdc_digests()) == 2


def test_how_a_rank_was_found_survives_a_restart(tmp_path: Path) -> None:
    """A zero-code rank stays "discovered" after the coordinator restarts (else its job, which sends no
    steps, would be taken for a stalled one); rows written before the column existed read as "hook"."""
    db = tmp_path / "c.db"
    s = Store(db)
    with s.transaction():
        s.upsert_ranks("n1", [RankIdentity("z", 0, 2, "h", 10, found_by="discovered"),
                              RankIdentity("j", 0, 2, "h", 11)], 1.0)
    s.close()
    again = Store(db)
    assert {(r.identity.job_id, r.identity.found_by) for r in again.ranks()} == {("z", "discovered"), ("j", "hook")}
