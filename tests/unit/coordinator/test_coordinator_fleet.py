"""Fleet judgements: version drift, SDC votes across nodes, unhealthy GPUs, culprit lines."""

from __future__ import annotations

from gpuhealth.coordinator.fleet import (
    NodeView,
    SdcVote,
    culprit_line,
    gpu_findings,
    sdc_votes,
    sdc_votes_from_findings,
    unhealthy_gpus,
    version_drift,
)
from gpuhealth.model import Action, Entity, Finding, Severity


def _node(name: str, driver: str, vbios: str = "96.00.99.00.01") -> NodeView:
    return NodeView(name, {"driver": driver, "torch": "2.13.0"},
                    [{"index": 0, "uuid": f"GPU-{name}-0", "name": "H100", "vbios": vbios}])


def test_version_drift_names_the_minority_node() -> None:
    nodes = [_node("a", "570.1"), _node("b", "570.1"), _node("c", "565.9", vbios="96.00.AA")]
    found = version_drift(nodes)
    assert {(f.entity.id, f.evidence["key"]) for f in found} == {("c", "driver"), ("GPU-c-0", "vbios")}
    assert all(f.code == "version.drift" for f in found)
    assert "565.9 differs from the fleet's 570.1 (2 of 3)" in found[0].message
    assert version_drift([_node("a", "570.1"), _node("b", "570.1")]) == []


def test_sdc_vote_flags_the_disagreeing_gpu_only_with_a_majority() -> None:
    votes = [SdcVote(f"GPU-{i}", f"n{i}", "h100-132sm-cublas12.9-fp16-4096", "aa") for i in range(4)]
    votes.append(SdcVote("GPU-9", "n9", "h100-132sm-cublas12.9-fp16-4096", "bb"))
    out = sdc_votes(votes)
    assert [(f.code, f.entity.id, f.evidence["agree"]) for f in out] == [("sdc.mismatch", "GPU-9", 4)]
    assert sdc_votes(votes[:1] + votes[-1:]) == []  # two voters cannot decide
    tie = [SdcVote("g1", "n1", "k", "aa"), SdcVote("g2", "n2", "k", "aa"), SdcVote("g3", "n3", "k", "bb"),
           SdcVote("g4", "n4", "k", "bb")]
    assert sdc_votes(tie) == []  # no majority, no claim


def test_digests_reported_in_findings_are_votes() -> None:
    n = NodeView("n1", findings=[Finding("sdc.pass", Severity.INFO, Entity.gpu("GPU-1", 0), "ok",
                                         evidence={"digest": "aa", "golden_key": "k"})])
    assert sdc_votes_from_findings(n) == [SdcVote("GPU-1", "n1", "k", "aa")]


def test_unhealthy_gpus_and_culprit_line() -> None:
    slow = Finding("throttle.hw_slowdown", Severity.WARNING, Entity.gpu("GPU-b", 1), "GPU 1: HW slowdown active",
                   Action.MONITOR)
    dbe = Finding("ecc.dbe_volatile", Severity.CRITICAL, Entity.gpu("GPU-a", 0), "double-bit ECC", Action.RESET_GPU)
    n = NodeView("n2", gpus=[{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}], findings=[slow, dbe])
    rows = unhealthy_gpus([n])
    assert [(r["gpu"], r["health"], r["action"]) for r in rows] == [(0, "unhealthy", "reset_gpu"),
                                                                    (1, "degraded", "monitor")]
    assert gpu_findings(n, "GPU-b") == [slow]
    assert culprit_line(3, "n2", 1, [slow]) == "rank 3, node n2 GPU 1: GPU 1: HW slowdown active"
    assert culprit_line(3, "n2", 1, []) == "rank 3, node n2 GPU 1: no health findings on this GPU"
