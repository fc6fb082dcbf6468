"""Temperatures against the GPU's own limits; power/energy/clocks/utilization/memory samples."""

from __future__ import annotations

import pytest
from collector_kit import Sweeper, by_code, context, inline, problems, recording, sample_values, scenario

from gpuhealth.catalog.thresholds import parse_thresholds
from gpuhealth.collectors import telemetry
from gpuhealth.model import Action, MetricKind, Severity


@pytest.mark.parametrize("rec", ["nvml_h200x2.json", "nvml_h100x1.json"])
def test_real_recordings_are_healthy(clock, rec):
    s = Sweeper(telemetry.create(), recording(rec, clock), clock)
    assert s.sweep() == []
    assert s.last_obs.errors == []


def test_samples_are_in_base_units(clock):
    s = Sweeper(telemetry.create(), recording("nvml_h200x2.json", clock), clock)
    s.sweep()
    smp = s.last_samples
    assert sample_values(smp, "gpu_temperature_celsius", 0, sensor="gpu") == [36.0]
    assert sample_values(smp, "gpu_temperature_celsius", 0, sensor="memory") == [39.0]
    assert sample_values(smp, "gpu_power_watts", 0) == [pytest.approx(80.307)]  # recorded 80307 mW
    assert sample_values(smp, "gpu_power_limit_watts", 0) == [pytest.approx(700.0)]
    assert sample_values(smp, "gpu_energy_joules", 0) == [pytest.approx(3199.312)]  # 3199312 mJ
    assert sample_values(smp, "gpu_clock_hertz", 0, clock="sm") == [345e6]
    assert sample_values(smp, "gpu_clock_max_hertz", 0, clock="sm") == [1980e6]
    assert sample_values(smp, "gpu_utilization_ratio", 0) == [0.0]
    assert sample_values(smp, "gpu_memory_used_bytes", 0) == [644939776.0]
    assert sample_values(smp, "gpu_temperature_threshold_celsius", 0, threshold="slowdown") == [89.0]
    energy = [x for x in smp if x.name == "gpu_energy_joules"]
    assert all(x.kind is MetricKind.COUNTER for x in energy)
    assert {x.gpu for x in smp} == {0, 1}


def test_hot_gpu_warning_then_critical_against_its_own_limits(clock):
    b = scenario("hot_gpu.yaml", clock)
    f = Sweeper(telemetry.create(), b, clock).sweep()
    gpu = {x.entity.gpu_index: x for x in by_code(f, "thermal.gpu_temp")}
    assert (gpu[0].severity, gpu[0].action) == (Severity.WARNING, Action.MONITOR)  # 88 ≥ GPU max 87
    assert (gpu[1].severity, gpu[1].action) == (Severity.CRITICAL, Action.DRAIN)  # 92 ≥ slowdown 89
    assert gpu[1].evidence["critical_c"] == 89 and gpu[0].evidence["warning_c"] == 87
    (mem,) = by_code(f, "thermal.memory_temp")
    assert (mem.severity, mem.entity.gpu_index) == (Severity.CRITICAL, 1)  # 96 ≥ HBM max 95
    assert mem.entity.id == b.query(1, "UUID")


def test_memory_temperature_warning_margin(clock):
    b = inline(clock, {"0": {"field_values": {"NVML_FI_DEV_MEMORY_TEMP": 91}}})
    (mem,) = problems(Sweeper(telemetry.create(), b, clock).sweep())
    assert (mem.code, mem.severity) == ("thermal.memory_temp", Severity.WARNING)


