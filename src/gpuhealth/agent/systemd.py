"""What the agent tells systemd (``Type=notify``, ``WatchdogSec=``): READY once it has something true
to say, a STATUS line whenever that changes, WATCHDOG while its scheduler loop comes round.

READY=1 is sent after the first sweep, or as soon as NVML could not be initialised (the agent then
serves ``nvml.unavailable``): a unit that never became ready would be killed and restarted in a loop
by systemd, and report nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuhealth.exporters import ExportSnapshot
from gpuhealth.model import Health
from gpuhealth.runtime.sdnotify import SystemdNotifier

log = logging.getLogger("gpuhealth.agent")


def status_line(snap: ExportSnapshot) -> str:
    """``"8 GPUs: 7 healthy, 1 degraded; node degraded"`` (``SIMULATED, `` first on a recording)."""
    sim = "SIMULATED, " if snap.simulated else ""
    if not snap.nvml_up:
        return f"{sim}NVML unavailable"
    counts: dict[Health, int] = {}
    for g in snap.gpus:
        h = snap.gpu_health(g)
        counts[h] = counts.get(h, 0) + 1
    parts = ", ".join(f"{n} {h}" for h, n in sorted(counts.items()))
    return f"{sim}{len(snap.gpus)} GPUs: {parts or 'none'}; node {snap.node_health()}"


class SystemdReporter:
    """``nvml_attempted()``: has the agent tried to start NVML yet (before that, "NVML down" is not news)."""

    def __init__(self, notifier: SystemdNotifier, nvml_attempted: Callable[[], bool]) -> None:
        self.notifier = notifier
        self._nvml_attempted = nvml_attempted
        self._lock = threading.Lock()
        self._ready_sent = False
        self._stopping = False
        self._last_status = ""
        self._last_watchdog = 0.0

    @property
    def watchdog_interval_s(self) -> float | None:
        return self.notifier.watchdog_interval_s

    def on_snapshot(self, snap: ExportSnapshot) -> None:
        with self._lock:
            if self._stopping:  # STOPPING=1 is the last word
                return
            status = status_line(snap)
            answered = snap.ready or (self._nvml_attempted() and not snap.nvml_up)
            if answered and not self._ready_sent:
                self._ready_sent = True
                self._last_status = status
                log.info("first sweep done: %s" if snap.ready else "serving without NVML: %s", status)
                self.notifier.ready(status)
            elif status != self._last_status and self._ready_sent:
                self._last_status = status
                self.notifier.status(status)

    def on_tick(self) -> None:
        """The scheduler loop's heartbeat: proves to systemd that the loop still comes round."""
        interval = self.notifier.watchdog_interval_s
        if interval is not None and not self._stopping:
            now = time.monotonic()
            if now - self._last_watchdog >= interval:
                self._last_watchdog = now
                self.notifier.watchdog()

    def reloading(self) -> None:
        self.notifier.reloading()

    def reloaded(self, snap: ExportSnapshot) -> None:
        self.notifier.ready(status_line(snap))

    def stopping(self) -> None:
        with self._lock:
            self._stopping = True
            self.notifier.stopping()

    def close(self) -> None:
        self.notifier.close()


__all__ = ["SystemdReporter", "status_line"]
