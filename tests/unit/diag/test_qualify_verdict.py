"""Qualification verdicts: collectors + diagnostics → per-GPU and node health → exit codes."""

from __future__ import annotations

import pytest

from gpuhealth.backends.nvml_fake import FakeNvml, bundled_recording_path
from gpuhealth.cli.exitcodes import exit_code
from gpuhealth.config import Config
from gpuhealth.diag.qualify import LEVELS, plan, verdict
from gpuhealth.diag.runner import DiagOutcome
from gpuhealth.model import Action, Entity, Finding, Health, Severity
from gpuhealth.node import NodeReport, collect_once


def _report(overrides: dict[str, dict[str, object]] | None = None) -> NodeReport:
    backend = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "overrides": overrides or {}})
    backend.init()
    try:
        return collect_once(backend, Config())
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def clean() -> NodeReport:
    return _report()


def _sdc_mismatch(report: NodeReport, index: int, severity: Severity) -> Finding:
    g = report.gpus[index].identity
    return Finding("sdc.mismatch", severity, Entity.gpu(g.uuid, index), "bf16 square mismatch",
                   Action.DRAIN if severity is Severity.CRITICAL else Action.MONITOR,
                   {"datapath": "bf16", "shape": "square"}, "diag.sdc")


def test_all_clear_is_healthy_and_fit(clean: NodeReport) -> None:
    ok = [DiagOutcome("sdc", "ok"), DiagOutcome("busbw", "ok"), DiagOutcome("bandwidth", "ok")]
    r = verdict(clean, ok, "quick")
    assert r.health is Health.HEALTHY and r.fit
    assert [g.health for g in r.gpus] == [Health.HEALTHY, Health.HEALTHY]
    for profile, code in (("default", 0), ("slurm", 0), ("npd", 0), ("nagios", 0)):
        assert exit_code(r.health, profile) == code


def test_a_persistent_sdc_mismatch_makes_that_gpu_and_the_node_unhealthy(clean: NodeReport) -> None:
    sdc = DiagOutcome("sdc", "ok", findings=[_sdc_mismatch(clean, 1, Severity.CRITICAL)])
    r = verdict(clean, [sdc], "standard")
    assert [g.health for g in r.gpus] == [Health.HEALTHY, Health.UNHEALTHY]
    assert r.health is Health.UNHEALTHY and not r.fit
    assert any(reason.startswith("GPU 1: sdc.mismatch") for reason in r.reasons)
    assert r.to_dict()["node"]["action"] == "drain"
    assert [exit_code(r.health, p) for p in ("default", "slurm", "npd", "nagios")] == [2, 1, 1, 2]


def test_a_transient_mismatch_degrades_but_slurm_still_runs_jobs(clean: NodeReport) -> None:
    r = verdict(clean, [DiagOutcome("sdc", "ok", findings=[_sdc_mismatch(clean, 0, Severity.WARNING)])], "quick")
    assert r.health is Health.DEGRADED and r.fit
    assert [exit_code(r.health, p) for p in ("default", "slurm", "npd", "nagios")] == [1, 0, 1, 1]


def test_node_level_diag_findings_stay_on_the_node(clean: NodeReport) -> None:
    low = Finding("busbw.low", Severity.WARNING, Entity.node("vm"), "slow", Action.MONITOR, {}, "diag.busbw")
    r = verdict(clean, [DiagOutcome("busbw", "ok", findings=[low])], "quick")
    assert r.health is Health.DEGRADED
    assert [f.code for f in r.node_findings if f.code == "busbw.low"] == ["busbw.low"]
    assert all(g.health is Health.HEALTHY for g in r.gpus)


