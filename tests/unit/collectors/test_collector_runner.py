"""The runner keeps the agent alive whatever a collector does, and reports what went wrong."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import CollectContext, History, Lane, Observations
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.model import EntityKind, Finding, Sample, Severity


class Scripted:
    """A collector whose collect does what the test says (raise, hang, read keys)."""

    lane = Lane.FAST

    def __init__(self, name: str, behaviour: str = "ok", keys: tuple[str, ...] = ()) -> None:
        self.name = name
        self.behaviour = behaviour
        self.keys = keys
        self.release = threading.Event()
        self.calls = 0

    def supported(self, ctx: CollectContext) -> bool:
        return self.behaviour != "unsupported"

    def collect(self, ctx: CollectContext) -> Observations:
        self.calls += 1
        if self.behaviour == "raise":
            raise ZeroDivisionError("division by zero")
        if self.behaviour == "exit":
            raise SystemExit(4)
        if self.behaviour == "hang":
            self.release.wait(10)
        obs = Observations(collector=self.name, time=ctx.now)
        for g in ctx.gpus:
            for key in self.keys:
                obs.read(ctx.backend, g.index, key)
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        return []

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        return [Sample("x", 1.0, "x")]


def _ctx(backend: FakeNvml) -> CollectContext:
    return CollectContext(backend=backend, config=Config(), gpus=enumerate_gpus(backend), node_name="n1",
                          now=time.time())


def _fake(tmp_path: Path, overrides: dict | None = None, events: list | None = None, clock=None) -> FakeNvml:
    import json

    scenario = {"recording": "nvml_h200x2.json", "overrides": overrides or {}, "events": events or []}
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    fake = FakeNvml.from_file(path, clock=clock) if clock else FakeNvml.from_file(path)
    fake.init()
    return fake


def test_exception_becomes_failed_run_with_collector_failed_finding(h200_recording: Path) -> None:
    fake = FakeNvml.from_file(h200_recording)
    fake.init()
    runner = CollectorRunner(timeout_s=5)
    history = History()
    run = runner.run(Scripted("boom", "raise"), _ctx(fake), history)
    assert not run.success
    assert run.error is not None and "ZeroDivisionError" in run.error
    [f] = run.findings
    assert f.code == "collector.failed" and f.severity is Severity.WARNING
    assert f.entity.kind is EntityKind.NODE and f.entity.id == "n1"
    assert f.evidence["collector"] == "boom" and "division by zero" in f.evidence["error"]
    assert len(history) == 0  # nothing half-collected is kept
    # SystemExit from a collector is caught as well: the agent keeps running.
    run2 = runner.run(Scripted("quitter", "exit"), _ctx(fake), History())
    assert not run2.success and run2.error == "SystemExit: 4"
    runner.close()


def test_success_appends_history_and_records_last_success(h200_recording: Path) -> None:
    fake = FakeNvml.from_file(h200_recording)
    fake.init()
    runner = CollectorRunner(timeout_s=5, clock=lambda: 1234.0)
    history = History()
    run = runner.run(Scripted("ok", keys=("Temperature_GPU",)), _ctx(fake), history)
    assert run.success and run.findings == [] and run.samples
    assert run.observations is not None and run.observations.per_gpu[0]["Temperature_GPU"] == 36
    assert len(history) == 1 and runner.last_success["ok"] == 1234.0
    assert run.summary()["success"] is True
    skipped = runner.run(Scripted("nope", "unsupported"), _ctx(fake), History())
    assert skipped.success and skipped.skipped and skipped.observations is None
    runner.close()


def test_timeout_reports_failure_and_does_not_restart_until_thread_returns(h200_recording: Path) -> None:
    fake = FakeNvml.from_file(h200_recording)
    fake.init()
    runner = CollectorRunner(timeout_s=0.2)
    slow = Scripted("slow", "hang")
    t0 = time.perf_counter()
    run = runner.run(slow, _ctx(fake), History())
    assert time.perf_counter() - t0 < 2
    assert not run.success and run.timed_out and "timed out after 0.2 s" in (run.error or "")
    assert run.findings[0].code == "collector.failed"
    again = runner.run(slow, _ctx(fake), History())
    assert not again.success and "not started again" in (again.error or "")
    assert slow.calls == 1  # the stuck collector was not started a second time
    slow.release.set()
    for _ in range(100):  # the stuck call returns; the collector runs normally again
        time.sleep(0.01)
        slow.behaviour = "ok"
        after = runner.run(slow, _ctx(fake), History())
        if after.success:
            break
    assert after.success and slow.calls == 2
    runner.close()


def test_per_gpu_errors_become_gpu_findings_other_readings_kept(tmp_path: Path) -> None:
    fake = _fake(tmp_path, overrides={"1": {"Temperature_GPU": {"error": "Unknown Error", "code": 999},
                                             "PowerUsage": {"error": "Not Supported", "code": 3}}})
    runner = CollectorRunner(timeout_s=5)
    ctx = _ctx(fake)
    run = runner.run(Scripted("telem", keys=("Temperature_GPU", "PowerUsage")), ctx, History())
    assert run.success
    [f] = run.findings
    assert f.code == "collector.failed" and f.entity.kind is EntityKind.GPU
    assert f.entity.id == ctx.gpus[1].uuid and f.entity.gpu_index == 1
    assert f.evidence["errors"] == [{"key": "Temperature_GPU", "code": 999, "message": "Unknown Error"}]
    obs = run.observations
    assert obs is not None
    assert obs.per_gpu[0]["Temperature_GPU"] == 36 and obs.per_gpu[0]["PowerUsage"] == 80307
    assert (1, "PowerUsage") in obs.unsupported  # "Not Supported" is a normal answer, not a failure
    runner.close()


def test_lost_gpu_is_left_to_presence_collector(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    fake = _fake(tmp_path, events=[{"at": 1, "type": "lost", "gpu": 0}], clock=clock)
    ctx = _ctx(fake)
    clock.advance(2)
    run = CollectorRunner(timeout_s=None).run(Scripted("t", keys=("Temperature_GPU",)), ctx, History())
    assert run.success and run.findings == []
    assert run.observations is not None
    assert [e.code for e in run.observations.errors] == [errors.GPU_IS_LOST]


def test_enumerate_gpus_keeps_a_lost_gpu_with_what_is_known(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    fake = _fake(tmp_path, events=[{"at": 1, "type": "lost", "gpu": 1}], clock=clock)
    before = enumerate_gpus(fake)
    assert [(g.index, g.name, g.pci_bus_id, g.minor) for g in before] == [
        (0, "NVIDIA H200", "00000000:00:06.0", 0), (1, "NVIDIA H200", "00000000:00:07.0", 1)]
    clock.advance(2)
    blind = enumerate_gpus(fake)
    assert blind[1].uuid == "unknown-gpu-1" and blind[1].pci_bus_id == ""
    remembered = enumerate_gpus(fake, before)
    assert remembered[1] == before[1]


def test_enumerate_raises_only_when_count_fails(tmp_path: Path, clock) -> None:  # type: ignore[no-untyped-def]
    fake = _fake(tmp_path, events=[{"at": 1, "type": "driver_unloaded"}], clock=clock)
    clock.advance(2)
    try:
        enumerate_gpus(fake)
    except NvmlError as exc:
        assert exc.driver_gone
    else:
        raise AssertionError("expected NvmlError")
