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