def test_fallback_limits_when_the_gpu_does_not_report_its_own(clock):
    unsupported = {"error": "Not Supported", "code": 3}
    over = {k: unsupported for k in ("TemperatureThreshold_SLOWDOWN", "TemperatureThreshold_GPU_MAX")}
    b = inline(clock, {"0": {**over, "Temperature_GPU": 86}})
    (warn,) = problems(Sweeper(telemetry.create(), b, clock).sweep())
    assert warn.severity is Severity.WARNING and warn.evidence["warning_c"] == 85
    th = parse_thresholds({"thermal": {"gpu_warning_c_fallback": 90, "gpu_critical_c_fallback": 95}})
    b2 = inline(clock, {"0": {**over, "Temperature_GPU": 86}})
    assert problems(Sweeper(telemetry.create(), b2, clock, extras={"thresholds": th}).sweep()) == []


def test_static_limits_are_read_once_per_gpu(clock):
    b = recording("nvml_h200x2.json", clock)
    c = telemetry.TelemetryCollector()
    calls: list[str] = []

    class Counting:
        """Wraps the fake backend and counts the slow static reads (no patching)."""

        def __getattr__(self, name: str):
            return getattr(b, name)

        def query(self, index: int, key: str):
            calls.append(key)
            return b.query(index, key)

    wrapped = Counting()
    for _ in range(3):
        ctx = context(wrapped, clock)
        c.collect(ctx)
    assert calls.count("TemperatureThreshold_SHUTDOWN") == 2  # once per GPU, not per sweep
    assert calls.count("Temperature_GPU") == 6


