"""Temperatures, power, energy, clocks, utilization, memory and performance state.

Judged: GPU and memory temperature against the GPU's *own* thresholds (NVML
``TemperatureThreshold_*``): at or above "GPU max operating" → ``thermal.gpu_temp`` warning, at or
above "slowdown" → critical (the hardware is already cutting clocks). HBM at or above its max
operating temperature → ``thermal.memory_temp`` critical, within a margin below → warning.
Fallback limits from the thresholds catalog apply only when a GPU does not report its own.
Everything else is exported as samples only.

Static limits (temperature thresholds, max clocks) cost 0.2–1.8 ms per call on Hopper
(docs/measurements.md); they are read once per GPU (keyed by UUID) and cached in the collector. The
energy counter costs ~3 ms per read on H200 (measured): it is refreshed every 60 s and the last
value carried between (Prometheus rates over minutes do not notice).

Also read: encoder/decoder utilization, reserved framebuffer (``MemoryInfo_v2``), and on GPUs with
NVML's GPU Performance Monitoring (Hopper and later, ``GpmMetrics``) the profiling ratios DCGM calls
``DCGM_FI_PROF_*`` (SM active, SM occupancy, tensor active, DRAM active, graphics engine active, PCIe
TX/RX bytes per second), averaged over the time since the previous sweep. A GPU that answers "not supported" once is not
asked again (the answer does not change while the driver is loaded).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from gpuhealth.backends.errors import NvmlError
from gpuhealth.catalog.thresholds import thresholds_from
from gpuhealth.collectors._shared import Periodic, fetch, gpu_entity, is_number, read_fields
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Finding, MetricKind, Sample, Severity

NAME = "telemetry"

_STATIC_KEYS = (
    "TemperatureThreshold_SLOWDOWN",
    "TemperatureThreshold_SHUTDOWN",
    "TemperatureThreshold_GPU_MAX",
    "TemperatureThreshold_MEM_MAX",
    "MaxClockInfo_SM",
    "MaxClockInfo_MEM",
    "MaxClockInfo_GRAPHICS",
)
_CLOCKS = {"sm": "ClockInfo_SM", "memory": "ClockInfo_MEM", "graphics": "ClockInfo_GRAPHICS"}
MEMORY_TEMP_FIELD = "NVML_FI_DEV_MEMORY_TEMP"  # ~7 µs
ENERGY_FIELD = "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"  # ~3 ms on H200: refreshed every ENERGY_REFRESH_S
ENERGY_REFRESH_S = 60.0  # not in step with throttle's 30 s refresh: the costly reads rarely coincide
# GPM metrics read (recording key ``GpmMetrics``): percentages, exported as ratios in ``samples``,
# and PCIe and NVLink traffic in MiB/s, exported in bytes per second.
GPM_METRICS = ("SM_UTIL", "SM_OCCUPANCY", "ANY_TENSOR_UTIL", "DRAM_BW_UTIL", "GRAPHICS_UTIL")
GPM_PCIE = {"PCIE_TX_PER_SEC": "tx", "PCIE_RX_PER_SEC": "rx"}
GPM_NVLINK = {"NVLINK_TOTAL_TX_PER_SEC": "tx", "NVLINK_TOTAL_RX_PER_SEC": "rx"}
# nvmlDeviceGetGridLicensableFeatures: the vGPU feature's code (nvmlGridLicenseFeatureCode_t NVML_..._VGPU)
GRID_FEATURE_VGPU = 1
MIB = float(1 << 20)
# Reads a GPU may answer "not supported" to for good: asked once per GPU, then skipped.
_OPTIONAL_KEYS = ("EncoderUtilization", "DecoderUtilization", "MemoryInfo_v2", "GpmMetrics", "GridLicensableFeatures")


class TelemetryCollector:
    name = NAME
    lane = Lane.FAST

    def __init__(self) -> None:
        self._static: dict[str, dict[str, Any]] = {}  # GPU UUID → static limits
        self._energy = Periodic(ENERGY_REFRESH_S)
        self._unsupported: set[tuple[str, str]] = set()  # (GPU UUID, key) that answered "not supported"

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def _limits(self, ctx: CollectContext, obs: Observations, index: int, uuid: str) -> dict[str, Any]:
        cached = self._static.get(uuid)
        if cached is not None:
            return cached
        limits: dict[str, Any] = {}
        errors_before = len(obs.errors)
        for key in _STATIC_KEYS:
            v = fetch(ctx, obs, index, key)
            if is_number(v):
                limits[key] = v
        if len(obs.errors) == errors_before:  # "Not Supported" is an answer; a failure is retried
            self._static[uuid] = limits
        return limits

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        b = ctx.backend
        for position, g in enumerate(ctx.gpus):
            i = g.index
            rec = obs.gpu(i)
            rec.update(self._limits(ctx, obs, i, g.uuid))
            obs.read(b, i, "Temperature_GPU", store_as="temp_gpu")
            obs.read(b, i, "PowerUsage", store_as="power_mw")
            obs.read(b, i, "EnforcedPowerLimit", store_as="power_limit_mw")
            obs.read(b, i, "PerformanceState", store_as="pstate")
            for label, key in _CLOCKS.items():
                obs.read(b, i, key, store_as=f"clock_mhz.{label}")
            util = fetch(ctx, obs, i, "UtilizationRates")
            if isinstance(util, dict):
                for k in ("gpu", "memory"):
                    if is_number(util.get(k)):
                        rec[f"util_pct.{k}"] = util[k]
            mem = fetch(ctx, obs, i, "MemoryInfo")
            if isinstance(mem, dict):
                for k in ("total", "used", "free"):
                    if is_number(mem.get(k)):
                        rec[f"mem_bytes.{k}"] = mem[k]
            self._optional(ctx, obs, i, g.uuid)
            temp_mem = read_fields(ctx, obs, i, [(MEMORY_TEMP_FIELD, 0)]).get((MEMORY_TEMP_FIELD, 0))
            if is_number(temp_mem):
                rec["temp_memory"] = temp_mem

            def read_energy(i: int = i) -> dict[str, Any]:
                v = read_fields(ctx, obs, i, [(ENERGY_FIELD, 0)]).get((ENERGY_FIELD, 0))
                return {"energy_mj": v} if is_number(v) else {}

            # Spread over sweeps, and half a period away from throttle's violation reads.
            phase = position / max(1, len(ctx.gpus)) + 0.5
            read_at, energy = self._energy.get(g.uuid, ctx.now, read_energy, phase)
            if energy:
                rec.update(energy)
                rec["energy_read_at"] = read_at
        return obs

    def _optional(self, ctx: CollectContext, obs: Observations, index: int, uuid: str) -> None:
        rec = obs.gpu(index)
        for key in _OPTIONAL_KEYS:
            if (uuid, key) in self._unsupported:
                continue
            try:
                value = ctx.backend.query(index, key)
            except NvmlError as exc:
                if exc.not_supported:
                    self._unsupported.add((uuid, key))
                obs.note_error(index, key, exc)
                continue
            if key in ("EncoderUtilization", "DecoderUtilization"):
                # [utilization %, sampling period µs]
                util = value[0] if isinstance(value, (list, tuple)) and value else value
                if is_number(util):
                    rec["enc_pct" if key.startswith("Enc") else "dec_pct"] = util
            elif key == "MemoryInfo_v2":
                if isinstance(value, dict) and is_number(value.get("reserved")):
                    rec["mem_bytes.reserved"] = value["reserved"]
            elif key == "GridLicensableFeatures":
                licensed = vgpu_licensed(value)
                if licensed is not None:
                    rec["vgpu_licensed"] = licensed
            elif isinstance(value, dict):
                for metric, reading in value.items():
                    # GPM computes these between two samples: NaN over an empty interval, never a reading
                    if not is_number(reading) or not math.isfinite(reading) or reading < 0:
                        continue
                    if metric in GPM_METRICS:
                        rec[f"gpm_pct.{metric}"] = reading
                    elif metric in GPM_PCIE:
                        rec[f"gpm_pcie_mib_s.{GPM_PCIE[metric]}"] = reading
                    elif metric in GPM_NVLINK:
                        rec[f"gpm_nvlink_mib_s.{GPM_NVLINK[metric]}"] = reading

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).thermal
        out: list[Finding] = []
        for i, rec in sorted(obs.per_gpu.items()):
            ent = gpu_entity(ctx, i)
            temp = rec.get("temp_gpu")
            if is_number(temp):
                slowdown = rec.get("TemperatureThreshold_SLOWDOWN")
                gpu_max = rec.get("TemperatureThreshold_GPU_MAX")
                crit = slowdown if is_number(slowdown) and slowdown > 0 else th.gpu_critical_c_fallback
                warn = gpu_max if is_number(gpu_max) and gpu_max > 0 else th.gpu_warning_c_fallback
                warn = min(warn, crit)
                ev = {"temperature_c": temp, "warning_c": warn, "critical_c": crit,
                      "shutdown_c": rec.get("TemperatureThreshold_SHUTDOWN")}
                if temp >= crit:
                    out.append(Finding("thermal.gpu_temp", Severity.CRITICAL, ent,
                                       f"GPU {i}: {temp} °C, at or above its slowdown threshold {crit} °C",
                                       Action.DRAIN, ev, NAME))
                elif temp >= warn:
                    out.append(Finding("thermal.gpu_temp", Severity.WARNING, ent,
                                       f"GPU {i}: {temp} °C, at or above its max operating temperature {warn} °C",
                                       Action.MONITOR, ev, NAME))
            tmem = rec.get("temp_memory")
            if is_number(tmem) and tmem > 0:
                mem_max = rec.get("TemperatureThreshold_MEM_MAX")
                crit_m = mem_max if is_number(mem_max) and mem_max > 0 else th.memory_critical_c_fallback
                warn_m = crit_m - th.memory_warning_margin_c
                ev = {"temperature_c": tmem, "warning_c": warn_m, "critical_c": crit_m}
                if tmem >= crit_m:
                    out.append(Finding("thermal.memory_temp", Severity.CRITICAL, ent,
                                       f"GPU {i}: memory at {tmem} °C, at or above its max {crit_m} °C",
                                       Action.DRAIN, ev, NAME))
                elif tmem >= warn_m:
                    out.append(Finding("thermal.memory_temp", Severity.WARNING, ent,
                                       f"GPU {i}: memory at {tmem} °C, within {th.memory_warning_margin_c:g} °C "
                                       f"of its max {crit_m} °C", Action.MONITOR, ev, NAME))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []

        def add(name: str, value: Any, help_: str, i: int, labels: tuple[tuple[str, str], ...] = (),
                kind: MetricKind = MetricKind.GAUGE, scale: float = 1.0) -> None:
            if is_number(value):
                out.append(Sample(name, float(value) * scale, help_, kind, i, labels))

        for i, rec in sorted(obs.per_gpu.items()):
            add("gpu_temperature_celsius", rec.get("temp_gpu"), "GPU temperature by sensor.", i,
                (("sensor", "gpu"),))
            if is_number(rec.get("temp_memory")) and rec["temp_memory"] > 0:
                add("gpu_temperature_celsius", rec.get("temp_memory"), "GPU temperature by sensor.", i,
                    (("sensor", "memory"),))
            for key, which in (("TemperatureThreshold_SLOWDOWN", "slowdown"),
                               ("TemperatureThreshold_SHUTDOWN", "shutdown"),
                               ("TemperatureThreshold_GPU_MAX", "gpu_max"),
                               ("TemperatureThreshold_MEM_MAX", "memory_max")):
                add("gpu_temperature_threshold_celsius", rec.get(key),
                    "The GPU's own temperature limits (NVML thresholds).", i, (("threshold", which),))
            add("gpu_power_watts", rec.get("power_mw"), "Power draw of the GPU board.", i, scale=1e-3)
            add("gpu_power_limit_watts", rec.get("power_limit_mw"), "Enforced power limit.", i, scale=1e-3)
            add("gpu_energy_joules", rec.get("energy_mj"), "Energy used since the driver loaded.", i,
                kind=MetricKind.COUNTER, scale=1e-3)
            add("gpu_performance_state", rec.get("pstate"), "Performance state (0 = P0, fastest).", i)
            for label in _CLOCKS:
                add("gpu_clock_hertz", rec.get(f"clock_mhz.{label}"), "Current clock frequency.", i,
                    (("clock", label),), scale=1e6)
            for key, label in (("MaxClockInfo_SM", "sm"), ("MaxClockInfo_MEM", "memory"),
                               ("MaxClockInfo_GRAPHICS", "graphics")):
                add("gpu_clock_max_hertz", rec.get(key), "Maximum clock frequency.", i, (("clock", label),),
                    scale=1e6)
            add("gpu_utilization_ratio", rec.get("util_pct.gpu"),
                "Share of the last sample period a kernel ran on the GPU (0..1).", i, scale=0.01)
            add("gpu_memory_utilization_ratio", rec.get("util_pct.memory"),
                "Share of the last sample period device memory was read or written (0..1).", i, scale=0.01)
            add("gpu_memory_used_bytes", rec.get("mem_bytes.used"), "Device memory in use.", i)
            add("gpu_memory_total_bytes", rec.get("mem_bytes.total"), "Device memory in total.", i)
            add("gpu_memory_free_bytes", rec.get("mem_bytes.free"), "Device memory free.", i)
            add("gpu_memory_reserved_bytes", rec.get("mem_bytes.reserved"),
                "Device memory the driver reserves (neither free nor usable).", i)
            add("gpu_encoder_utilization_ratio", rec.get("enc_pct"), "Video encoder utilization (0..1).", i,
                scale=0.01)
            add("gpu_decoder_utilization_ratio", rec.get("dec_pct"), "Video decoder utilization (0..1).", i,
                scale=0.01)
            add("gpu_sm_active_ratio", rec.get("gpm_pct.SM_UTIL"),
                "Share of time at least one warp was resident on an SM (GPM; DCGM SM_ACTIVE).", i, scale=0.01)
            add("gpu_sm_occupancy_ratio", rec.get("gpm_pct.SM_OCCUPANCY"),
                "Resident warps over the SMs' maximum (GPM; DCGM SM_OCCUPANCY).", i, scale=0.01)
            add("gpu_tensor_active_ratio", rec.get("gpm_pct.ANY_TENSOR_UTIL"),
                "Share of cycles a tensor pipe was active (GPM).", i, scale=0.01)
            add("gpu_dram_active_ratio", rec.get("gpm_pct.DRAM_BW_UTIL"),
                "Share of cycles the memory interface was busy (GPM; DCGM DRAM_ACTIVE).", i, scale=0.01)
            add("gpu_graphics_active_ratio", rec.get("gpm_pct.GRAPHICS_UTIL"),
                "Share of time the graphics engine was active (GPM).", i, scale=0.01)
            for direction in GPM_PCIE.values():
                add("gpu_pcie_throughput_bytes_per_second", rec.get(f"gpm_pcie_mib_s.{direction}"),
                    "PCIe traffic from (tx) and to (rx) the GPU, headers and payload (GPM).", i,
                    (("direction", direction),), scale=MIB)
            for direction in GPM_NVLINK.values():
                add("gpu_nvlink_throughput_bytes_per_second", rec.get(f"gpm_nvlink_mib_s.{direction}"),
                    "NVLink traffic from (tx) and to (rx) the GPU over all links, headers and payload (GPM).", i,
                    (("direction", direction),), scale=MIB)
            add("gpu_vgpu_licensed", rec.get("vgpu_licensed"),
                "1 when the GPU's vGPU feature is licensed, 0 when not or when it has no vGPU licensing.", i)
        return out


def vgpu_licensed(features: Any) -> int | None:
    """DCGM's reading of nvmlDeviceGetGridLicensableFeatures for a GPU (DCGM_FI_DEV_VGPU_LICENSE_STATUS): 0 where
    the GPU has no licensing, else 1 when its vGPU feature's state is set; None for an answer of another shape."""
    if not isinstance(features, dict) or not is_number(features.get("isGridLicenseSupported")):
        return None
    if not features["isGridLicenseSupported"]:
        return 0
    listed = features.get("gridLicensableFeatures")
    count = features.get("licensableFeaturesCount")
    if not isinstance(listed, list) or not is_number(count):
        return None
    for feature in listed[: int(count)]:
        if isinstance(feature, dict) and feature.get("featureCode") == GRID_FEATURE_VGPU:
            return 1 if is_number(feature.get("featureState")) and feature["featureState"] > 0 else 0
    return 0


def create() -> Collector:
    return TelemetryCollector()
