"""SDC votes count only for GPUs the voting node registered: one node cannot get others' GPUs drained."""

from __future__ import annotations

from pathlib import Path

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.fleet import NodeView
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store


def test_a_node_cannot_vote_for_gpus_it_does_not_have(tmp_path: Path) -> None:
    coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig())
    for i, name in enumerate(["n1", "n2", "n3", "n4"]):
        coord.nodes[name] = NodeView(name, gpus=[{"index": 0, "uuid": f"GPU-{i}"}])
        coord.store.add_sdc_digest(name, f"GPU-{i}", "k", "good", 1.0)
    coord.nodes["evil"] = NodeView("evil", gpus=[{"index": 0, "uuid": "GPU-evil"}])
    for forged in ["GPU-0", "GPU-1", "GPU-x", "GPU-y", "GPU-z"]:
        coord.store.add_sdc_digest("evil", forged, "k", "bad", 2.0)
    doc = coord.fleet_doc()
    assert doc["sdc"] == []  # the four honest GPUs agree; forged votes do not count
    assert doc["sdc_digests"]["votes"] == 4
    # the evil node's own GPU still votes, and is the one outvoted
    coord.store.add_sdc_digest("evil", "GPU-evil", "k", "bad", 3.0)
    flagged = [f["entity"]["id"] for f in coord.fleet_doc()["sdc"]]
    assert flagged == ["GPU-evil"]
    coord.store.close()
