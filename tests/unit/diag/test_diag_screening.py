"""Screening beside the agent: one result per GPU screened (with its SDC digests), the coordinator's turn
honoured for scheduled screens, screens asked for (epilog, operator), findings that outlive an aborted run."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import Config
from gpuhealth.diag.periodic import PeriodicDiagnostics, Turn
from gpuhealth.diag.runner import DiagOutcome
from gpuhealth.diag.screen import ScreenResult, screen_results
from gpuhealth.model import Action, Entity, Finding, Severity

UUIDS = ("GPU-00000000-1111-2222-3333-444444444440", "GPU-00000001-1111-2222-3333-444444444441")
GPUS = [GpuIdentity(0, UUIDS[0], "NVIDIA H200", "00000000:00:06.0"),
        GpuIdentity(1, UUIDS[1], "NVIDIA H200", "00000000:00:07.0")]


def _sdc_result(uuids: list[str]) -> dict[str, Any]:
    return {"key_id": "k1", "devices": [{"uuid": u, "cases": [{"case": "bf16-8192", "digest": f"d-{i}"},
                                                              {"case": "fp32-4096", "digest": "e"}]}
                                        for i, u in enumerate(uuids)]}


# ``python -m gpuhealth.diag NAME ARGS``: sdc/bandwidth get --device cuda:i,…, quick gets --world N
CHILD = """#!{python}
import json, os, sys
args = sys.argv[3:]
uuids = {uuids!r}
if "--device" in args:
    picked = [uuids[int(d[5:])] for d in args[args.index("--device") + 1].split(",")]
else:
    picked = [uuids[int(i)] for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",")]
sdc = {sdc}
mismatch = {{"code": "sdc.mismatch", "severity": "critical",
            "entity": {{"kind": "gpu", "id": uuids[1], "gpu_index": 1}}, "message": "bf16 digest differs",
            "action": "drain", "evidence": {{}}, "source": "diag.sdc"}}
bad = [mismatch] if uuids[1] in picked and os.environ.get("CORRUPT") else []
if args[0] == "quick":
    result = {{"sdc": {{"diag": "sdc", "status": "ok", "result": sdc, "findings": bad, "gpu_seconds": {{}}}},
              "bandwidth": {{"diag": "bandwidth", "status": "ok", "result": {{"gpus": []}}, "findings": [],
                            "gpu_seconds": {{}}}},
              "busbw": {{"diag": "busbw", "status": "ok", "result": {{}}, "findings": [], "gpu_seconds": {{}}}},
              "argv": args}}
    doc = {{"diag": "quick", "status": "ok", "reason": "", "findings": [], "result": result,
           "gpu_seconds": {{u: 1.0 for u in picked}}}}
else:
    doc = {{"diag": args[0], "status": "ok", "reason": "", "findings": bad if args[0] == "sdc" else [],
           "result": sdc if args[0] == "sdc" else {{"argv": args}}, "gpu_seconds": {{u: 1.0 for u in picked}}}}
