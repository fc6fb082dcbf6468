"""Host basics: load, memory, uptime, kernel — exported as samples; memory pressure judged.

``host.memory_pressure`` (warning, ``check_job``) only on well-founded evidence: available memory
below a small share of the total, or the kernel's own pressure-stall information (PSI,
``/proc/pressure/memory`` ``some avg60``) above the catalog's limit. Load average alone is not
judged: on a GPU node a high load is usually the data loader doing its job.

The reader is injected (``HostReader``) so tests give real values without touching the host.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuhealth.catalog.thresholds import thresholds_from
from gpuhealth.collectors._shared import is_number, node_entity
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Finding, MetricKind, Sample, Severity

NAME = "host"


@dataclass(frozen=True, slots=True)
class HostFacts:
    load: tuple[float, float, float] | None
    memory_total: int | None
    memory_available: int | None
    swap_used: int | None
    boot_time: float | None
    cpu_count: int | None
    kernel: str
    memory_psi_some_avg60: float | None


class HostReader(Protocol):
    def read(self) -> HostFacts: ...


def parse_psi_some_avg60(text: str) -> float | None:
    """``some avg10=0.00 avg60=1.23 avg300=… total=…`` → 1.23."""
    for line in text.splitlines():
        if line.startswith("some "):
            for tok in line.split()[1:]:
                key, _, val = tok.partition("=")
                if key == "avg60":
                    try:
                        return float(val)
                    except ValueError:
                        return None
    return None


class SystemHostReader:
    """psutil plus ``<proc_root>/pressure/memory``."""

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc") -> None:
        self._proc = Path(proc_root)

    def read(self) -> HostFacts:
        import psutil

        try:
            load: tuple[float, float, float] | None = tuple(os.getloadavg())  # type: ignore[assignment]
        except OSError:
            load = None
        total: int | None
        avail: int | None
        try:
            vm = psutil.virtual_memory()
            total, avail = int(vm.total), int(vm.available)
        except (OSError, psutil.Error):
            total = avail = None
        try:
            swap_used: int | None = int(psutil.swap_memory().used)
        except (OSError, psutil.Error, RuntimeError):
            swap_used = None
        try:
            boot: float | None = float(psutil.boot_time())
        except (OSError, psutil.Error):
            boot = None
        try:
            psi = parse_psi_some_avg60((self._proc / "pressure" / "memory").read_text())
        except OSError:
            psi = None
        return HostFacts(load, total, avail, swap_used, boot, psutil.cpu_count(), platform.release(), psi)


class HostCollector:
    name = NAME
    lane = Lane.FAST
    needs_nvml = False  # keeps running (and reporting) while the GPU driver is down

    def __init__(self, reader: HostReader | None = None) -> None:
        self._reader: HostReader = reader or SystemHostReader()

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        f = self._reader.read()
        n = obs.node
        if f.load is not None:
            n["load1"], n["load5"], n["load15"] = f.load
        n["memory_total"] = f.memory_total
        n["memory_available"] = f.memory_available
        n["swap_used"] = f.swap_used
        n["boot_time"] = f.boot_time
        n["uptime_s"] = None if f.boot_time is None else max(0.0, time.time() - f.boot_time)
        n["cpu_count"] = f.cpu_count
        n["kernel"] = f.kernel
        n["memory_psi_some_avg60"] = f.memory_psi_some_avg60
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).host
        n = obs.node
        reasons: list[str] = []
        total, avail = n.get("memory_total"), n.get("memory_available")
        share = None
        if is_number(total) and is_number(avail) and total > 0:
            share = avail / total
            if share < th.memory_available_share_warning:
                reasons.append(f"only {share:.1%} of {total / 2**30:.0f} GiB memory available")
        psi = n.get("memory_psi_some_avg60")
        if is_number(psi) and psi >= th.memory_psi_some_avg60_warning:
            reasons.append(f"tasks stalled on memory {psi:.0f}% of the last minute (PSI)")
        if not reasons:
            return []
        return [Finding(
            "host.memory_pressure", Severity.WARNING, node_entity(ctx), "host memory pressure: " + "; ".join(reasons),
            Action.CHECK_JOB,
            {"available_share": None if share is None else round(share, 4), "psi_some_avg60": psi,
             "memory_total": total, "memory_available": avail},
            NAME,
        )]

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        n = obs.node
        out: list[Sample] = []
        for key in ("load1", "load5", "load15"):
            if is_number(n.get(key)):
                out.append(Sample("host_load_average", float(n[key]), "System load average by window.",
                                  labels=(("window", key[4:] + "m"),)))
        for key, name, help_ in (
            ("memory_total", "host_memory_total_bytes", "Physical memory in total."),
            ("memory_available", "host_memory_available_bytes", "Memory available without swapping."),
            ("swap_used", "host_swap_used_bytes", "Swap space in use."),
            ("uptime_s", "host_uptime_seconds", "Seconds since boot."),
            ("cpu_count", "host_cpus", "Logical CPUs."),
            ("memory_psi_some_avg60", "host_memory_pressure_ratio",
             "Share of the last 60 s some task stalled on memory (kernel PSI, 0..1)."),
        ):
            v = n.get(key)
            if is_number(v):
                scale = 0.01 if key == "memory_psi_some_avg60" else 1.0
                out.append(Sample(name, float(v) * scale, help_))
        if n.get("kernel"):
            out.append(Sample("host_kernel_info", 1.0, "Running kernel release.", MetricKind.INFO,
                              labels=(("release", str(n["kernel"])),)))
        return out


def create() -> Collector:
    return HostCollector()
