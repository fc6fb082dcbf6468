"""``/metrics``: the agent's cached ``ExportSnapshot`` as Prometheus metrics.

A scrape never calls NVML: it reads the last published snapshot. ``build_families`` turns the
snapshot into ``Family`` objects (name, help, type, series); then either
- ``encode_text`` writes text format 0.0.4 directly (the common path: GPU label sets are rendered
  once per GPU per scrape, which keeps an 8-GPU scrape of ~1,500 series at a few milliseconds), or
- ``SnapshotCollector`` — a prometheus-client custom collector in a *private* ``CollectorRegistry``
  (nothing a library registers globally leaks in) — yields the same families as
  prometheus-client ``Metric``s, used for OpenMetrics negotiation and by anyone who wants them.

Conventions: base units (seconds, bytes, watts, joules, celsius, hertz, ratios), counters end in
``_total``, metadata in ``_info`` series of value 1, GPU series carry ``gpu``, ``uuid``,
``pci_bus_id``, ``model_name`` (plus extension labels such as ``pod``), no hostname label (the
scrape target names the node). Every metric is listed in ``docs/metrics.md``.

NVLink: per-link series (18 links × state and three error counters per Hopper GPU) were almost half
of an 8-GPU scrape. By default they are summed per GPU (errors by ``counter``; the state per link
is left to ``gpuhealth_gpu_nvlink_links{which}`` and the ``nvlink.link_down`` finding, which names
the link); ``nvlink_per_link=True`` exports every link.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CollectorRegistry, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.samples import Sample as PromSample

from gpuhealth.exporters import ExportSnapshot
from gpuhealth.exporters.families import Family, FamilySet, Labels, gpu_holder_labels
from gpuhealth.model import EntityKind, MetricKind, Sample

PREFIX = "gpuhealth_"
SnapshotSource = Callable[[], ExportSnapshot]
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"


def gpu_label_sets(snap: ExportSnapshot) -> dict[int, Labels]:
    extra = gpu_holder_labels(snap.gpu_labels, snap.samples, snap.gpus)
    out: dict[int, Labels] = {}
    for g in snap.gpus:
        labels: Labels = (("gpu", str(g.index)), ("uuid", g.uuid), ("pci_bus_id", g.pci_bus_id),
                          ("model_name", g.name))
        out[g.index] = labels + tuple(sorted(extra.get(g.uuid, {}).items()))
    return out


_KIND = {MetricKind.GAUGE: "gauge", MetricKind.COUNTER: "counter", MetricKind.INFO: "info"}


def _family_name(sample_name: str, kind: MetricKind) -> str:
    name = sample_name if sample_name.startswith(PREFIX) else PREFIX + sample_name
    if kind is MetricKind.COUNTER and name.endswith("_total"):
        name = name[: -len("_total")]
    elif kind is MetricKind.INFO and name.endswith("_info"):
        name = name[: -len("_info")]
    return name


# Per-link samples and what the per-GPU view does with them: summed over links, or left out.
PER_LINK_SAMPLES: dict[str, str] = {"gpu_nvlink_errors": "sum", "gpu_nvlink_state": "drop"}


def _per_gpu_links(samples: Iterable[Sample]) -> list[Sample]:
    """The samples with per-link NVLink series summed per GPU (``link`` label dropped)."""
    out: list[Sample] = []
    sums: dict[tuple[str, MetricKind, int | None, Labels], list[Any]] = {}
    for s in samples:
        how = PER_LINK_SAMPLES.get(s.name)
        if how is None or not any(k == "link" for k, _ in s.labels):
            out.append(s)
            continue
        if how == "drop":
            continue
        rest = tuple((k, v) for k, v in s.labels if k != "link")
        key = (s.name, s.kind, s.gpu, rest)
        acc = sums.get(key)
        if acc is None:
            sums[key] = [s.value, s.help]
        else:
            acc[0] += s.value
    for (name, kind, gpu, rest), (value, help_text) in sums.items():
        out.append(Sample(name, value, help_text, kind, gpu, rest))
    return out


def build_families(snap: ExportSnapshot, *, dcgm_compat: bool = False, nvlink_per_link: bool = False,
                   dcgm_hostname_label: str = "auto", dcgm_schema: str = "4.10") -> FamilySet:
    fams = FamilySet()
    gpu_labels = gpu_label_sets(snap)
    unknown_gpu: dict[int, Labels] = {}

    # --- readings the collectors produced
    by_sample_name: dict[tuple[str, MetricKind], Family] = {}
    for s in snap.samples if nvlink_per_link else _per_gpu_links(snap.samples):
        fam = by_sample_name.get((s.name, s.kind))
        if fam is None:
            fam = by_sample_name[(s.name, s.kind)] = fams.get(_family_name(s.name, s.kind), s.help, _KIND[s.kind])
        if s.gpu is None:
            fam.series.append(((), s.labels, s.value))
            continue
        prefix = gpu_labels.get(s.gpu)
        if prefix is None:
            prefix = unknown_gpu.setdefault(s.gpu, (("gpu", str(s.gpu)),))
        fam.series.append((prefix, s.labels, s.value))

    # --- identity and health per GPU
    info = fams.get(PREFIX + "gpu", "GPU identity (value 1).", "info")
    health = fams.get(PREFIX + "gpu_health",
                      "GPU health derived from its findings: 0 healthy, 1 degraded, 2 unhealthy, 3 unknown.", "gauge")
    for gpu in snap.gpus:
        prefix = gpu_labels[gpu.index]
        info.add(1.0, prefix=prefix)
        health.add(float(snap.gpu_health(gpu).value), prefix=prefix)
    fams.get(PREFIX + "node_health",
             "Node health (worst of its findings): 0 healthy, 1 degraded, 2 unhealthy, 3 unknown.",
             "gauge").add(float(snap.node_health().value))

    _findings(fams, snap, gpu_labels)

    # --- collector health
    success = fams.get(PREFIX + "collector_success", "1 if the collector's last run succeeded, else 0.", "gauge")
    duration = fams.get(PREFIX + "collector_duration_seconds", "Duration of the collector's last run.", "gauge")
    last_ok = fams.get(PREFIX + "collector_last_success_timestamp_seconds",
                       "When the collector last succeeded (seconds since the epoch).", "gauge")
    runs = fams.get(PREFIX + "collector_runs", "Collector runs completed or abandoned.", "counter")
    errors = fams.get(PREFIX + "collector_errors", "Collector runs that failed (raised or timed out).", "counter")
    timeouts = fams.get(PREFIX + "collector_timeouts", "Collector runs abandoned past their timeout.", "counter")
    interval = fams.get(PREFIX + "collector_interval_seconds", "How often the collector is scheduled.", "gauge")
    for c in snap.collectors:
        own: Labels = (("collector", c.name),)
        if c.success is not None:
            success.add(1.0 if c.success else 0.0, own)
        if c.duration_s is not None:
            duration.add(c.duration_s, own)
        if c.last_success_time is not None:
            last_ok.add(c.last_success_time, own)
        runs.add(float(c.runs_total), own)
        errors.add(float(c.errors_total), own)
        timeouts.add(float(c.timeouts_total), own)
        interval.add(c.interval_s, (("collector", c.name), ("lane", c.lane)))

    # --- the agent itself
    sim = "true" if snap.simulated else "false"
    fams.get(PREFIX + "build", "gpuhealth build (value 1).", "info").add(
        1.0, (("version", snap.version), ("python_version", platform.python_version()), ("simulated", sim)))
    fams.get(PREFIX + "simulated",
             "1 when readings are replayed from a recording or scenario, not read from a live driver.",
             "gauge").add(1.0 if snap.simulated else 0.0)
    fams.get(PREFIX + "backend", "Where readings come from (value 1).", "info").add(
        1.0, (("backend", snap.backend), ("simulated", sim)))
    env = snap.environment
    if env is not None:
        fams.get(PREFIX + "node_environment", "Where the agent runs (value 1): bare metal, VM guest or container, "
                 "its namespaces and the NVSwitches it sees; checks that cannot see say so as info findings.",
                 "info").add(1.0, tuple((k, _tristate(env.get(k))) for k in _ENVIRONMENT_LABELS))
    fams.get(PREFIX + "nvml_up", "1 when NVML answered at the last attempt, 0 while it is being re-initialised.",
             "gauge").add(1.0 if snap.nvml_up else 0.0)
    fams.get(PREFIX + "nvml_reinits", "Times NVML was re-initialised after the driver or a GPU went away.",
             "counter").add(float(snap.nvml_reinits_total))
    fams.get(PREFIX + "ready", "1 once every collector completed its first run.", "gauge").add(
        1.0 if snap.ready else 0.0)
    fams.get(PREFIX + "snapshot_timestamp_seconds", "When the exported state last changed.", "gauge").add(
        snap.generated_at)

    if dcgm_compat:
        from gpuhealth.exporters.dcgm import add_dcgm_families

        add_dcgm_families(fams, snap, dcgm_hostname_label, dcgm_schema)
    return fams


def _findings(fams: FamilySet, snap: ExportSnapshot, gpu_labels: Mapping[int, Labels]) -> None:
    fam = fams.get(PREFIX + "findings",
                   "Active findings by code and severity: one series per finding code and entity, value = "
                   "number of findings (see docs/metrics.md).", "gauge")
    by_uuid = {g.uuid: g.index for g in snap.gpus}
    counts: dict[tuple[Labels, Labels], int] = {}
    for f in snap.findings:
        own: Labels = (("code", f.code), ("severity", str(f.severity)), ("action", str(f.action)),
                       ("entity_kind", f.entity.kind.value), ("entity", f.entity.id))
        index = f.entity.gpu_index
        if index is None and f.entity.kind is EntityKind.GPU:
            index = by_uuid.get(f.entity.id)
        prefix = gpu_labels.get(index, ()) if index is not None else ()
        key = (prefix, own)
        counts[key] = counts.get(key, 0) + 1
    for (prefix, own), n in counts.items():
        fam.add(float(n), own, prefix)


_ENVIRONMENT_LABELS = ("kind", "virtualization", "container", "host_pid_namespace", "host_network_namespace",
                       "nvswitches_visible")


def _tristate(value: Any) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ---------------------------------------------------------------------------- text format 0.0.4
def _escape_value(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return v


def _escape_help(h: str, openmetrics: bool) -> str:
    h = h.replace("\\", "\\\\").replace("\n", "\\n")
    return h.replace('"', '\\"') if openmetrics else h


def _label_text(labels: Labels) -> str:
    return ",".join(f'{k}="{_escape_value(v)}"' for k, v in labels)


def _value_text(v: float) -> str:
    if v != v:
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def encode_text(families: Iterable[Family], *, openmetrics: bool = False, end: bool = True) -> bytes:
    """Text exposition format 0.0.4, or OpenMetrics 1.0 (family names without the counter/info
    suffix in ``# TYPE``, ``# EOF`` at the end). Families without series are left out. ``end=False``
    leaves the OpenMetrics ``# EOF`` off, for a body assembled from parts."""
    lines: list[str] = []
    prefix_text: dict[int, str] = {}
    own_text: dict[Labels, str] = {}  # the same few own-label sets repeat on every GPU
    for fam in families:
        if not fam.series:
            continue
        name = fam.sample_name
        if openmetrics:
            lines.append(f"# HELP {fam.name} {_escape_help(fam.help, True)}")
            lines.append(f"# TYPE {fam.name} {fam.exposed_kind(True)}")
        else:
            lines.append(f"# HELP {name} {_escape_help(fam.help, False)}")
            lines.append(f"# TYPE {name} {_TEXT_TYPE.get(fam.kind, fam.kind)}")
        for prefix, own, value in fam.series:
            if own:
                otext = own_text.get(own)
                if otext is None:
                    otext = own_text[own] = _label_text(own)
            else:
                otext = ""
            if prefix:
                key = id(prefix)
                ptext = prefix_text.get(key)
                if ptext is None:
                    ptext = prefix_text[key] = _label_text(prefix)
                labels = f"{ptext},{otext}" if otext else ptext
            else:
                labels = otext
            if labels:
                lines.append(f"{name}{{{labels}}} {_value_text(value)}")
            else:
                lines.append(f"{name} {_value_text(value)}")
    lines.append("# EOF\n" if openmetrics and end else "")
    return "\n".join(lines).encode()


_TEXT_TYPE = {"info": "gauge", "unknown": "untyped"}


# ---------------------------------------------------------------------------- prometheus-client view
def to_metric(fam: Family) -> Metric:
    metric = Metric(fam.name, fam.help, fam.exposed_kind(True))
    sample_name = fam.sample_name
    for prefix, own, value in fam.series:
        metric.samples.append(PromSample(sample_name, dict(prefix + own), value, None, None))
    return metric


class SnapshotCollector:
    """prometheus-client custom collector: ``collect()`` renders the newest snapshot from ``source``."""

    def __init__(self, source: SnapshotSource, *, dcgm_compat: bool = False, nvlink_per_link: bool = False,
                 dcgm_hostname_label: str = "auto", dcgm_schema: str = "4.10") -> None:
        self.source = source
        self.dcgm_compat = dcgm_compat
        self.nvlink_per_link = nvlink_per_link
        self.dcgm_hostname_label = dcgm_hostname_label
        self.dcgm_schema = dcgm_schema

    def describe(self) -> list[Metric]:
        return []  # dynamic families: registering must not trigger a collect

    def families(self) -> FamilySet:
        return build_families(self.source(), dcgm_compat=self.dcgm_compat, nvlink_per_link=self.nvlink_per_link,
                              dcgm_hostname_label=self.dcgm_hostname_label, dcgm_schema=self.dcgm_schema)

    def collect(self) -> Iterator[Metric]:
        for fam in self.families():
            if fam.series:
                yield to_metric(fam)


class MetricsEndpoint:
    """What ``/metrics`` serves: a private registry with the snapshot collector and this process's
    ``process_*`` metrics. ``render`` negotiates the format (``Accept``, as prometheus-client's
    ``choose_encoder`` does) and writes it with ``encode_text``; ``registry`` gives the same metrics
    to prometheus-client tooling (``generate_latest(endpoint.registry)``)."""

    def __init__(self, source: SnapshotSource, *, dcgm_compat: bool = False, process_metrics: bool = True,
                 nvlink_per_link: bool = False, dcgm_hostname_label: str = "auto",
                 dcgm_schema: str = "4.10") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector(source, dcgm_compat=dcgm_compat, nvlink_per_link=nvlink_per_link,
                                           dcgm_hostname_label=dcgm_hostname_label, dcgm_schema=dcgm_schema)
        self.registry.register(self.collector)
        self._cached: tuple[ExportSnapshot, tuple[int, bool, bool, bool, str, str], bytes] | None = None
        self._process: ProcessCollector | None = None
        if process_metrics:
            self._process = ProcessCollector(registry=self.registry)

    @property
    def dcgm_compat(self) -> bool:
        return self.collector.dcgm_compat

    @dcgm_compat.setter
    def dcgm_compat(self, enabled: bool) -> None:
        self.collector.dcgm_compat = enabled

    @property
    def nvlink_per_link(self) -> bool:
        return self.collector.nvlink_per_link

    @nvlink_per_link.setter
    def nvlink_per_link(self, enabled: bool) -> None:
        self.collector.nvlink_per_link = enabled

    def render(self, accept_header: str | None = None, *, nvlink_per_link: bool | None = None) -> tuple[bytes, str]:
        """Text format 0.0.4 by default; OpenMetrics when ``Accept`` asks for it. ``nvlink_per_link``
        overrides the endpoint's NVLink view for this scrape. The snapshot part is cached per
        snapshot, so scrapes between two collector runs (a second Prometheus, a curl) cost only the
        process metrics."""
        _, content_type = choose_encoder(accept_header or "")
        openmetrics = content_type.startswith("application/openmetrics-text")
        per_link = self.collector.nvlink_per_link if nvlink_per_link is None else nvlink_per_link
        snap = self.collector.source()
        c = self.collector
        key = (id(snap), c.dcgm_compat, openmetrics, per_link, c.dcgm_hostname_label, c.dcgm_schema)
        cached = self._cached
        if cached is not None and cached[0] is snap and cached[1] == key:
            body = cached[2]
        else:
            body = encode_text(build_families(snap, dcgm_compat=c.dcgm_compat, nvlink_per_link=per_link,
                                              dcgm_hostname_label=c.dcgm_hostname_label, dcgm_schema=c.dcgm_schema),
                               openmetrics=openmetrics, end=False)
            self._cached = (snap, key, body)
        tail = b"# EOF\n" if openmetrics else b""
        if self._process is not None:
            tail = encode_text([_from_metric(m) for m in self._process.collect()], openmetrics=openmetrics)
        return body + tail, OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_CONTENT_TYPE


def _from_metric(m: Metric) -> Family:
    kind = m.type if m.type in ("gauge", "counter", "info") else "unknown"
    fam = Family(m.name, m.documentation, kind)
    for s in m.samples:
        fam.series.append(((), tuple(s.labels.items()), s.value))
    return fam


__all__ = [
    "OPENMETRICS_CONTENT_TYPE",
    "PREFIX",
    "TEXT_CONTENT_TYPE",
    "MetricsEndpoint",
    "SnapshotCollector",
    "build_families",
    "encode_text",
]
