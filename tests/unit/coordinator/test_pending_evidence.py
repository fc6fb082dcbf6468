"""Evidence answers: a node speaks only for its own ranks, once, and a request's evidence is bounded."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from gpuhealth.coordinator.hangs import run_triage
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


def test_a_discovered_ranks_pickled_dump_is_kept_as_bytes_and_read_without_running_anything(tmp_path: Path) -> None:
    """NCCL's own dump (a rank found by discovery, through its FIFO) arrives as ``fr_pickle``: kept as sent,
    a truncated one is an error, and a hostile one planting a global is refused by the analyser's loader."""
    marker = tmp_path / "pwned"
    hostile = pickle.dumps(_Evil(str(marker)), protocol=4)
    plain = pickle.dumps({"version": "2.10", "pg_config": {}, "entries": []}, protocol=4)
    p = PendingRequest(1, pb.DUMP_FLIGHT_RECORDER, "j", {"n1"})
    for rank, payload in enumerate((plain, plain[:-1], hostile)):
        p.add("n1", pb.RequestResult(request_id=1, rank=rank, ok=True, payload=payload, format="fr_pickle"))
    assert p.answers[0].ok and p.answers[0].raw == plain and p.answers[0].format == "fr_pickle"
    assert not p.answers[1].ok and "not a complete pickle" in p.answers[1].error
    assert p.answers[2].ok  # well-formed on the wire: what it would load is the loader's to refuse
    folder = tmp_path / "fr"
    folder.mkdir()
    (folder / "rank_2.pkl").write_bytes(p.answers[2].raw)
    report = run_triage(folder, {"job_id": "j"})
    assert not marker.exists()
    assert report.verdict.value == "incomplete" and any("rank_2.pkl" in str(x) for x in report.to_dict()["problems"])


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.path}",))
