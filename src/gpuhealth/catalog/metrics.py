"""The metric-family catalog: every family the agent and the coordinator expose on ``/metrics``, with
its type, labels, meaning and the file that makes it.

The data lives in ``metrics.csv`` beside this file, one row per family; ``docs/metrics.md`` is
generated from it and from dcgm-exporter's mapping (``exporters/dcgm.py``), and
``tests/unit/catalog/test_catalogs.py`` checks it against what the agent really exposes, both ways.
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources

from gpuhealth.catalog.xid import CatalogError

_COLUMNS = ("name", "type", "labels", "section", "emitted_by", "help")
TYPES = ("gauge", "counter", "info", "summary")
SECTIONS = ("health", "agent", "collectors", "process", "coordinator")
GPU_LABELS = "GPU"  # in ``labels``: the GPU label set


@dataclass(frozen=True, slots=True)
class FamilyInfo:
    name: str  # as exposed: gpuhealth_gpu_energy_joules_total
    type: str
    labels: tuple[str, ...]
    section: str
    emitted_by: str
    help: str

    @property
    def base_name(self) -> str:
        """What the code names it: without ``gpuhealth_`` and the ``_total`` / ``_info`` suffix."""
        name = self.name.removeprefix("gpuhealth_")
        if self.type == "counter":
            return name.removesuffix("_total")
        if self.type == "info":
            return name.removesuffix("_info")
        return name


def parse_families(text: str, where: str) -> dict[str, FamilyInfo]:
    rows = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(rows)))
    if tuple(reader.fieldnames or ()) != _COLUMNS:
        raise CatalogError(f"{where}: header must be {','.join(_COLUMNS)}, got {reader.fieldnames}")
    out: dict[str, FamilyInfo] = {}
    for n, row in enumerate(reader, start=1):
        try:
            info = FamilyInfo(name=row["name"].strip(), type=row["type"].strip(), labels=tuple(row["labels"].split()),
                              section=row["section"].strip(), emitted_by=row["emitted_by"].strip(),
                              help=row["help"].strip())
        except (KeyError, AttributeError) as exc:
            raise CatalogError(f"{where}: data row {n}: {exc!r} in {dict(row)}") from exc
        if info.type not in TYPES or info.section not in SECTIONS:
            raise CatalogError(f"{where}: data row {n}: type must be one of {TYPES}, section one of {SECTIONS}: "
                               f"{dict(row)}")
        if info.name in out:
            raise CatalogError(f"{where}: data row {n}: family {info.name} listed twice")
        out[info.name] = info
    return out


@functools.cache
def metric_families() -> Mapping[str, FamilyInfo]:
    """The bundled catalog, parsed once, by exposed name."""
    text = (resources.files("gpuhealth.catalog") / "metrics.csv").read_text()
    return parse_families(text, "gpuhealth/catalog/metrics.csv")


__all__ = ["FamilyInfo", "metric_families", "parse_families"]
