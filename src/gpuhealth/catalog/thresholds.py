"""Typed health thresholds, loaded from ``thresholds.yaml`` (bundled) or a file named in config.

``thresholds_from(ctx)`` is what collectors call: ``ctx.extras["thresholds"]`` when a caller put
one there (tests, the agent after loading ``collectors.thresholds_file``), else the bundled
default, parsed once and cached.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

import yaml


class ThresholdsError(ValueError):
    """A malformed thresholds file; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class EccThresholds:
    dbe_volatile_critical: int = 1
    sbe_rate_per_minute_warning: float = 10.0
    sbe_rate_min_window_s: float = 60.0


@dataclass(frozen=True, slots=True)
class MemoryThresholds:
    remap_uncorrectable_warning: int = 512
    retired_pages_critical: int = 60
    retired_pages_dbe_warning: int = 15


@dataclass(frozen=True, slots=True)
class ThrottleThresholds:
    sustained_violation_share: float = 0.2
    violation_min_window_s: float = 30.0


@dataclass(frozen=True, slots=True)
class ThermalThresholds:
    gpu_warning_c_fallback: float = 85
    gpu_critical_c_fallback: float = 90
    memory_warning_margin_c: float = 5
    memory_critical_c_fallback: float = 95


@dataclass(frozen=True, slots=True)
class PcieThresholds:
    replay_bit_error_rate: float = 1.0e-12
    replay_window_s: float = 60.0
    width_degraded_severity: str = "critical"
    gen_check_min_utilization_pct: float = 50

    def __post_init__(self) -> None:
        if self.width_degraded_severity not in ("info", "warning", "critical"):
            raise ValueError(f"width_degraded_severity: expected info, warning or critical, "
                             f"got {self.width_degraded_severity!r}")


@dataclass(frozen=True, slots=True)
class NvlinkThresholds:
    crc_per_window_warning: int = 1
    crc_per_second_critical: float = 100.0
    replay_per_window_critical: int = 1
    recovery_per_window_critical: int = 1
    min_window_s: float = 10.0


@dataclass(frozen=True, slots=True)
class InfinibandThresholds:
    symbol_error_per_hour_warning: float = 10.0
    link_downed_per_window_warning: int = 1
    rcv_errors_per_hour_warning: float = 10.0
    min_window_s: float = 60.0


@dataclass(frozen=True, slots=True)
class HostThresholds:
    memory_psi_some_avg60_warning: float = 20.0
    memory_available_share_warning: float = 0.05


@dataclass(frozen=True, slots=True)
class Thresholds:
    ecc: EccThresholds = field(default_factory=EccThresholds)
    memory: MemoryThresholds = field(default_factory=MemoryThresholds)
    throttle: ThrottleThresholds = field(default_factory=ThrottleThresholds)
    thermal: ThermalThresholds = field(default_factory=ThermalThresholds)
    pcie: PcieThresholds = field(default_factory=PcieThresholds)
    nvlink: NvlinkThresholds = field(default_factory=NvlinkThresholds)
    infiniband: InfinibandThresholds = field(default_factory=InfinibandThresholds)
    host: HostThresholds = field(default_factory=HostThresholds)


def _section(cls: type[Any], data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, Mapping):
        raise ThresholdsError(f"{where}: must be a mapping")
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, raw in data.items():
        if key not in hints:
            raise ThresholdsError(f"{where}.{key}: unknown key")
        hint = hints[key]
        if hint is str:
            if not isinstance(raw, str):
                raise ThresholdsError(f"{where}.{key}: expected text, got {raw!r}")
            values[key] = raw
            continue
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ThresholdsError(f"{where}.{key}: expected a number, got {raw!r}")
        if hint is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ThresholdsError(f"{where}.{key}: expected an integer, got {raw!r}")
            values[key] = int(raw)
        else:
            values[key] = float(raw)
    try:
        return cls(**values)
    except ValueError as exc:
        raise ThresholdsError(f"{where}.{exc}") from exc


def parse_thresholds(data: Any, source: str = "thresholds") -> Thresholds:
    if data is None:
        return Thresholds()
    if not isinstance(data, Mapping):
        raise ThresholdsError(f"{source}: top level must be a mapping of sections")
    sections = {f.name: f for f in dataclasses.fields(Thresholds)}
    hints = get_type_hints(Thresholds)
    built: dict[str, Any] = {}
    for name, value in data.items():
        if name not in sections:
            raise ThresholdsError(f"{source}: unknown section '{name}'")
        built[name] = _section(hints[name], value, f"{source}: {name}")
    return Thresholds(**built)


def load_thresholds(path: str | Path) -> Thresholds:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ThresholdsError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ThresholdsError(f"{p}: not valid YAML: {exc}") from exc
    return parse_thresholds(data, str(p))


@functools.cache
def default_thresholds() -> Thresholds:
    """The bundled ``thresholds.yaml``, parsed once."""
    text = (resources.files("gpuhealth") / "catalog" / "thresholds.yaml").read_text()
    return parse_thresholds(yaml.safe_load(text), "gpuhealth/catalog/thresholds.yaml")


@functools.lru_cache(maxsize=8)
def _thresholds_file(path: str) -> Thresholds:
    return load_thresholds(path)


def thresholds_from(ctx: Any) -> Thresholds:
    """Thresholds for a collect context: ``ctx.extras["thresholds"]``, else the file named by
    ``config.collectors.thresholds_file``, else the bundled default (all cached)."""
    extras = getattr(ctx, "extras", None) or {}
    given = extras.get("thresholds") if isinstance(extras, Mapping) else None
    if isinstance(given, Thresholds):
        return given
    cfg = getattr(ctx, "config", None)
    path = getattr(getattr(cfg, "collectors", None), "thresholds_file", None)
    if path:
        return _thresholds_file(str(path))
    return default_thresholds()
