"""Step records an agent loses when it is killed with SIGKILL mid-stream: at most one group-commit
interval of them (goal ≤ 100 ms of records; 517 ms per kill before the journal — the whole 1 s batch
interval, on average half of it). Real coordinator, real agent process killed three times, a process
of ranks streaming 800 records/s into its socket; the coordinator's database is the judge."""

from __future__ import annotations

from pathlib import Path

import pytest
from step_loss import measure

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_step_records_survive_sigkill(tmp_path: Path) -> None:
    result = measure(tmp_path, ranks=4, rate_per_rank=200.0, kills=3, every_s=2.5)
    # the ranks really streamed through the kills (~6,000 on a quiet machine; 4,172 on 2 cores shared with three
    # other test workers, whose load slows the sender, not what is lost per kill)
    assert result.sent > 3000, result
    assert result.duplicates == 0, result
    assert result.lost_ms_per_kill <= 100.0, result.to_dict()
