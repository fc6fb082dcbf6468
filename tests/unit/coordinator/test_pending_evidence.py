"""Evidence answers: a node speaks only for its own ranks, once, and a request's evidence is bounded."""

from __future__ import annotations

import json

from gpuhealth.coordinator.requests import PendingRequest
from gpuhealth.proto import gpuhealth_v1_pb2 as pb


def _answer(rank: int, payload: object, final: bool = False) -> pb.RequestResult:
    return pb.RequestResult(request_id=1, rank=rank, ok=True, payload=json.dumps(payload).encode(), final=final)


def test_a_node_cannot_plant_or_overwrite_another_nodes_rank() -> None:
    p = PendingRequest(1, pb.DUMP_FLIGHT_RECORDER, "j", {"n1", "n2"}, rank_nodes={0: "n1", 1: "n2"})
    p.add("n2", _answer(0, {"forged": True}))  # rank 0 runs on n1
    p.add("n1", _answer(0, {"real": True}))
    p.add("n1", _answer(0, {"second": True}))  # one answer per rank
    p.add("n2", _answer(1, {"real": True}, final=True))
    # Dumps stay the bytes the agent sent: parsed once, later, by the analyser (never on the event loop).
    assert p.answers[0].node == "n1" and json.loads(p.answers[0].raw) == {"real": True}
    assert p.answers[0].payload is None
    assert json.loads(p.answers[1].raw) == {"real": True} and p.waiting == {"n1"}


def test_a_dump_that_is_not_a_json_object_is_an_error_not_evidence() -> None:
    p = PendingRequest(1, pb.DUMP_FLIGHT_RECORDER, "j", {"n1"})
    p.add("n1", pb.RequestResult(request_id=1, rank=0, ok=True, payload=b"\x80\x04pickle", final=True))
    assert not p.answers[0].ok and "not a JSON object" in p.answers[0].error


def test_stacks_are_parsed_on_arrival() -> None:
    p = PendingRequest(1, pb.CAPTURE_STACKS, "j", {"n1"})
    p.add("n1", _answer(0, {"stacks": ["main"]}, final=True))
    assert p.answers[0].payload == {"stacks": ["main"]} and p.answers[0].raw == b""


def test_evidence_past_the_budget_is_recorded_not_kept() -> None:
    p = PendingRequest(1, pb.DUMP_FLIGHT_RECORDER, "j", {"n1"}, max_bytes=100)
    p.add("n1", _answer(0, {"x": "a" * 40}))
    p.add("n1", _answer(1, {"x": "b" * 80}, final=True))
    assert p.answers[0].ok and not p.answers[1].ok and "budget" in p.answers[1].error
    assert p.done.is_set()
