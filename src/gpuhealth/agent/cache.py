"""The agent's memory: the last outcome and a short history per collector, published to readers
(scrapes, /health, extensions) as an immutable ``ExportSnapshot``.

Writers (the scheduler's workers) call ``record``; readers call ``snapshot()``, which returns the
last published object without locking or copying, so a scrape never waits for a collector.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace

from gpuhealth.collectors.base import History
from gpuhealth.collectors.runner import CollectorRun, CollectorStatus
from gpuhealth.exporters import ExportSnapshot, NodeFacts
from gpuhealth.model import Finding, Sample

# Samples of a collector that stopped succeeding stay exported this many intervals, then vanish
# (one missed beat should not punch holes in dashboards; stale readings must not linger).
STALE_AFTER_INTERVALS = 3.0
_FACTS = tuple(f.name for f in fields(NodeFacts))


@dataclass(slots=True)
class _CollectorEntry:
    name: str
    lane: str
    interval_s: float
    history: History
    status: CollectorStatus
    samples: tuple[Sample, ...] = ()
    samples_at: float = 0.0  # wall clock of the run that produced ``samples``
    findings: tuple[Finding, ...] = ()  # of the last successful run (judgements outlive a failed run)
    failure_findings: tuple[Finding, ...] = ()  # collector.failed from the last run, if it failed
    completed_once: bool = False


class Cache:
    """Thread-safe store of collector outcomes; publishes a fresh snapshot after every change."""

    def __init__(self, facts: NodeFacts, *, history_len: int = 64, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._history_len = history_len
        self._facts = facts
        self._entries: dict[str, _CollectorEntry] = {}
        self._listeners: list[Callable[[ExportSnapshot], None]] = []
        self._snapshot = self._build()

    # ------------------------------------------------------------------ registration
    def is_registered(self, name: str) -> bool:
        with self._lock:
            return name in self._entries

    def register(self, name: str, lane: str, interval_s: float) -> History:
        """Declare a collector (idempotent; a reload may change its interval). Returns its history."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                entry = _CollectorEntry(name, lane, interval_s, History(self._history_len),
                                        CollectorStatus(name=name, lane=lane, interval_s=interval_s))
                self._entries[name] = entry
            else:
                entry.lane, entry.interval_s = lane, interval_s
                entry.status = replace(entry.status, lane=lane, interval_s=interval_s)
            return entry.history

    def unregister_except(self, names: Iterable[str]) -> None:
        """Drop collectors a reload removed. Sources published from outside the scheduler (lane
        "external", e.g. periodic diagnostics) are not the scheduler's to drop: they stay."""
        keep = set(names)
        with self._lock:
            for name, entry in list(self._entries.items()):
                if name not in keep and entry.lane != "external":
                    del self._entries[name]
            snap = self._publish()
        self._notify(snap)

    def history(self, name: str) -> History:
        with self._lock:
            return self._entries[name].history

    # ------------------------------------------------------------------ writes
    def record(self, run: CollectorRun) -> None:
        with self._lock:
            entry = self._entries.get(run.name)
            if entry is None:
                return  # unregistered by a reload while it ran
            entry.status = entry.status.after(run)
            entry.completed_once = True
            if run.success:
                entry.samples = tuple(run.samples)
                entry.samples_at = run.finished_at
                entry.findings = tuple(run.findings)
                entry.failure_findings = ()
            else:
                entry.failure_findings = tuple(run.findings)
            snap = self._publish()
        self._notify(snap)

    def mark_unavailable(self, reason: str, *, independent: Iterable[str] = (), keep_findings: Iterable[str] = (),
                         ) -> None:
        """NVML went away: every reading we hold came from a driver that is gone; drop them. Collectors
        in ``independent`` don't use NVML and keep everything; those in ``keep_findings`` keep their
        findings (an XID from the kernel log is still true — often the reason the driver went away)."""
        skip, keep = set(independent), set(keep_findings)
        with self._lock:
            for entry in self._entries.values():
                if entry.name in skip or entry.lane == "external":
                    continue
                if entry.name in keep:
                    entry.samples = ()
                    continue
                entry.samples = ()
                entry.findings = ()
                entry.failure_findings = ()
                if entry.status.success is not None:
                    entry.status = replace(entry.status, success=False, last_error=reason)
            snap = self._publish()
        self._notify(snap)

    def update_facts(self, **changes: object) -> None:
        unknown = set(changes) - set(_FACTS)
        if unknown:
            raise AttributeError(f"NodeFacts has no field(s) {sorted(unknown)}")
        with self._lock:
            self._facts = replace(self._facts, **changes)  # type: ignore[arg-type]
            snap = self._publish()
        self._notify(snap)

    def add_listener(self, callback: Callable[[ExportSnapshot], None]) -> None:
        with self._lock:
            self._listeners.append(callback)

    # ------------------------------------------------------------------ reads
    @property
    def facts(self) -> NodeFacts:
        return self._facts

    def all_completed_once(self) -> bool:
        with self._lock:
            return bool(self._entries) and all(e.completed_once for e in self._entries.values())

    def snapshot(self) -> ExportSnapshot:
        return self._snapshot  # an atomic reference read: no lock, no copy

    def statuses(self) -> dict[str, CollectorStatus]:
        with self._lock:
            return {name: e.status for name, e in self._entries.items()}

    # ------------------------------------------------------------------ internals
    def _publish(self) -> ExportSnapshot:
        self._snapshot = self._build()
        return self._snapshot

    def _notify(self, snap: ExportSnapshot) -> None:
        """Listeners run on the writer's thread, outside the lock; one failing must not stop others."""
        for cb in list(self._listeners):
            try:
                cb(snap)
            except Exception:
                logging.getLogger(__name__).exception("snapshot listener failed")

    def _build(self) -> ExportSnapshot:
        now = self._clock()
        facts = self._facts
        samples: list[Sample] = []
        findings: list[Finding] = []
        statuses: list[CollectorStatus] = []
        for entry in self._entries.values():
            statuses.append(entry.status)
            fresh = now - entry.samples_at <= STALE_AFTER_INTERVALS * entry.interval_s + 1.0
            if entry.samples and (entry.status.success or fresh):
                samples.extend(entry.samples)
            findings.extend(entry.findings)
            findings.extend(entry.failure_findings)
        findings.extend(facts.agent_findings)
        ready = bool(self._entries) and all(e.completed_once for e in self._entries.values())
        return ExportSnapshot(
            **{name: getattr(facts, name) for name in _FACTS},
            generated_at=now,
            ready=ready,
            samples=tuple(samples),
            findings=tuple(findings),
            collectors=tuple(statuses),
        )


__all__ = ["STALE_AFTER_INTERVALS", "Cache"]