def test_costly_energy_counter_is_refreshed_every_60_s_and_carried_between(clock):
    b = inline(clock, {"0": {"field_values": {"NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 1_000_000}}},
               events=[{"at": 10, "type": "set", "gpu": 0, "key": "field_values",
                        "value": {"NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 2_000_000}}])
    energy_reads: dict[int, list[float]] = {0: [], 1: []}

    class Counting:
        def __getattr__(self, name: str):
            return getattr(b, name)

        def field_values(self, index: int, requests):
            if any(f == telemetry.ENERGY_FIELD for f, _ in requests):
                energy_reads[index].append(clock() - 1000)
            return b.field_values(index, requests)

    s = Sweeper(telemetry.create(), Counting(), clock)
    seen = []
    for _ in range(32):  # t = 0, 5, … 155
        s.sweep()
        seen.append(sample_values(s.last_samples, "gpu_energy_joules", 0)[0])
        clock.advance(5)
    # Every 60 s per GPU, the GPUs' phases spread (and half a period off the throttle reads).
    assert energy_reads == {0: [0.0, 90.0, 150.0], 1: [0.0, 60.0, 120.0]}
    assert seen == [1000.0] * 18 + [2000.0] * 14  # the t=10 change shows at GPU 0's t=90 read
    assert s.last_obs.per_gpu[0]["energy_read_at"] == 1150.0


def test_a_failed_static_read_is_retried_not_cached(clock):
    b = inline(clock, {"0": {"TemperatureThreshold_SLOWDOWN": {"error": "Unknown Error", "code": 999}}},
               events=[{"at": 5, "type": "set", "gpu": 0, "key": "TemperatureThreshold_SLOWDOWN", "value": 89}])
    s = Sweeper(telemetry.create(), b, clock)
    s.sweep()
    assert "TemperatureThreshold_SLOWDOWN" not in s.last_obs.per_gpu[0]
    s.after(5)
    assert s.last_obs.per_gpu[0]["TemperatureThreshold_SLOWDOWN"] == 89


class _LicensedGpmDriver:
    """pynvml-shaped at the hardware boundary: real ctypes structs of the bindings, a GPU with GPM (all metrics,
    NVLink rates included) and vGPU licensing whose vGPU feature is licensed."""

    import pynvml as _n

    c_nvmlGpmMetricsGet_t = _n.c_nvmlGpmMetricsGet_t
    NVML_GPM_METRICS_GET_VERSION = _n.NVML_GPM_METRICS_GET_VERSION
    NVMLError = _n.NVMLError
    locals().update({k: v for k, v in vars(_n).items() if k.startswith("NVML_GPM_METRIC_")})

    def nvmlGpmQueryDeviceSupport(self, handle: object) -> object:
        return type("S", (), {"isSupportedDevice": 1})()

    def nvmlGpmSampleAlloc(self) -> object:
        return self._n.c_nvmlGpmSample_t()

    def nvmlGpmSampleGet(self, handle: object, sample: object) -> None:
        return None

    def nvmlGpmSampleFree(self, sample: object) -> None:
        return None

    def nvmlGpmMetricsGet(self, query: object) -> object:
        for j in range(query.numMetrics):  # type: ignore[attr-defined]
            query.metrics[j].value = 10.0 * (j + 1)  # type: ignore[attr-defined]
            query.metrics[j].nvmlReturn = 0  # type: ignore[attr-defined]
        return query

    def nvmlDeviceGetGridLicensableFeatures(self, handle: object) -> object:
        feats = self._n.c_nvmlGridLicensableFeatures_t()
        feats.isGridLicenseSupported, feats.licensableFeaturesCount = 1, 1
        feats.gridLicensableFeatures[0].featureCode = 1  # NVML_GRID_LICENSE_FEATURE_CODE_VGPU
        feats.gridLicensableFeatures[0].featureState = 1
        return feats


def test_the_recorder_keeps_gpm_nvlink_rates_and_vgpu_licensing_and_a_replay_serves_them(clock):
    import json

    from gpuhealth.backends.gpm import METRICS
    from gpuhealth.backends.recorder import Recorder

    drv = _LicensedGpmDriver()
    rec = Recorder(drv, reps=1)
    gpm = rec._gpm("h0")
    licensing = rec.call(drv.nvmlDeviceGetGridLicensableFeatures, "h0")
    # what `gpuhealth record` writes: plain JSON, every GPM metric by name, NVLink rates included
    gpm, licensing = json.loads(json.dumps(gpm)), json.loads(json.dumps(licensing))
    assert gpm["value"] == {name: 10.0 * (j + 1) for j, name in enumerate(METRICS)}
    assert {"NVLINK_TOTAL_TX_PER_SEC", "NVLINK_TOTAL_RX_PER_SEC"} <= set(gpm["value"])
    assert licensing["value"]["isGridLicenseSupported"] == 1
    b = inline(clock, {"0": {"GpmMetrics": gpm["value"], "GridLicensableFeatures": licensing["value"]}})
    s = Sweeper(telemetry.create(), b, clock)
    s.sweep()
    mib = float(1 << 20)
    tx = gpm["value"]["NVLINK_TOTAL_TX_PER_SEC"] * mib
    assert sample_values(s.last_samples, "gpu_nvlink_throughput_bytes_per_second", 0, direction="tx") == [tx]
    assert sample_values(s.last_samples, "gpu_vgpu_licensed", 0) == [1.0]
    assert sample_values(s.last_samples, "gpu_tensor_active_ratio", 0) == [pytest.approx(0.3)]  # ANY_TENSOR_UTIL 30 %
    # GPU 1 of the recording answered neither: no series rather than a made-up value
    assert sample_values(s.last_samples, "gpu_vgpu_licensed", 1) == []


@pytest.mark.parametrize(("features", "licensed"), [
    ({"isGridLicenseSupported": 0, "licensableFeaturesCount": 0, "gridLicensableFeatures": []}, 0),
    ({"isGridLicenseSupported": 1, "licensableFeaturesCount": 1,
      "gridLicensableFeatures": [{"featureCode": 1, "featureState": 0, "licenseInfo": ""}]}, 0),
    ({"isGridLicenseSupported": 1, "licensableFeaturesCount": 2,
      "gridLicensableFeatures": [{"featureCode": 2, "featureState": 1}, {"featureCode": 1, "featureState": 1}]}, 1),
    ("garbled", None),
])
def test_vgpu_license_status_reads_as_dcgm_reads_it(features, licensed):
    assert telemetry.vgpu_licensed(features) == licensed
