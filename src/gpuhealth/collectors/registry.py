"""The one explicit list of collectors (node_exporter style: one file each, listed here).

Each module exposes ``create() -> Collector``. ``all_collectors(config)`` builds fresh instances
(collectors may keep state, e.g. the XID ledger) minus ``config.collectors.disabled``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from gpuhealth.collectors.base import Collector

if TYPE_CHECKING:
    from gpuhealth.config import Config

# Order is the order of a sweep and of the status table: cheap identity first, heavy reads last.
COLLECTOR_MODULES: tuple[str, ...] = (
    "presence",
    "versions",
    "xid",
    "ecc",
    "throttle",
    "telemetry",
    "pcie",
    "nvlink",
    "numa",
    "infiniband",
    "ethernet",
    "host",
)


class UnknownCollector(ValueError):
    """``collectors.disabled`` names a collector that does not exist (a typo would silently do nothing)."""


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"gpuhealth.collectors.{name}")


def all_collectors(config: Config | None = None) -> list[Collector]:
    """Fresh instances of every registered collector not disabled in ``config``."""
    disabled = set(config.collectors.disabled) if config is not None else set()
    unknown = disabled - set(COLLECTOR_MODULES)
    if unknown:
        raise UnknownCollector(f"collectors.disabled: unknown collector(s) {sorted(unknown)}; "
                               f"known: {', '.join(COLLECTOR_MODULES)}")
    out: list[Collector] = []
    for name in COLLECTOR_MODULES:
        if name in disabled:
            continue
        out.append(_module(name).create())
    return out


__all__ = ["COLLECTOR_MODULES", "UnknownCollector", "all_collectors"]