print(json.dumps(doc))
"""


class StubAgent:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.simulated = False
        self.gpus = list(GPUS)
        self.node_name = "node-a"


def _setup(tmp_path: Path) -> tuple[Config, str]:
    child = tmp_path / "py"
    child.write_text(CHILD.format(python=sys.executable, uuids=list(UUIDS),
                                  sdc=repr(_sdc_result(["__U0__", "__U1__"])).replace(
                                      "'__U0__'", "uuids[0]").replace("'__U1__'", "uuids[1]")))
    child.chmod(0o755)
    cfg = Config()
    cfg.diag.state_dir = str(tmp_path / "state")
    cfg.diag.golden_dir = str(tmp_path / "golden")
    cfg.diag.screen_block_dir = str(tmp_path / "block")
    cfg.diag.gpu_seconds_per_hour = 100.0
    return cfg, str(child)


def _backend(busy_gpu: int | None = None) -> FakeNvml:
    job = [{"pid": 1, "usedGpuMemory": 1}]
    overrides = {} if busy_gpu is None else {str(busy_gpu): {"ComputeRunningProcesses": job}}
    b = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "overrides": overrides})
    b.init()
    return b


def _wait(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_each_gpu_screened_gets_a_result_with_its_digests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, child = _setup(tmp_path)
    monkeypatch.setenv("CORRUPT", "1")
    sent: list[list[ScreenResult]] = []
    findings: list[list[Finding]] = []
    ext = PeriodicDiagnostics(python=child, on_screens=sent.append, on_findings=findings.append)
    results = ext.run_cycle(StubAgent(cfg), _backend())
    assert [(r.gpu_index, r.level, r.trigger, r.result) for r in results] == [
        (0, "periodic", "schedule", "pass"), (1, "periodic", "schedule", "fail")]
    assert results[1].reason == "sdc: sdc.mismatch"
    assert results[0].digests == (("k1/bf16-8192", "d-0"), ("k1/fp32-4096", "e"))
    assert results[0].started_at <= results[0].finished_at
    assert sent == [results] and ext.screens()[UUIDS[1]] == results[1]
    assert [f.code for f in findings[-1]] == ["sdc.mismatch"]


def test_a_busy_gpu_is_not_screened_and_busbw_needs_every_gpu_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, child = _setup(tmp_path)
    ext = PeriodicDiagnostics(python=child)
    results = ext.run_screen(StubAgent(cfg), _backend(busy_gpu=1), "quick", "epilog")
    assert [(r.gpu_index, r.level, r.trigger, r.result) for r in results] == [(0, "quick", "epilog", "pass")]
    assert ext.latest()["sdc"].gpus == [UUIDS[0]]
    free = ext.run_screen(StubAgent(cfg), _backend(), "quick", "epilog")
    assert [r.gpu_index for r in free] == [0, 1]


def test_quick_screens_ask_for_no_collectives_unless_every_gpu_is_free(tmp_path: Path) -> None:
    cfg, child = _setup(tmp_path)
    seen: list[list[str]] = []

    import gpuhealth.diag.periodic as periodic_mod

    class Recording(periodic_mod.DiagRunner):
        def run(self, diag: str, args: Any = (), **kw: Any) -> DiagOutcome:
            seen.append(list(args))
            return super().run(diag, args, **kw)

    saved = periodic_mod.DiagRunner
    periodic_mod.DiagRunner = Recording  # type: ignore[misc]
    try:
        ext = PeriodicDiagnostics(python=child)
        ext.run_screen(StubAgent(cfg), _backend(busy_gpu=1), "quick", "operator")
        ext.run_screen(StubAgent(cfg), _backend(), "quick", "operator")
    finally:
        periodic_mod.DiagRunner = saved  # type: ignore[misc]
    busy, free = seen
    assert busy[-2:] == ["--collectives", ""]  # the last one counts
    assert free.count("--collectives") == 1 and free[free.index("--collectives") + 1] == "all_reduce,all_gather"


def test_an_aborted_screen_keeps_what_the_last_one_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, child = _setup(tmp_path)
    monkeypatch.setenv("CORRUPT", "1")
    ext = PeriodicDiagnostics(python=child)
    agent = StubAgent(cfg)
    ext.run_cycle(agent, _backend())
    assert [f.code for f in ext.findings()] == ["sdc.mismatch"]
    Path(cfg.diag.screen_block_dir).mkdir()
    (Path(cfg.diag.screen_block_dir) / "job-7").write_text(json.dumps({"holder": "prolog of job 7"}))
    assert ext.run_cycle(agent, _backend()) == []  # held off before it started: nothing screened
    assert [f.code for f in ext.findings()] == ["sdc.mismatch"]  # the drain path still sees it


def test_screen_results_take_the_worst_step() -> None:
    bad = Finding("bandwidth.low", Severity.WARNING, Entity.gpu(UUIDS[0], 0), "slow", Action.MONITOR, {}, "diag")
    outcomes = [DiagOutcome("sdc", "ok", gpus=list(UUIDS), result=_sdc_result(list(UUIDS))),
                DiagOutcome("bandwidth", "ok", findings=[bad], gpus=[UUIDS[0]]),
                DiagOutcome("busbw", "skipped", "needs 2 GPUs", gpus=[UUIDS[1]])]
    r = screen_results(outcomes, GPUS, level="periodic", trigger="schedule", started_at=1.0, finished_at=2.0)
    assert [(x.result, x.reason) for x in r] == [("fail", "bandwidth: bandwidth.low"), ("pass", "")]
    aborted = [DiagOutcome("sdc", "ok", gpus=list(UUIDS)),
               DiagOutcome("bandwidth", "aborted", "pid 9 started on GPU 1", gpus=list(UUIDS))]
    r = screen_results(aborted, GPUS, level="periodic", trigger="schedule", started_at=1.0, finished_at=2.0)
    assert {(x.result, x.reason) for x in r} == {("aborted", "pid 9 started on GPU 1")}
    failed = [DiagOutcome("sdc", "timeout", "no result within 600 s (killed)", gpus=[UUIDS[1]])]
    r = screen_results(failed, GPUS, level="quick", trigger="epilog", started_at=1.0, finished_at=2.0)
    assert [(x.gpu_index, x.result) for x in r] == [(1, "error")] and "timeout" in r[0].reason


def test_a_turn_gates_scheduled_screens_only_while_it_is_valid() -> None:
    turn = Turn(not_before=1000.0, valid_for_s=600.0)
    assert not turn.allows(999.0)  # before the window: wait
    assert turn.allows(1000.0) and turn.allows(1600.0)
    assert turn.allows(1601.0)  # lapsed: the agent's own schedule again
    assert Turn(1000.0, 0.0).allows(10.0)  # no window: no turn


def test_scheduled_screens_wait_for_the_turn_and_asked_ones_do_not(tmp_path: Path) -> None:
    cfg, child = _setup(tmp_path)
    ext = PeriodicDiagnostics(python=child, backend_factory=_backend, tick_s=0.05)
    assert ext.request_screen("quick", "epilog") == (False, "screening is off: diag.enabled is false")
    cfg.diag.interval_s = 0.5  # due again soon after any screen: only the turn holds it back
    ext.set_turn(time.time() + 3600, 600)  # the coordinator: this node's turn is in an hour
    ext.start(StubAgent(cfg))
    try:
        time.sleep(1.0)
        assert ext.cycles == 0 and ext.status()["turn"]["valid_for_s"] == 600
        accepted, why = ext.request_screen("quick", "epilog")  # an epilog does not wait for a turn
        assert accepted, why
        _wait(lambda: ext.cycles == 1, "the epilog's screen")
        assert {r.trigger for r in ext.screens().values()} == {"epilog"}
        assert ext.request_screen("full", "epilog")[0] is False
        ext.set_turn(0, 600)  # the turn is now
        _wait(lambda: ext.cycles == 2, "the scheduled screen inside the turn")
        assert {(r.level, r.trigger) for r in ext.screens().values()} == {("periodic", "schedule")}
    finally:
        ext.stop()


def test_one_screen_at_a_time_and_never_on_a_simulated_backend(tmp_path: Path) -> None:
    cfg, child = _setup(tmp_path)
    sim = StubAgent(cfg)
    sim.simulated = True
    ext = PeriodicDiagnostics(python=child, backend_factory=_backend)
    ext.start(sim)
    accepted, why = ext.request_screen("quick", "operator")
    assert not accepted and "simulated" in why
    cfg.diag.enabled = False
    off = PeriodicDiagnostics(python=child, backend_factory=_backend)
    off.start(StubAgent(cfg))
    assert off.request_screen("quick", "operator") == (False, "screening is off: diag.enabled is false")
    cfg.diag.enabled = True
    busy = PeriodicDiagnostics(python=child, backend_factory=_backend, first_delay_s=3600, tick_s=30)
    busy.start(StubAgent(cfg))
    try:
        assert busy.request_screen("quick", "operator")[0] is True
        second = busy.request_screen("quick", "operator")
        assert second[0] is False and "already running or queued" in second[1]
    finally:
        busy.stop()


def test_a_clock_stepped_back_does_not_postpone_the_schedule_by_the_step(tmp_path: Path) -> None:
    cfg, child = _setup(tmp_path)
    cfg.diag.interval_s = 3600.0
    now = [1_800_000_000.0]
    ext = PeriodicDiagnostics(python=child, backend_factory=_backend, clock=lambda: now[0], first_delay_s=3600,
                              tick_s=0.05)
    ext.start(StubAgent(cfg))
    try:
        time.sleep(0.3)
        now[0] -= 86_400  # NTP steps the clock back a day
        time.sleep(0.3)
        assert ext.cycles == 0  # the hour it was to wait still holds…
        now[0] += 3601
        _wait(lambda: ext.cycles == 1, "the scheduled screen an hour after the step, not a day and an hour")
        assert {r.trigger for r in ext.screens().values()} == {"schedule"}
    finally:
        ext.stop()
