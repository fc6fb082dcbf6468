"""Readings no GPU can give, stopped before they reach a collector.

Both NVML backends pass every reading through ``check_reading`` / ``check_nvlink`` /
``check_field``: a driver can return garbage too (a struct read before it was filled, a counter
after a bad reset), and a recording or scenario can say anything. A collector handed ``"lots"`` for
an ECC counter, NaN for a temperature or -8 for a PCIe width skipped it and called the GPU healthy;
here such a reading becomes ``BadValue`` — an ``NvmlError`` the collectors record like any failed
reading, which the collector runner reports as ``nvml.bad_value`` (the GPU's health is then unknown,
never a silent "healthy").

The rules are by kind of reading (a counter, a temperature, a link width …), keyed by the
"NVML recording v1" names (``nvml_keys``); any number anywhere in any reading must be finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from gpuhealth.backends.errors import NvmlError

# Not an NVML return code (those stop at 999): NVML answered, with something that cannot be real.
BAD_VALUE = 1000

_MAX_COUNT = (1 << 63) - 1  # counters are unsigned 64-bit in NVML; 2^63 and up is a sentinel or garbage
_MAX_DEPTH = 8  # readings are flat structs; deeper is not a reading


class BadValue(NvmlError):
    """NVML (or a recording) gave ``key`` a value that cannot be real; ``why`` says which rule."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        super().__init__(BAD_VALUE, f"{why}, got {shown}")
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        return (NvmlError, (self.code, self.message))


Rule = Callable[[Any], str | None]  # None when the value is fine, else why it is not


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v: Any) -> str | None:
    if not _is_int(v):
        return "a counter must be an integer"
    return None if 0 <= v <= _MAX_COUNT else "a counter must be >= 0 and < 2^63"


def _counts(v: Any) -> str | None:
    if isinstance(v, Mapping):
        v = list(v.values())
    if not isinstance(v, list):
        return "expected a list of counters"
    return next((why for why in map(_count, v) if why), None)


def _between(low: float, high: float, what: str, *, integer: bool = False) -> Rule:
    def rule(v: Any) -> str | None:
        if not (_is_int(v) if integer else _is_number(v)):
            return f"{what} must be {'an integer' if integer else 'a number'}"
        return None if low <= v <= high else f"{what} must be within {low:g}..{high:g}"
    return rule


def _one_of(allowed: frozenset[int], what: str) -> Rule:
    def rule(v: Any) -> str | None:
        if not _is_int(v) or v not in allowed:
            return f"{what} must be one of {sorted(allowed)}"
        return None
    return rule


def _fields(rule: Rule, *names: str) -> Rule:
    """A struct (dict) whose named fields (all numeric fields when none are named) obey ``rule``."""
    def check(v: Any) -> str | None:
        if not isinstance(v, Mapping):
            return "expected a struct"
        for name in names or tuple(v):
            if name in v and (why := rule(v[name])):
                return f"{name}: {why}"
        return None
    return check


def _text(v: Any) -> str | None:
    return None if isinstance(v, str) else "expected text"


_temperature = _between(-40, 200, "a temperature (°C)")
_threshold = _between(0, 200, "a temperature threshold (°C)")
_percent = _between(0, 100, "a percentage")
_mhz = _between(0, 100_000, "a clock (MHz)")
_milliwatts = _between(0, 10_000_000, "a power (mW)")
_pcie_width = _one_of(frozenset({0, 1, 2, 4, 8, 12, 16, 32}), "a PCIe link width")
_pcie_generation = _between(0, 16, "a PCIe generation", integer=True)

