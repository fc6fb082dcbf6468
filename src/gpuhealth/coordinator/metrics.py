"""The coordinator's ``/metrics``: a custom collector over a snapshot the event loop refreshes, in
a private registry, served on its own port (prometheus-client's threaded HTTP server)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

SnapshotFn = Callable[[], dict[str, Any]]


class CoordinatorCollector(Collector):
    """Reads the latest snapshot only; a scrape never touches live coordinator state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = {"jobs": []}

    def update(self, snapshot: dict[str, Any]) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            s = self._snapshot
        p = "gpuhealth_coordinator_"
        yield _gauge(p + "connected_agents", "Agents with an open stream.", s.get("connected", 0))
        yield _gauge(p + "nodes", "Nodes known (registered at least once).", s.get("nodes", 0))
        yield _counter(p + "records", "Records committed (acknowledged to agents).", s.get("records", 0))
        yield _counter(p + "step_records", "Rank-step records ingested.", s.get("step_records", 0))
        yield _counter(p + "duplicate_records", "Resent records ignored (seq already committed).",
                       s.get("duplicates", 0))
        yield _counter(p + "rejected_records", "Records rejected as malformed.", s.get("rejected", 0))
        verdicts = CounterMetricFamily(p + "verdicts", "Verdicts stored, by kind.", labels=["kind"])
        for kind, n in sorted(s.get("verdicts", {}).items()):
            verdicts.add_metric([kind], n)
        yield verdicts
        triage = CounterMetricFamily(p + "triage_reports", "Flight-recorder triages run (hang investigations and "
                                     "live triage), by verdict and the headline root cause's kind.",
                                     labels=["verdict", "root"])
        for (verdict, root), n in sorted(s.get("triage", {}).items()):
            triage.add_metric([verdict, root], n)
        yield triage
        # Per-job series carry ``job_id``, not ``job``: Prometheus reserves ``job`` for the scrape job and
        # would rename ours to ``exported_job``.
        records = CounterMetricFamily(p + "job_step_records", "Rank-step records ingested per job.", labels=["job_id"])
        quant = Metric(p + "job_step_seconds", "Wall step time per job: quantiles over a bounded recent sample; "
                       "_count and _sum over every step record (counters).", "summary")
        scores = GaugeMetricFamily(p + "straggler_score",
                                   "Rank slowness score (compute time / job median; top ranks only).",
                                   labels=["job_id", "rank"])
        stragglers = GaugeMetricFamily(p + "job_stragglers", "Ranks currently flagged as stragglers.",
                                       labels=["job_id"])
        slowdown = GaugeMetricFamily(p + "job_slowdown_ratio", "The whole job's step compute against its own best "
                                     "pace while a job.slowdown is open (every rank slower together: never a "
                                     "straggler); 1 otherwise.", labels=["job_id"])
        hangs = CounterMetricFamily(p + "job_hangs", "Hangs detected per job.", labels=["job_id"])
        stalled = GaugeMetricFamily(p + "job_seconds_since_progress", "Seconds since any rank finished a step.",
                                    labels=["job_id"])
        for job in s.get("jobs", []):
            jid = job["job_id"]
            records.add_metric([jid], job["records"])
            for q, v in sorted(job["quantiles"].items()):
                quant.add_sample(p + "job_step_seconds", {"job_id": jid, "quantile": str(q)}, v)
            quant.add_sample(p + "job_step_seconds_count", {"job_id": jid}, job.get("step_count", 0))
            quant.add_sample(p + "job_step_seconds_sum", {"job_id": jid}, job.get("step_sum", 0.0))
            for rank, score in job["scores"]:
                scores.add_metric([jid, str(rank)], score)
            stragglers.add_metric([jid], job["stragglers"])
            slowdown.add_metric([jid], job.get("slowdown_ratio", 1.0))
            hangs.add_metric([jid], job["hangs"])
            stalled.add_metric([jid], job["stalled_s"])
        yield from (records, quant, scores, stragglers, slowdown, hangs, stalled)
        hangs_total = CounterMetricFamily(p + "hangs", "Hangs detected, all jobs.")
        hangs_total.add_metric([], s.get("hangs", 0))
        yield hangs_total
        yield from _screening(s)


def _screening(s: dict[str, Any]) -> Iterator[Metric]:
    """Fleet screening (issue 18): coverage, the oldest screen, turns, screens received."""
    f = "gpuhealth_fleet_"
    yield _gauge(f + "screen_coverage_ratio", "GPUs with a completed (pass or fail) screen within the "
                 "window (coordinator.screen_window_s, 24 h) / GPUs known from registrations; 1 when none is known.",
                 s.get("screen_coverage_ratio", 1.0))
    yield _gauge(f + "screen_oldest_age_seconds", "Seconds since the GPU screened longest ago completed "
                 "a screen (a never-screened GPU counts from when the coordinator first saw it).",
                 s.get("screen_oldest_age_s", 0.0))
    yield _gauge(f + "gpus_unscreened", "GPUs known with no completed screen within the window.",
                 s.get("gpus_unscreened", 0))
    yield _gauge(f + "gpus", "GPUs known from registrations (of nodes heard from within the retention).",
                 s.get("gpus_known", 0))
    yield _gauge(f + "screen_turns", "Nodes holding a screening turn now.", s.get("screen_turns", 0))
    screens = CounterMetricFamily(f + "screens", "Screens received from agents, by level and result.",
                                  labels=["level", "result"])
    for (level, result), n in sorted(s.get("screens", {}).items()):
        screens.add_metric([level, result], n)
    yield screens
    # (named after the prefix, as the catalog test looks for the family: coordinator_…)
    yield _counter("gpuhealth_" + "coordinator_foreign_screens", "Screens an agent reported for GPUs its node has not "
                   "registered: dropped, neither kept nor voted.", s.get("foreign_screens", 0))
    yield _counter("gpuhealth_" + "coordinator_foreign_sdc_digests", "SDC digest records' digests for GPUs the "
                   "reporting node has not registered: dropped, neither stored nor voted.",
                   s.get("foreign_digests", 0))


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def make_registry(collector: CoordinatorCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
