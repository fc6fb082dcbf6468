"""The family model both dialects of ``/metrics`` fill: ours (``prometheus.py``) and dcgm-exporter's
(``dcgm.py``). A ``Family`` is one metric (name, help, type) and its series; a ``FamilySet`` is the
families of one scrape. Rendering them is ``prometheus.encode_text``'s job, not this module's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

GPU_LABELS = ("gpu", "uuid", "pci_bus_id", "model_name")
# Extension labels may not shadow ours (nor dcgm-exporter's, in compat mode).
RESERVED_LABELS = frozenset(GPU_LABELS) | {"UUID", "device", "modelName", "hostname", "Hostname",
                                           "DCGM_FI_DRIVER_VERSION", "DCGM_FI_SYSTEM_DRIVER_VERSION", "err_code",
                                           "err_msg"}
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Labels = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Family:
    """One metric family. ``series`` holds (shared label prefix, own labels, value): the prefix is
    the same tuple object for every series of one GPU, so its text is rendered once."""

    name: str  # exposed name; counters without ``_total``, info without ``_info``
    help: str
    kind: str  # "gauge" | "counter" | "info" | "unknown"
    series: list[tuple[Labels, Labels, float]] = field(default_factory=list)
    # False: a counter whose samples carry the family's exact name (dcgm-exporter's, no ``_total``), typed
    # ``counter`` in text format 0.0.4 and ``unknown`` in OpenMetrics, which requires the suffix.
    suffixed: bool = True

    def add(self, value: float, own: Labels = (), prefix: Labels = ()) -> None:
        self.series.append((prefix, own, value))

    def exposed_kind(self, openmetrics: bool) -> str:
        """The type a format declares: an unsuffixed counter is ``unknown`` in OpenMetrics."""
        return "unknown" if openmetrics and self.kind == "counter" and not self.suffixed else self.kind

    @property
    def sample_name(self) -> str:
        if self.kind == "counter":
            return self.name + "_total" if self.suffixed else self.name
        if self.kind == "info":
            return self.name + "_info"
        return self.name


class FamilySet:
    """Families of one scrape, by exposed name, in first-use order."""

    def __init__(self) -> None:
        self.by_name: dict[str, Family] = {}

    def get(self, name: str, help_text: str, kind: str) -> Family:
        fam = self.by_name.get(name)
        if fam is None:
            fam = self.by_name[name] = Family(name, help_text, kind)
        return fam

    def __iter__(self) -> Iterator[Family]:
        return iter(self.by_name.values())


def clean_extra_labels(raw: Mapping[str, Mapping[str, str]] | None) -> dict[str, dict[str, str]]:
    """Keep only valid, non-reserved label names with string values (a provider bug must not
    break the scrape or overwrite ``gpu``)."""
    out: dict[str, dict[str, str]] = {}
    if not raw:
        return out
    for uuid, labels in raw.items():
        if not isinstance(labels, Mapping):
            continue
        kept = {
            str(k): str(v)
            for k, v in labels.items()
            if isinstance(k, str) and _LABEL_NAME.match(k) and k not in RESERVED_LABELS and not k.startswith("__")
        }
        if kept:
            out[str(uuid)] = kept
    return out


def merge_label_values(into: dict[str, str], labels: Mapping[str, str]) -> None:
    """Labels of two holders of one GPU (two MIG slices, time-slicing): values joined sorted with
    commas, so the label stays one stable string."""
    for name, value in labels.items():
        old = into.get(name)
        into[name] = value if old is None or old == value else ",".join(sorted(set(old.split(",")) | {value}))


def gpu_holder_labels(raw: Mapping[str, Mapping[str, str]] | None, samples: Iterable[Any],
                      gpus: Iterable[Any]) -> dict[str, dict[str, str]]:
    """Extra labels per GPU UUID, with those the label provider gave a MIG instance (the kubelet
    names ``MIG-…`` UUIDs) put on the GPU the instance belongs to. Which GPU that is comes from the
    ``gpu_mig_instance`` samples (presence collector): ``mig_uuid`` on the parent GPU's index."""
    extra = clean_extra_labels(raw)
    parent = {g.index: g.uuid for g in gpus}
    out = {uuid: dict(labels) for uuid, labels in extra.items()}
    for s in samples:
        if s.name != "gpu_mig_instance" or s.gpu not in parent:
            continue
        mig = dict(s.labels).get("mig_uuid", "")
        if mig in extra:
            merge_label_values(out.setdefault(parent[s.gpu], {}), extra[mig])
    return out


__all__ = ["GPU_LABELS", "RESERVED_LABELS", "Family", "FamilySet", "Labels", "clean_extra_labels", "gpu_holder_labels",
           "merge_label_values"]
