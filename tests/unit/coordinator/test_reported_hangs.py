"""A hang an agent reports (``rank.stuck`` from NCCL RAS) opens the coordinator's investigation only where the
stuck rank runs, once per episode, and only for a job the coordinator knows."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.model import Action, Entity, EntityKind, Finding, RankIdentity, Severity


def _stuck(job_id: str, rank: int = 1, severity: Severity = Severity.CRITICAL) -> Finding:
    return Finding("rank.stuck", severity, Entity(EntityKind.RANK, str(rank), rank), f"job {job_id} hung: rank {rank}",
                   Action.CHECK_JOB, {"job_id": job_id, "rank": rank, "stalled_s": 31.0, "threshold_s": 30.0,
                                      "source": "NCCL RAS"}, "zerocode")


def test_only_the_node_of_the_stuck_rank_opens_an_investigation_once(tmp_path: Path) -> None:
    async def main() -> None:
        coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(evidence_dir=str(tmp_path / "ev"),
                                                                        evidence_timeout_s=1.0))
        job = coord.jobs.get("z", time.monotonic())
        for rank in (0, 1):
            job.add_identity("n1", RankIdentity("z", rank, 2, "h", 10 + rank, found_by="discovered"), time.monotonic())
        coord._reported_hangs("n2", [_stuck("z")])  # no rank of the job runs on n2
        coord._reported_hangs("n1", [_stuck("z", severity=Severity.INFO)])  # info: another node's rank
        coord._reported_hangs("n1", [_stuck("unknown-job")])  # no identity yet
        assert coord.counters.hangs == 0 and not coord.investigating
        coord._reported_hangs("n1", [_stuck("z")])
        coord._reported_hangs("n1", [_stuck("z")])  # the same episode
        assert coord.counters.hangs == 1 and job.hang_open and coord.reported_hangs["z"] == ("n1", None)
        deadline = time.monotonic() + 20
        while not coord.store.verdicts("z") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        (doc,) = coord.store.verdicts("z")
        # no agent answered (none is connected): the rank RAS named is the culprit, said by whom
        assert doc["culprits"] == [1] and doc["reported_by"] == {
            "node": "n1", "source": "NCCL RAS", "message": "job z hung: rank 1", "rank": 1}

    asyncio.run(main())


def _straggler(job_id: str, rank: int) -> Finding:
    return Finding("rank.straggler", Severity.WARNING, Entity(EntityKind.RANK, str(rank), rank), f"rank {rank} slow",
                   Action.CHECK_JOB, {"job_id": job_id, "rank": rank, "ratio_to_median": 1.3,
                                      "source": "periodic flight-recorder dumps"}, "zerocode")


def test_a_restarted_coordinator_keeps_what_nodes_last_said_of_zero_code_jobs(tmp_path: Path) -> None:
    """Findings are sent only when they change: after a restart the node's stored word stands — the hang it
    reported is the episode already investigated (no second one when the same report comes again), and its
    stragglers stay the job's (no second verdict)."""
    db = tmp_path / "c.db"
    store = Store(db)
    now = time.time()
    with store.transaction():
        store.upsert_ranks("n1", [RankIdentity("z", r, 2, "h", 10 + r, found_by="discovered") for r in (0, 1)], now)
        store.upsert_ranks("n1", [RankIdentity("s", r, 2, "h", 20 + r, found_by="discovered") for r in (0, 1)], now)
        store.set_node_findings("n1", [_stuck("z"), _straggler("s", 1)], now)
    store.set_straggler_episodes("s", {1: _straggler("s", 1)}, now)
    store.close()
    coord = Coordinator(Store(db), CoordinatorConfig(evidence_dir=str(tmp_path / "ev")))
    assert coord.jobs.jobs["z"].hang_open and coord.reported_hangs["z"] == ("n1", None)
    coord._reported_hangs("n1", [_stuck("z"), _straggler("s", 1)])
    assert coord.counters.hangs == 0 and not coord.investigating
    coord.tick()
    assert sorted(coord.jobs.jobs["s"].stragglers) == [1] and coord.store.verdicts("s") == []