def test_diagnostics_that_did_not_run_leave_the_node_not_judged(clean: NodeReport) -> None:
    # Issue 33: the collectors alone are not the level the caller asked for
    skipped = [DiagOutcome("sdc", "skipped", "CUDA is not available"), DiagOutcome("busbw", "skipped", "1 GPU")]
    r = verdict(clean, skipped, "quick")
    assert r.health is Health.UNKNOWN and not r.fit and r.to_dict()["node"]["judged"] is False
    assert [g.health for g in r.gpus] == [Health.UNKNOWN, Health.UNKNOWN]
    assert "sdc skipped: CUDA is not available" in r.reasons
    assert r.not_judged == ["sdc did not run: CUDA is not available", "busbw did not run: 1 GPU"]
    assert [exit_code(r.health, p) for p in ("default", "slurm", "npd", "nagios")] == [3, 1, 2, 3]
    bad = _report({"1": {"TotalEccErrors_UNCORRECTED_VOLATILE": 2}})
    r = verdict(bad, skipped, "quick")
    assert r.health is Health.UNHEALTHY and r.gpus[1].health is Health.UNHEALTHY
    assert r.gpus[1].reasons[0].startswith("ecc.dbe_volatile")


def test_a_diagnostic_that_failed_means_the_node_was_not_checked(clean: NodeReport) -> None:
    r = verdict(clean, [DiagOutcome("sdc", "timeout", "no result within 600 s")], "quick")
    assert r.health is Health.UNKNOWN and not r.fit
    assert [exit_code(r.health, p) for p in ("default", "slurm", "npd", "nagios")] == [3, 1, 2, 3]
    bad = _report({"1": {"TotalEccErrors_UNCORRECTED_VOLATILE": 2}})
    assert verdict(bad, [DiagOutcome("sdc", "failed", "x")], "quick").health is Health.UNHEALTHY


def test_gpus_left_out_are_named_in_the_reasons_and_not_judged(clean: NodeReport) -> None:
    uuid = clean.gpus[1].identity.uuid
    out = DiagOutcome("sdc", "ok", skipped_gpus={uuid: "user processes on the GPU (pids [42])"})
    r = verdict(clean, [out], "quick")
    assert "sdc left out GPU 1: user processes on the GPU (pids [42])" in r.reasons
    assert [g.health for g in r.gpus] == [Health.HEALTHY, Health.UNKNOWN] and r.health is Health.UNKNOWN
    assert r.gpus[1].reasons == ["not judged: sdc left it out: user processes on the GPU (pids [42])"]


def test_busbw_on_one_gpu_does_not_apply_and_withholds_nothing() -> None:
    backend = FakeNvml.from_file(bundled_recording_path("nvml_h100x1.json"))
    backend.init()
    try:
        one = collect_once(backend, Config())
    finally:
        backend.shutdown()
    peers = {"basis": "golden", "cross_checked": True, "compared": "the golden digests"}
    ran = [DiagOutcome("sdc", "ok", result={"reference": peers}), DiagOutcome("busbw", "skipped", "needs 2 GPUs"),
           DiagOutcome("bandwidth", "ok")]
    assert verdict(one, ran, "standard").health is Health.HEALTHY
    # one GPU and no golden: its SDC digests met nothing outside it
    alone = {"basis": "none", "cross_checked": False, "compared": "nothing (one device, one run of each case, …)"}
    r = verdict(one, [DiagOutcome("sdc", "ok", result={"reference": alone}), *ran[1:]], "standard")
    assert r.health is Health.UNKNOWN and r.not_judged[0].startswith("sdc compared nothing (one device")


def test_levels_grow_in_depth() -> None:
    cfg = Config()
    steps = {lvl: plan(lvl, cfg) for lvl in LEVELS}
    # quick: the three diagnostics in one warm process per GPU (diag/quick.py), the same probes
    [quick] = steps["quick"]
    assert quick.diag == "quick" and quick.min_gpus == 1
    assert "all_reduce,all_gather" in quick.args and "--repeats" in quick.args and "--d2d-mib" in quick.args
    assert [s.diag for s in steps["standard"]] == ["sdc", "busbw", "bandwidth"]
    assert "--selftest" in steps["full"][0].args and "--selftest" not in steps["standard"][0].args
    with pytest.raises(ValueError):
        plan("exhaustive", cfg)
