"""The numbers behind periodic diagnostics' findings, as /metrics samples — from real outcomes of a
`qualify --level standard` on 4 x H200."""

from __future__ import annotations

import json
from pathlib import Path

from gpuhealth.diag.metrics import diag_samples
from gpuhealth.diag.runner import DiagOutcome

DOC = json.loads((Path(__file__).parents[2] / "fixtures" / "diag" / "diag_outcomes_4xh200.json").read_text())


BUSBW, BW = "diag_busbw_bytes_per_second", "diag_memory_bandwidth_bytes_per_second"


def _outcomes() -> dict[str, DiagOutcome]:
    return {d["diag"]: DiagOutcome(d["diag"], d["status"], d["reason"], [], d["result"], d["gpu_seconds"],
                                   d["skipped_gpus"], d["gpus"], d["wall_s"]) for d in DOC["diagnostics"]}


def test_measured_bandwidths_and_gpu_time_are_exported_per_gpu_and_collective() -> None:
    gpu_index = {g["uuid"]: g["index"] for g in DOC["gpus"]}
    samples = diag_samples(_outcomes(), {"busbw": 1_800_000_000.0}, gpu_index)
    by = {(s.name, s.gpu, s.labels): s.value for s in samples}
    assert by[("diag_success", None, (("diag", "busbw"),))] == 1.0
    assert by[("diag_last_run_timestamp_seconds", None, (("diag", "busbw"),))] == 1_800_000_000.0
    ar = by[(BUSBW, None,
             (("collective", "all_reduce"), ("size_bytes", str(1 << 30)), ("ranks", "4")))]
    assert 340e9 < ar < 370e9  # 4 x H200 all_reduce at 1 GiB, in bytes per second (base units)
    copies = {s.gpu: s.value for s in samples
              if s.name == BW and s.labels == (("direction", "device_to_device"),)}
    assert sorted(copies) == [0, 1, 2, 3] and all(v > 4000e9 for v in copies.values())
    sdc = {s.gpu: s.value for s in samples if s.name == "diag_gpu_seconds" and s.labels == (("diag", "sdc"),)}
    assert sorted(sdc) == [0, 1, 2, 3] and all(0 < v < 1 for v in sdc.values())


def test_failed_skipped_and_unknown_gpus_export_only_what_is_true() -> None:
    outcomes = _outcomes()
    outcomes["busbw"].status, outcomes["bandwidth"].status = "timeout", "skipped"
    samples = diag_samples(outcomes, {}, {})  # no GPU of this agent matches
    names = {(s.name, s.labels) for s in samples}
    assert ("diag_success", (("diag", "busbw"),)) in names
    assert not any(s.name == "diag_success" and s.labels == (("diag", "bandwidth"),) for s in samples)
    assert not any(s.name in (BUSBW, BW, "diag_gpu_seconds") for s in samples)
    assert next(s.value for s in samples if s.name == "diag_success" and s.labels == (("diag", "busbw"),)) == 0.0


def test_the_agents_diagnostics_extension_exports_them() -> None:
    from types import SimpleNamespace

    from gpuhealth.agent.extensions import _PeriodicDiagnostics

    ext = _PeriodicDiagnostics(3600)
    assert ext.samples() == []  # not started: nothing to say
    ext.periodic = SimpleNamespace(measured=_outcomes, finished_at=lambda: {"sdc": 1.0}, screens=lambda: {})
    ext.agent = SimpleNamespace(gpus=[SimpleNamespace(uuid=g["uuid"], index=g["index"]) for g in DOC["gpus"]])
    names = {s.name for s in ext.samples()}
    assert {"diag_success", BUSBW, BW, "diag_gpu_seconds"} <= names


def test_a_skipped_cycle_keeps_the_last_measurement_and_its_time() -> None:
    from types import SimpleNamespace

    from gpuhealth.diag.periodic import PeriodicDiagnostics

    outcomes = iter([DiagOutcome("busbw", "ok", result={"points": []}),
                     DiagOutcome("busbw", "skipped", reason="every GPU is busy")])

    class Runner:
        def __init__(self, *a: object, **k: object) -> None:
            pass

        def run(self, *a: object, **k: object) -> DiagOutcome:
            return next(outcomes)

    import gpuhealth.diag.periodic as periodic_mod

    saved = periodic_mod.DiagRunner
    periodic_mod.DiagRunner = Runner  # type: ignore[assignment,misc]
    try:
        p = PeriodicDiagnostics(steps=[("busbw", ())])
        agent = SimpleNamespace(config=__import__("gpuhealth.config", fromlist=["Config"]).Config(),
                                gpus=[SimpleNamespace(uuid="GPU-a", index=0)])
        p.run_cycle(agent, None)
        first = p.finished_at()["busbw"]
        p.run_cycle(agent, None)  # skipped: every GPU busy with a job
    finally:
        periodic_mod.DiagRunner = saved
    assert p.latest()["busbw"].status == "skipped"  # findings follow the newest cycle
    assert p.measured()["busbw"].status == "ok" and p.finished_at()["busbw"] == first  # metrics do not
