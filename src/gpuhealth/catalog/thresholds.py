"""Typed health thresholds, loaded from ``thresholds.yaml`` (bundled) or a file named in config.

The bundled file is the one place the default values live: the dataclasses below say which keys
exist and their types, the file says their values and where each comes from. A file named in
config overrides the keys it names; the rest keep the bundled values.

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

from gpuhealth.catalog.xid_policy import XidPolicy, XidPolicyError, parse_xid_policy


class ThresholdsError(ValueError):
    """A malformed thresholds file; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class EccThresholds:
    dbe_volatile_critical: int
    sbe_rate_per_minute_warning: float
    sbe_rate_min_window_s: float


@dataclass(frozen=True, slots=True)
class MemoryThresholds:
    remap_uncorrectable_warning: int
    retired_pages_critical: int
    retired_pages_dbe_warning: int


@dataclass(frozen=True, slots=True)
class ThrottleThresholds:
    sustained_violation_share: float
    violation_min_window_s: float


@dataclass(frozen=True, slots=True)
class ThermalThresholds:
    gpu_warning_c_fallback: float
    gpu_critical_c_fallback: float
    memory_warning_margin_c: float
    memory_critical_c_fallback: float


@dataclass(frozen=True, slots=True)
class PcieThresholds:
    replay_bit_error_rate: float
    replay_window_s: float
    width_degraded_severity: str
    gen_check_min_utilization_pct: float

    def __post_init__(self) -> None:
        if self.width_degraded_severity not in ("info", "warning", "critical"):
            raise ValueError(f"width_degraded_severity: expected info, warning or critical, "
                             f"got {self.width_degraded_severity!r}")


@dataclass(frozen=True, slots=True)
class NvlinkThresholds:
    crc_per_window_warning: int
    crc_per_second_critical: float
    replay_per_window_critical: int
    recovery_per_window_critical: int
    min_window_s: float


@dataclass(frozen=True, slots=True)
class InfinibandThresholds:
    symbol_error_per_hour_warning: float
    link_downed_per_window_warning: int
    rcv_errors_per_hour_warning: float
    min_window_s: float
    xmit_wait_peer_ratio_warning: float
    xmit_wait_min_per_second: float


@dataclass(frozen=True, slots=True)
class EthernetThresholds:
    errors_per_hour_warning: float
    drops_per_hour_warning: float
    carrier_changes_per_window_warning: int
    min_window_s: float


@dataclass(frozen=True, slots=True)
class HostThresholds:
    memory_psi_some_avg60_warning: float
    memory_available_share_warning: float


def _bundled(section: str) -> Any:
    return lambda: getattr(default_thresholds(), section)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Every section; one left out is the bundled file's (``Thresholds()`` is the bundled file)."""

    ecc: EccThresholds = field(default_factory=_bundled("ecc"))
    memory: MemoryThresholds = field(default_factory=_bundled("memory"))
    throttle: ThrottleThresholds = field(default_factory=_bundled("throttle"))
    thermal: ThermalThresholds = field(default_factory=_bundled("thermal"))
    pcie: PcieThresholds = field(default_factory=_bundled("pcie"))
    nvlink: NvlinkThresholds = field(default_factory=_bundled("nvlink"))
    infiniband: InfinibandThresholds = field(default_factory=_bundled("infiniband"))
    ethernet: EthernetThresholds = field(default_factory=_bundled("ethernet"))
    host: HostThresholds = field(default_factory=_bundled("host"))
    xid: XidPolicy = field(default_factory=_bundled("xid"))  # catalog/xid_policy.py


def _section(cls: type[Any], data: Any, where: str, base: Any) -> Any:
    """One section from ``data`` over ``base`` (None: every key must be given)."""
    if data is None:
        data = {}
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
    if base is None:
        missing = [k for k in hints if k not in values]
        if missing:
            raise ThresholdsError(f"{where}: missing {', '.join(missing)}")
    try:
        return cls(**values) if base is None else dataclasses.replace(base, **values)
    except ValueError as exc:
        raise ThresholdsError(f"{where}.{exc}") from exc


def parse_thresholds(data: Any, source: str = "thresholds", *, base: Thresholds | None = None) -> Thresholds:
    """Thresholds from parsed YAML: every key it names, over ``base`` (default: the bundled file)."""
    if data is None:
        return base or default_thresholds()
    if not isinstance(data, Mapping):
        raise ThresholdsError(f"{source}: top level must be a mapping of sections")
    return _parse(data, source, base or default_thresholds())


def _parse(data: Mapping[str, Any], source: str, base: Thresholds | None) -> Thresholds:
    sections = {f.name for f in dataclasses.fields(Thresholds)}
    hints = get_type_hints(Thresholds)
    for name in data:
        if name not in sections:
            raise ThresholdsError(f"{source}: unknown section '{name}'")
    if base is None:
        missing = sorted(sections - set(data))
        if missing:
            raise ThresholdsError(f"{source}: missing section(s) {', '.join(missing)}")
    built = {name: _section(hints[name], data.get(name), f"{source}: {name}",
                            None if base is None else getattr(base, name))
             for name in sections if name != "xid"}
    try:  # the XID policy has per-code rules, not only numbers: its own parser
        built["xid"] = parse_xid_policy(data.get("xid"), f"{source}: xid", None if base is None else base.xid)
    except XidPolicyError as exc:
        raise ThresholdsError(str(exc)) from exc
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
    """The bundled ``thresholds.yaml``, parsed once: the one place the default values live (every
    section and key must be there, with its source named in a comment)."""
    text = (resources.files("gpuhealth") / "catalog" / "thresholds.yaml").read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise ThresholdsError("gpuhealth/catalog/thresholds.yaml: top level must be a mapping of sections")
    return _parse(data, "gpuhealth/catalog/thresholds.yaml", None)


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


__all__ = ["EccThresholds", "EthernetThresholds", "HostThresholds", "InfinibandThresholds", "MemoryThresholds",
           "NvlinkThresholds",
           "PcieThresholds", "ThermalThresholds", "Thresholds", "ThresholdsError", "ThrottleThresholds",
           "default_thresholds", "load_thresholds", "parse_thresholds", "thresholds_from"]
