"""Peer voting, golden comparison and re-run classification (pure logic)."""

from __future__ import annotations

from gpuhealth.diag.compare import (
    Basis,
    CaseInfo,
    DeviceRef,
    Persistence,
    classify,
    find_suspects,
    majority,
    suspect_finding,
)
from gpuhealth.model import Action, Severity

CASE = CaseInfo("bf16/square/8192x8192x8192", "bf16", "square", (8192, 8192, 8192))


def test_majority_needs_more_than_half() -> None:
    assert majority(["a", "a", "b"]) == "a"
    assert majority(["a", "b"]) is None
    assert majority(["a", "a", "b", "b"]) is None
    assert majority([]) is None


def test_identical_devices_always_agree() -> None:
    results = {f"cuda:{i}": {CASE.case_id: "d1", "x": "d2"} for i in range(8)}
    assert find_suspects(results, None) == ([], [])
    assert find_suspects(results, {CASE.case_id: "d1", "x": "d2"}) == ([], [])


def test_a_corrupted_peer_is_outvoted() -> None:
    results = {f"cuda:{i}": {CASE.case_id: "good"} for i in range(8)}
    results["cuda:5"] = {CASE.case_id: "bad"}
    suspects, _ = find_suspects(results, None)
    assert [(s.device, s.observed, s.expected, s.basis) for s in suspects] == [
        ("cuda:5", "bad", "good", Basis.PEERS)]


def test_golden_wins_over_a_wrong_majority_and_two_gpus_that_disagree_are_decided_by_it() -> None:
    results = {"cuda:0": {CASE.case_id: "good"}, "cuda:1": {CASE.case_id: "bad"}}
    suspects, _ = find_suspects(results, None)
    assert {s.device for s in suspects} == {"cuda:0", "cuda:1"}  # undecided without a golden
    assert all(s.basis is Basis.UNDECIDED for s in suspects)
    suspects, _ = find_suspects(results, {CASE.case_id: "good"})
    assert [(s.device, s.basis) for s in suspects] == [("cuda:1", Basis.GOLDEN)]


def test_unanimous_peers_against_the_golden_is_a_node_level_warning_not_a_gpu_fault() -> None:
    results = {"cuda:0": {CASE.case_id: "new"}, "cuda:1": {CASE.case_id: "new"}}
    suspects, stale = find_suspects(results, {CASE.case_id: "old"})
    assert suspects == [] and stale == [CASE.case_id]


def test_a_single_gpu_is_judged_against_the_golden() -> None:
    suspects, _ = find_suspects({"cuda:0": {CASE.case_id: "bad"}}, {CASE.case_id: "good"})
    assert [s.basis for s in suspects] == [Basis.GOLDEN]
    assert find_suspects({"cuda:0": {CASE.case_id: "x"}}, None) == ([], [])


def test_reruns_tell_transient_from_persistent() -> None:
    assert classify("bad", "good", ["bad", "bad"]) is Persistence.PERSISTENT
    assert classify("bad", "good", ["good", "good"]) is Persistence.TRANSIENT
    assert classify("bad", "good", ["bad", "good"]) is Persistence.NONDETERMINISTIC
    assert classify("bad", "good", ["other", "other"]) is Persistence.NONDETERMINISTIC
    assert classify("bad", "good", []) is Persistence.UNKNOWN


def test_findings_name_gpu_datapath_and_shape_with_severity_by_persistence() -> None:
    suspects, _ = find_suspects({"cuda:0": {CASE.case_id: "g"}, "cuda:1": {CASE.case_id: "g"},
                                 "cuda:2": {CASE.case_id: "b"}}, None)
    dev = DeviceRef("cuda:2", "GPU-abc", 2, "NVIDIA H100")
    persistent = suspect_finding(suspects[0], dev, CASE, Persistence.PERSISTENT, ["b", "b"])
    assert persistent.code == "sdc.mismatch"
    assert persistent.entity.id == "GPU-abc" and persistent.entity.gpu_index == 2
    assert persistent.evidence["datapath"] == "bf16" and persistent.evidence["shape"] == "square"
    assert "bf16 square 8192x8192x8192" in persistent.message and "GPU 2" in persistent.message
    assert persistent.severity is Severity.CRITICAL and persistent.action is Action.DRAIN
    transient = suspect_finding(suspects[0], dev, CASE, Persistence.TRANSIENT, ["g", "g"])
    assert transient.severity is Severity.WARNING and transient.action is Action.MONITOR
