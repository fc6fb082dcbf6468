"""Evidence answers: a node speaks only for its own ranks, once, and a request's evidence is bounded."""

from __future__ import annotations

import json

from gpuhealth.coordinator.hangs import PendingRequest
from gpuhealth.proto import gpuhealth_v1_pb2 as pb


def _answer(rank: int, payload: object, final: bool = False) -> pb.RequestResult:
    return pb.RequestResult(request_id=1, rank=rank, ok=True, payload=json.dumps(payload).encode(), final=final)


def test_a_node_cannot_plant_or_overwrite_another_nodes_rank() -> None:
    p = PendingRequest(1, pb.DUMP_FLIGHT_RECORDER, "j", {"n1", "n2"}, rank_nodes={0: "n1", 1: "n2"})
    p.add("n2", _answer(0, {"forged": True}))  # rank 0 runs on n1
    p.add("n1", _answer(0, {"real": True}))
    p.add("n1", _answer(0, {"second": True}))  # one answer per rank
    p.add("n2", _answer(1, {"real": True}, final=True))
    assert p.answers[0].node == "n1" and p.answers[0].payload == {"real": True}
    assert p.answers[1].payload == {"real": True} and p.waiting == {"n1"}


def test_evidence_past_the_budget_is_recorded_not_kept() -> None:
    p = PendingRequest(1, pb.DUMP_FLIGHT_RECORDER, "j", {"n1"}, max_bytes=100)
    p.add("n1", _answer(0, {"x": "a" * 40}))
    p.add("n1", _answer(1, {"x": "b" * 80}, final=True))
    assert p.answers[0].ok and not p.answers[1].ok and "budget" in p.answers[1].error
    assert p.done.is_set()
