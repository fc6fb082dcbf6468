"""Wire validation: what a well-behaved agent never sends is refused with a message."""

from __future__ import annotations

import math

import pytest

from gpuhealth.model import Entity, Finding, RankIdentity, Severity, StepRecord
from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.convert import (
    WireError,
    finding_from_pb,
    finding_to_pb,
    identity_from_pb,
    identity_to_pb,
    steps_from_pb,
    steps_to_pb,
)


def test_round_trips() -> None:
    recs = [StepRecord("j", 0, 1, 1.7e9, 0.5, 0.3, None), StepRecord("j", 1, 1, 1.7e9, 0.5, None, 0.2)]
    assert steps_from_pb(steps_to_pb("j", recs)).records() == recs
    ident = RankIdentity("j", 3, 4, "h", 42, local_rank=1, gpu_uuid=None, gpu_index=None)
    assert identity_from_pb(identity_to_pb(ident)) == ident
    found = RankIdentity("j", 3, 4, "h", 42, gpu_index=1, found_by="discovered")  # a zero-code rank stays one
    assert identity_from_pb(identity_to_pb(found)) == found
    assert identity_from_pb(pb.RankIdentity(job_id="j", rank=0, world_size=1, found_by="x")).found_by == "hook"
    f = Finding("throttle.hw_slowdown", Severity.WARNING, Entity.gpu("GPU-x", 1), "m", evidence={"a": 1})
    assert finding_from_pb(finding_to_pb(f)) == f


@pytest.mark.parametrize("batch, match", [
    (pb.StepBatch(job_id="j", rank=[0, 1], step=[1], start_time=[1.0], wall_s=[1.0]), "equal length"),
    (pb.StepBatch(job_id="j", rank=[0], step=[1], start_time=[1.0], wall_s=[-1.0]), "not a duration"),
    (pb.StepBatch(job_id="j", rank=[0], step=[1], start_time=[1.0], wall_s=[math.inf]), "not a duration"),
    (pb.StepBatch(job_id="j", rank=[0], step=[1], start_time=[math.nan], wall_s=[1.0]), "finite time"),
    (pb.StepBatch(job_id="", rank=[0], step=[1], start_time=[1.0], wall_s=[1.0]), "job_id"),
    (pb.StepBatch(job_id="j", rank=[0, 1], step=[1, 1], start_time=[1.0, 1.0], wall_s=[1.0, math.nan]), "NaN"),
])
def test_bad_step_batches(batch: pb.StepBatch, match: str) -> None:
    with pytest.raises(WireError, match=match):
        steps_from_pb(batch)


def test_nan_compute_means_not_measured() -> None:
    b = pb.StepBatch(job_id="j", rank=[0], step=[1], start_time=[1.0], wall_s=[1.0], compute_s=[math.nan])
    assert steps_from_pb(b).records()[0].compute_s is None


def test_bad_identities_and_findings() -> None:
    with pytest.raises(WireError, match="rank 4 >= world_size 4"):
        identity_from_pb(pb.RankIdentity(job_id="j", rank=4, world_size=4))
    with pytest.raises(WireError, match="bad severity"):
        finding_from_pb(pb.Finding(code="a.b", severity="fatal", entity_kind="gpu", entity_id="x"))
    with pytest.raises(WireError, match="evidence must be a JSON object"):
        finding_from_pb(pb.Finding(code="a.b", severity="info", entity_kind="gpu", entity_id="x", evidence_json="[1]"))


def test_a_results_wire_form_is_the_message_with_its_payload() -> None:
    """result_message_wire (one copy of a dump) parses as AgentMessage(result=…payload…) for any length."""
    import os

    from gpuhealth.proto import gpuhealth_v1_pb2 as pb
    from gpuhealth.proto.convert import result_message_wire

    for n in (0, 1, 127, 128, 16_383, 16_384, 2 << 20):
        payload = os.urandom(n)
        head = pb.RequestResult(request_id=7, rank=3, ok=True, format="fr_pickle")
        wire = result_message_wire(head, bytearray(payload))
        expected = pb.RequestResult(request_id=7, rank=3, ok=True, format="fr_pickle", payload=payload)
        assert pb.AgentMessage.FromString(wire) == pb.AgentMessage(result=expected), n
