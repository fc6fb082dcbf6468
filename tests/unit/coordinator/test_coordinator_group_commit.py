"""Group commit: records are acknowledged only once their group committed; a resend of a record
still in the open group is a duplicate; a new registration never reports uncommitted seqs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from simagent import step_batch_message

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.service import GROUP_COMMIT_RECORDS, Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.proto import gpuhealth_v1_pb2 as pb


def _feed(coord: Coordinator, session: object, seq: int) -> None:
    raw = step_batch_message(seq, "j", [0, 1], seq)
    coord.handle_record(session, raw, pb.AgentMessage.FromString(raw).record)  # type: ignore[arg-type]


def test_ack_follows_the_commit(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig())
        resp = coord.register(pb.RegisterRequest(node_name="n1", incarnation="i1"))
        session = coord.sessions[resp.session_id]
        for seq in (1, 2, 3):
            _feed(coord, session, seq)
        _feed(coord, session, 2)  # resent while its group is still open
        assert (session.received, session.acked) == (3, 0)
        assert coord.counters.duplicates == 1
        other = Store(tmp_path / "c.db")  # another connection sees nothing uncommitted
        assert other.step_record_count() == 0
        await asyncio.sleep(0.05)  # the group timer fires
        assert session.acked == 3 and other.step_record_count() == 6
        _feed(coord, session, 4)
        again = coord.register(pb.RegisterRequest(node_name="n1", incarnation="i1"))
        assert again.acked_seq == 4 and other.acked_seq("n1", "i1") == 4  # flushed before answering
        new = coord.sessions[again.session_id]
        for seq in range(5, 5 + GROUP_COMMIT_RECORDS):
            _feed(coord, new, seq)
        assert new.acked == 4 + GROUP_COMMIT_RECORDS  # a full group commits at once
        other.close()

    asyncio.run(main())


def test_finished_jobs_leave_memory_but_not_the_store(tmp_path: Path) -> None:
    now = [1000.0]
    coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(forget_job_after_s=60), monotonic=lambda: now[0])
    resp = coord.register(pb.RegisterRequest(node_name="n1", incarnation="i1"))
    session = coord.sessions[resp.session_id]
    _feed(coord, session, 1)
    coord.flush_group()
    coord.tick()
    assert "j" in coord.jobs.jobs
    now[0] += 61
    coord.tick()
    assert "j" not in coord.jobs.jobs
    assert coord.store.step_record_count("j") == 2


def test_retention_removes_old_evidence_folders(tmp_path: Path) -> None:
    import os

    ev = tmp_path / "ev"
    old, new = ev / "job-a" / "1-hang", ev / "job-b" / "2-hang"
    for d in (old, new):
        (d / "fr").mkdir(parents=True)
        (d / "fr" / "rank_0.json").write_text("{}")
    os.utime(old, (0, 0))
    coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(evidence_dir=str(ev), retention_days=1),
                        clock=lambda: 10 * 86_400.0)
    os.utime(new, (10 * 86_400.0, 10 * 86_400.0))
    assert coord.prune(10 * 86_400.0) == 1
    assert not old.exists() and new.exists()


def test_retention_runs_at_start_not_on_a_late_first_tick(tmp_path: Path) -> None:
    """Old rows go when the coordinator starts; a record received after the start stays until the
    hourly pass, however late the first tick runs on a loaded machine (it raced a CI run)."""
    day = 86_400.0
    store = Store(tmp_path / "c.db")
    store.add_sdc_digest("n0", "GPU-old", "k", "d", at=1.0)
    store.commit()
    clock = [40 * day]

    async def main() -> None:
        coord = Coordinator(store, CoordinatorConfig(retention_days=30, tick_s=0.01), clock=lambda: clock[0])
        await coord.start()
        assert coord.store.sdc_digests() == []  # pruned before anything was served
        coord.store.add_sdc_digest("n1", "GPU-new", "k", "d", at=2.0)  # an agent's clock far behind
        coord.store.commit()
        await asyncio.sleep(0.1)  # several ticks
        assert [r[1] for r in coord.store.sdc_digests()] == ["GPU-new"]
        clock[0] += 3601  # the hourly pass
        await asyncio.sleep(0.1)
        assert coord.store.sdc_digests() == []
        await coord.stop()

    asyncio.run(main())


def test_retention_that_fails_at_start_does_not_keep_the_coordinator_from_serving(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(tick_s=0.01))

    def broken(now: float) -> int:
        raise OSError("evidence folder unreadable")

    coord.prune = broken  # type: ignore[method-assign]

    async def main() -> None:
        await coord.start()
        resp = coord.register(pb.RegisterRequest(node_name="n1", incarnation="i1"))
        _feed(coord, coord.sessions[resp.session_id], 1)  # it serves
        await coord.stop()

    asyncio.run(main())
    assert "retention at start failed" in caplog.text