# Exact keys, then prefixes (the first that matches).
_BY_KEY: dict[str, Rule] = {
    "Name": _text, "UUID": _text, "Serial": _text, "VbiosVersion": _text, "InforomImageVersion": _text,
    "GspFirmwareVersion": _text,
    "Temperature_GPU": _temperature, "MarginTemperature": _between(-300, 300, "a temperature margin (°C)"),
    "PcieReplayCounter": _count, "TotalEnergyConsumption": _count, "RemappedRows": _counts,
    "RetiredPages_SBE": _counts, "RetiredPages_DBE": _counts,
    "CurrPcieLinkWidth": _pcie_width, "MaxPcieLinkWidth": _pcie_width,
    "CurrPcieLinkGeneration": _pcie_generation, "MaxPcieLinkGeneration": _pcie_generation,
    "GpuMaxPcieLinkGeneration": _pcie_generation,
    "PowerUsage": _milliwatts, "EnforcedPowerLimit": _milliwatts, "PowerManagementLimit": _milliwatts,
    "PowerManagementDefaultLimit": _milliwatts,
    "UtilizationRates": _fields(_percent, "gpu", "memory"),
    "MemoryInfo": _fields(_count), "MemoryInfo_v2": _fields(_count), "BAR1MemoryInfo": _fields(_count),
    "MinorNumber": _count, "PerformanceState": _between(0, 32, "a P-state", integer=True),
}
_BY_PREFIX: tuple[tuple[str, Rule], ...] = (
    ("TotalEccErrors_", _count),
    ("TemperatureThreshold_", _threshold),
    ("ClockInfo_", _mhz), ("MaxClockInfo_", _mhz),
    ("ViolationStatus_", _fields(_count, "referenceTime", "violationTime")),
)
_NVLINK: dict[str, Rule] = {
    "state": _one_of(frozenset({0, 1}), "an NVLink state"),
    "version": _between(0, 16, "an NVLink version", integer=True),
}


def _rule_for(key: str) -> Rule | None:
    rule = _BY_KEY.get(key)
    if rule is not None:
        return rule
    return next((r for prefix, r in _BY_PREFIX if key.startswith(prefix)), None)


def _not_finite(value: Any, depth: int = 0) -> bool:
    """True when a number anywhere in ``value`` is NaN or infinite (or the value nests implausibly)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if depth > _MAX_DEPTH:
        return True
    if isinstance(value, Mapping):
        return any(_not_finite(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_not_finite(v, depth + 1) for v in value)
    return False


# Not raw readings: ratios computed between two GPM samples (backends/gpm.py), NaN over an empty interval.
_DERIVED = frozenset({"GpmMetrics"})


def check_reading(key: str, value: Any) -> Any:
    """``value`` when it can be a real reading of ``key``; raises ``BadValue`` otherwise."""
    if key in _DERIVED:
        return value
    if _not_finite(value):
        raise BadValue(key, value, "not a finite number")
    rule = _rule_for(key)
    why = rule(value) if rule is not None else None
    if why:
        raise BadValue(key, value, why)
    return value


def check_nvlink(link: int, key: str, value: Any) -> Any:
    """``check_reading`` for one NVLink's reading (error counters are counters)."""
    where = f"nvlink.{link}.{key}"
    if _not_finite(value):
        raise BadValue(where, value, "not a finite number")
    rule = _count if key.startswith("err_") else _NVLINK.get(key)
    why = rule(value) if rule is not None else None
    if why:
        raise BadValue(where, value, why)
    return value


def check_field(name: str, value: Any) -> Any:
    """One field value (``NVML_FI_DEV_*``): the value, or a ``BadValue`` to stand in for it."""
    if _not_finite(value):
        return BadValue(name, value, "not a finite number")
    if not _is_number(value):
        return BadValue(name, value, "a field value must be a number")
    if "TEMP" in name and not name.endswith("_THRESHOLD"):
        why = _temperature(value)
    elif any(part in name for part in ("ERROR", "_ECC_", "REPLAY", "RECOVERY", "CRC")):
        why = _count(value)
    else:
        why = None
    return BadValue(name, value, why) if why else value


__all__ = ["BAD_VALUE", "BadValue", "check_field", "check_nvlink", "check_reading"]
