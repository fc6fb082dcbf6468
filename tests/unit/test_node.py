"""collect_once over real recordings and scenarios: the report users see, grouped per GPU."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from gpuhealth.backends.errors import RecordingError
from gpuhealth.backends.kmsg import KmsgLines
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.sysfs import RecordedSysfs
from gpuhealth.catalog.thresholds import ThresholdsError
from gpuhealth.collectors.base import CollectContext, History, Lane, Observations
from gpuhealth.config import Config
from gpuhealth.model import EntityKind, Finding, Health, Sample, Severity
from gpuhealth.node import collect_once, open_backend

FIXTURE_RECORDINGS = Path(__file__).parent.parent / "fixtures" / "recordings"


def _config(**collectors) -> Config:  # type: ignore[no-untyped-def]
    cfg = Config()
    cfg.agent.node_name = "n1"
    for k, v in collectors.items():
        setattr(cfg.collectors, k, v)
    return cfg


def _scenario(tmp_path: Path, **scenario) -> str:  # type: ignore[no-untyped-def]
    scenario.setdefault("recording", "nvml_h200x2.json")
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(scenario))
    return str(path)


def _recordings() -> list[Path]:
    from gpuhealth.backends.nvml_fake import bundled_recording_path

    found = [bundled_recording_path("nvml_h200x2.json"), bundled_recording_path("nvml_h100x1.json")]
    return found + sorted(FIXTURE_RECORDINGS.glob("*.json"))


@pytest.mark.parametrize("recording", _recordings(), ids=lambda p: p.name)
def test_unmodified_real_recordings_are_healthy(recording: Path) -> None:
    backend = open_backend(str(recording))
    report = collect_once(backend, _config())
    bad = [f for f in report.all_findings() if f.severity >= Severity.WARNING]
    assert bad == [], [f.message for f in bad]
    assert report.health is Health.HEALTHY and report.simulated
    assert all(r.success for r in report.runs), [r.error for r in report.runs if not r.success]
    assert len(report.gpus) == backend.device_count() and report.versions["driver"]


def test_open_backend_accepts_bundled_names_and_rejects_bad_files(tmp_path: Path) -> None:
    assert open_backend("nvml_h100x1.json").device_count() == 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": [{"Name": {"value": "x"}, "PciInfo": {"value": {}}}]}))
    with pytest.raises(RecordingError, match=r"bad\.json: devices\[0\]: missing key 'UUID'"):
        open_backend(str(bad))


def test_findings_land_on_their_gpu_and_node(tmp_path: Path) -> None:
    path = _scenario(tmp_path, kmsg=["NVRM: Xid (PCI:0000:00:07): 79, pid=0, GPU has fallen off the bus."],
                     overrides={"0": {"VbiosVersion": "96.00.00.00.01"}})
    report = collect_once(open_backend(path), _config(expected_gpus=4))
    g0, g1 = report.gpus
    assert g0.health is Health.HEALTHY
    assert g1.health is Health.UNHEALTHY and [f.code for f in g1.findings] == ["xid.79"]
    assert {f.code for f in report.findings} >= {"gpu.missing", "version.drift"}
    assert report.health is Health.UNHEALTHY and str(report.action) == "drain"  # 2 GPUs not even on the bus
    doc = report.to_dict()
    assert doc["gpus"][1]["findings"][0]["code"] == "xid.79"
    assert doc["node"]["health"] == "unhealthy" and doc["node"]["simulated"] is True


class Exploding:
    name = "exploding"
    lane = Lane.FAST
    seen: CollectContext | None = None

    def supported(self, ctx: CollectContext) -> bool:
        Exploding.seen = ctx
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        raise RuntimeError("sensor on fire")

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        return []

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        return []


def test_a_failing_collector_is_reported_and_the_rest_still_runs(h200_recording: Path) -> None:
    from gpuhealth.collectors.presence import PresenceCollector

    backend = open_backend(str(h200_recording))
    report = collect_once(backend, _config(), collectors=[Exploding(), PresenceCollector()])
    failed, ok = report.runs
    assert not failed.success and ok.success
    [f] = report.findings
    assert f.code == "collector.failed" and f.entity.kind is EntityKind.NODE
    assert "sensor on fire" in f.message and report.health is Health.DEGRADED
    # The context a simulated sweep gets: the recording's own sysfs and the scenario's kernel log.
    ctx = Exploding.seen
    assert ctx is not None and isinstance(ctx.sysfs, RecordedSysfs) and isinstance(ctx.kmsg, KmsgLines)
    assert ctx.extras["one_shot"] is True and abs(ctx.now - time.time()) < 60


def test_bad_thresholds_file_is_a_clear_error(tmp_path: Path, h200_recording: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("ecc: {dbe_volatile_critical: lots}\n")
    with pytest.raises(ThresholdsError, match="dbe_volatile_critical"):
        collect_once(open_backend(str(h200_recording)), _config(thresholds_file=str(bad)))


def test_disabled_collectors_do_not_run(h200_recording: Path) -> None:
    report = collect_once(open_backend(str(h200_recording)), _config(disabled=["host", "xid"]))
    names = [r.name for r in report.runs]
    assert "host" not in names and "xid" not in names and names[0] == "presence"


def test_simulated_backend_is_replayed_not_live(h200_recording: Path) -> None:
    backend = open_backend(str(h200_recording))
    assert isinstance(backend, FakeNvml) and backend.simulated


def test_live_h200_recording_from_this_project_replays_healthy() -> None:
    """Recorded by ``gpuhealth record --anonymize`` on 2 × H200 (driver 580.159.04), 2026-11-26."""
    path = FIXTURE_RECORDINGS / "nvml_h200x2_live.json"
    backend = open_backend(str(path))
    assert backend.query(0, "GpuFabricInfo")["state"] == 3  # NVSwitch fabric: registration completed
    report = collect_once(backend, _config())
    assert report.health is Health.HEALTHY
    assert [g.identity.uuid for g in report.gpus] == ["GPU-00000000-aaaa-bbbb-cccc-000000000000",
                                                     "GPU-00000001-aaaa-bbbb-cccc-000000000001"]
    assert report.versions["gpus"]["0"]["vbios"] == "96.00.A5.00.1A"
