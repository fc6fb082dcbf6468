"""XID policy: how gpuhealth judges an XID (and an NVSwitch SXid), as data a config overrides.

The catalog (``xid.csv``) says what each XID means and its default severity and action. The policy
is the ``xid`` section of the thresholds file (bundled ``thresholds.yaml``; a site's own file via
``collectors.thresholds_file`` overrides what it names):

```yaml
xid:
  escalate_count: 3          # the same hardware XID this many times on one GPU …
  escalate_window_s: 3600    # … within this window → critical, action = the catalog's repeat_action
  codes:                     # per XID: any of severity, action, repeat_action, escalate_count,
    "13": {severity: warning, escalate_count: 20, escalate_window_s: 600, escalate_action: drain}
    "31": {escalate_count: 0}                     # 0: never escalate by count
  sxid_codes:                # NVSwitch SXids (kernel log): fatal ones are critical/drain by default
    "12028": {severity: info, action: none}
```

An XID also escalates when it comes back on a GPU after that GPU was reset (the remedy did not
help): that stays, whatever the count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuhealth.model import Action, Severity

_RULE_KEYS = ("severity", "action", "repeat_action", "escalate_count", "escalate_window_s", "escalate_severity",
              "escalate_action")


class XidPolicyError(ValueError):
    """A malformed ``xid`` section; the message names the key."""


@dataclass(frozen=True, slots=True)
class XidRule:
    """Overrides for one code; None keeps the catalog's (or the section's) value."""

    severity: Severity | None = None
    action: Action | None = None
    repeat_action: Action | None = None
    escalate_count: int | None = None
    escalate_window_s: float | None = None
    escalate_severity: Severity | None = None
    escalate_action: Action | None = None


@dataclass(frozen=True, slots=True)
class Escalation:
    count: int  # 0: off
    window_s: float
    severity: Severity
    action: Action | None  # None: the catalog's repeat_action


@dataclass(frozen=True, slots=True)
class XidPolicy:
    """The values live in the bundled thresholds.yaml (its ``xid`` section), not here."""

    escalate_count: int
    escalate_window_s: float
    codes: Mapping[int, XidRule]
    sxid_codes: Mapping[int, XidRule]

    def rule(self, code: int) -> XidRule:
        return self.codes.get(code) or XidRule()

    def sxid_rule(self, code: int) -> XidRule:
        return self.sxid_codes.get(code) or XidRule()

    def escalation(self, code: int, hardware: bool) -> Escalation:
        """Count-in-window escalation for ``code``: the section's default applies to hardware XIDs;
        an application XID escalates by count only when its own rule says so."""
        r = self.rule(code)
        count = r.escalate_count if r.escalate_count is not None else (self.escalate_count if hardware else 0)
        window = r.escalate_window_s if r.escalate_window_s is not None else self.escalate_window_s
        return Escalation(count, window, r.escalate_severity or Severity.CRITICAL, r.escalate_action)


def _severity(raw: Any, where: str) -> Severity:
    try:
        return Severity.parse(str(raw))
    except (KeyError, ValueError) as exc:
        raise XidPolicyError(f"{where}: expected info, warning or critical, got {raw!r}") from exc


def _action(raw: Any, where: str) -> Action:
    try:
        return Action.parse(str(raw))
    except (KeyError, ValueError) as exc:
        raise XidPolicyError(f"{where}: expected none, monitor, check_job, reset_gpu, reboot, drain or rma, "
                             f"got {raw!r}") from exc


def _number(raw: Any, where: str, integer: bool) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or raw < 0:
        raise XidPolicyError(f"{where}: expected a number ≥ 0, got {raw!r}")
    if integer and isinstance(raw, float) and not raw.is_integer():
        raise XidPolicyError(f"{where}: expected an integer, got {raw!r}")
    return int(raw) if integer else float(raw)


def _rule(data: Any, where: str) -> XidRule:
    if not isinstance(data, Mapping):
        raise XidPolicyError(f"{where}: must be a mapping of {', '.join(_RULE_KEYS)}")
    values: dict[str, Any] = {}
    for key, raw in data.items():
        at = f"{where}.{key}"
        if key in ("severity", "escalate_severity"):
            values[key] = _severity(raw, at)
        elif key in ("action", "repeat_action", "escalate_action"):
            values[key] = _action(raw, at)
        elif key == "escalate_count":
            values[key] = int(_number(raw, at, True))
        elif key == "escalate_window_s":
            values[key] = _number(raw, at, False)
        else:
            raise XidPolicyError(f"{at}: unknown key (known: {', '.join(_RULE_KEYS)})")
    return XidRule(**values)


def _codes(data: Any, where: str) -> dict[int, XidRule]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise XidPolicyError(f"{where}: must map codes to rules")
    out: dict[int, XidRule] = {}
    for raw_code, rule in data.items():
        try:
            code = int(str(raw_code))
        except ValueError as exc:
            raise XidPolicyError(f"{where}: {raw_code!r} is not a code number") from exc
        if code < 0:
            raise XidPolicyError(f"{where}: {raw_code!r} is not a code number")
        out[code] = _rule(rule, f"{where}.{raw_code}")
    return out


def parse_xid_policy(data: Any, where: str, base: XidPolicy | None) -> XidPolicy:
    """The ``xid`` section over ``base`` (None: the section must be complete). Per-code rules given
    replace the base's rule for that code; codes not named keep it."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise XidPolicyError(f"{where}: must be a mapping")
    known = {"escalate_count", "escalate_window_s", "codes", "sxid_codes"}
    for key in data:
        if key not in known:
            raise XidPolicyError(f"{where}.{key}: unknown key (known: {', '.join(sorted(known))})")
    if base is None:
        missing = [k for k in ("escalate_count", "escalate_window_s") if k not in data]
        if missing:
            raise XidPolicyError(f"{where}: missing {', '.join(missing)}")
        base = XidPolicy(0, 0.0, {}, {})
    changes: dict[str, Any] = {}
    if "escalate_count" in data:
        changes["escalate_count"] = int(_number(data["escalate_count"], f"{where}.escalate_count", True))
    if "escalate_window_s" in data:
        changes["escalate_window_s"] = _number(data["escalate_window_s"], f"{where}.escalate_window_s", False)
    if "codes" in data:
        changes["codes"] = {**base.codes, **_codes(data["codes"], f"{where}.codes")}
    if "sxid_codes" in data:
        changes["sxid_codes"] = {**base.sxid_codes, **_codes(data["sxid_codes"], f"{where}.sxid_codes")}
    return dataclasses.replace(base, **changes)


__all__ = ["Escalation", "XidPolicy", "XidPolicyError", "XidRule", "parse_xid_policy"]
