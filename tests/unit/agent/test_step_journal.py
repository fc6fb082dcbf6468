"""The step journal: records reach the disk in group commits, and move into the spool exactly once
whatever point a crash interrupts the move at (real SQLite files, the stream's own flush)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuhealth.agent.coordinator_stream import CoordinatorStream, StreamSettings
from gpuhealth.agent.spool import Spool
from gpuhealth.agent.step_journal import StepJournal, journal_path_for
from gpuhealth.model import StepRecord
from gpuhealth.proto import gpuhealth_v1_pb2 as pb


def _recs(job: str, first: int, n: int, rank: int = 0) -> list[StepRecord]:
    return [StepRecord(job, rank, s, 1.7e9 + s, 0.1, 0.08, 0.02) for s in range(first, first + n)]


def _stream(tmp_path: Path) -> CoordinatorStream:
    spool = Spool(tmp_path / "coordinator-spool.db")
    return CoordinatorStream(StreamSettings(address="127.0.0.1:1"), spool, register=lambda inc: pb.RegisterRequest(),
                             heartbeat=lambda st: pb.HealthSummary(), on_request=lambda req, emit: None)


def _spooled(tmp_path: Path) -> list[tuple[str, int, int]]:
    """(job, rank, step) of every step record in the spool file, duplicates included."""
    spool = Spool(tmp_path / "coordinator-spool.db")
    out = []
    for _, payload in spool.pending(0, 10_000):
        rec = pb.AgentMessage.FromString(payload).record
        if rec.WhichOneof("payload") == "steps":
            out += [(rec.steps.job_id, r, s) for r, s in zip(rec.steps.rank, rec.steps.step, strict=True)]
    spool.close()
    return out


class Crash(BaseException):
    """Stands in for SIGKILL at one point of the move (nothing after it runs)."""


def test_records_are_on_disk_after_a_commit_not_after_a_batch(tmp_path: Path) -> None:
    path = str(tmp_path / "j.db")
    journal = StepJournal(path)
    journal.add(_recs("a", 0, 3))
    assert journal.commit() == 3
    journal.add(_recs("a", 3, 2))  # not committed: lost with the process, as documented
    # Another reader (a restarted agent) sees what was committed, nothing else.
    again = StepJournal(path)
    taken = again.take("a")
    assert taken is not None and [r.step for r in taken.records] == [0, 1, 2]
    assert again.pending() == 3


@pytest.mark.parametrize("crash_at", ["append", "end_move"])
def test_a_move_interrupted_anywhere_spools_each_record_once(tmp_path: Path, crash_at: str) -> None:
    stream = _stream(tmp_path)
    stream.on_steps(None, _recs("a", 0, 5) + _recs("b", 0, 3, rank=1))
    stream.journal.commit()
    target: Any = stream.spool if crash_at == "append" else stream.journal

    def crash(*args: Any, **kwargs: Any) -> Any:
        raise Crash

    original = getattr(target, crash_at)
    setattr(target, crash_at, crash)
    with pytest.raises(Crash):
        stream._flush()
    setattr(target, crash_at, original)
    stream.journal.close()
    stream.spool.close()
    # The restarted agent: recovery, then its flush.
    again = _stream(tmp_path)
    again._flush()
    again.journal.close()
    again.spool.close()
    rows = _spooled(tmp_path)
    assert sorted(rows) == sorted([("a", 0, s) for s in range(5)] + [("b", 1, s) for s in range(3)])
    assert len(rows) == len(set(rows))


def test_a_big_backlog_goes_in_bounded_batches(tmp_path: Path) -> None:
    journal = StepJournal(str(tmp_path / "j.db"))
    for first in range(0, 30, 10):
        journal.add(_recs("a", first, 10))
        journal.commit()
    taken = journal.take("a", max_records=15)
    assert taken is not None and len(taken.records) == 20  # whole rows, at least the limit
    journal.end_move(taken)
    assert journal.pending() == 10


def test_the_journal_is_bounded_and_counts_what_it_drops(tmp_path: Path) -> None:
    journal = StepJournal(str(tmp_path / "j.db"), max_records=100)
    journal.add(_recs("a", 0, 80))
    journal.commit()
    journal.add(_recs("a", 80, 50))
    assert journal.dropped == 30 and journal.pending() == 100


def test_the_journal_lives_beside_the_spool() -> None:
    assert journal_path_for("/var/lib/gpuhealth/coordinator-spool.db") == \
        "/var/lib/gpuhealth/coordinator-spool-steps.db"
    assert journal_path_for(":memory:") == ":memory:"
