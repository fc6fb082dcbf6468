"""Clock-event (throttle) reasons and violation-time counters.

NVML's ``CurrentClocksEventReasons`` is a bitmask of why the clocks are below their maximum *now*.
Idle, application-clock settings, display clocks and sync boost are not problems. SW power cap is
the normal way a busy GPU holds its power limit: info only. HW slowdown (clocks cut by half or
more), HW thermal, HW power brake (an external signal from the chassis) and SW thermal are.

The HW power brake is also how a facility caps power on purpose (the BMC asserts it): one sweep that sees it
is a warning; it means drain only when sustained — its violation counter above ``sustained_violation_share``
of the window, or its bit set in every sweep for at least ``violation_min_window_s`` (drivers without the
counter).

HW slowdown is the umbrella bit: NVML sets it together with HW thermal or HW power brake, so a
finding names the most specific reason and reports ``throttle.hw_slowdown`` only when it is alone.

The bitmask is a snapshot; throttling between polls shows in the violation counters (nanoseconds
spent throttled, per policy, read in one field-values batch every 30 s — the batch costs ~1.3 ms
per GPU on H200, too much for every 5 s sweep): their growth over the last minute, as a share of
wall time, catches it (DCGM's thermal/power watches warn on any growth). A share above
``sustained_violation_share`` turns an instantaneous warning into a sustained one (action ``drain``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuhealth.catalog.thresholds import thresholds_from
from gpuhealth.collectors._shared import (
    Periodic,
    earlier_reading,
    fetch,
    gpu_entity,
    gpu_key,
    increase,
    is_number,
    read_fields,
)
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Finding, MetricKind, Sample, Severity

NAME = "throttle"


@dataclass(frozen=True, slots=True)
class Reason:
    bit: int
    name: str  # label value and evidence key
    text: str
    code: str | None  # finding code, None when the reason is not a problem
    severity: Severity
    action: Action


REASONS: tuple[Reason, ...] = (
    Reason(0x1, "gpu_idle", "GPU idle", None, Severity.INFO, Action.NONE),
    Reason(0x2, "applications_clocks", "application clocks setting", None, Severity.INFO, Action.NONE),
    Reason(0x4, "sw_power_cap", "SW power cap", "throttle.sw_power_cap", Severity.INFO, Action.MONITOR),
    Reason(0x8, "hw_slowdown", "HW slowdown", "throttle.hw_slowdown", Severity.WARNING, Action.MONITOR),
    Reason(0x10, "sync_boost", "sync boost", None, Severity.INFO, Action.NONE),
    Reason(0x20, "sw_thermal", "SW thermal slowdown", "throttle.sw_thermal", Severity.WARNING, Action.MONITOR),
    Reason(0x40, "hw_thermal", "HW thermal slowdown", "throttle.hw_thermal", Severity.WARNING, Action.DRAIN),
    Reason(0x80, "hw_power_brake", "HW power brake slowdown", "throttle.hw_power_brake", Severity.WARNING,
           Action.MONITOR),  # drain when sustained: a BMC caps power through it on purpose
    Reason(0x100, "display_clocks", "display clock setting", None, Severity.INFO, Action.NONE),
)
_SPECIFIC_HW = 0x40 | 0x80  # when either is set, HW slowdown (0x8) is implied

# Violation counters (ns), one batch. Label value → NVML field.
VIOLATION_FIELDS: dict[str, str] = {
    "power": "NVML_FI_DEV_PERF_POLICY_POWER",
    "thermal": "NVML_FI_DEV_PERF_POLICY_THERMAL",
    "sync_boost": "NVML_FI_DEV_PERF_POLICY_SYNC_BOOST",
    "board_limit": "NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT",
    "low_utilization": "NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION",
    "reliability": "NVML_FI_DEV_PERF_POLICY_RELIABILITY",
    "sw_thermal": "NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN",
    "hw_thermal": "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN",
    "hw_power_brake": "NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN",
}
# Refresh period of the violation counters, and how far back their growth is judged: DCGM samples
# its thermal/power violation watches at most every 30 s and judges the last minute.
VIOLATION_REFRESH_S = 30.0
VIOLATION_WINDOW_S = 60.0

# Violation counters that mean a problem reason was active (→ the reason they stand for).
_COUNTER_REASON = {"sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80}
# Reasons also sustained when their bit stays set in every sweep over the window (no counter needed).
_SUSTAINED_BY_BIT = frozenset({0x80})


def decode(mask: int) -> list[Reason]:
    return [r for r in REASONS if mask & r.bit]


def problem_reasons(mask: int) -> list[Reason]:
    """The reasons that deserve a finding, HW slowdown folded into a more specific HW reason."""
    active = [r for r in decode(mask) if r.code is not None]
    if mask & _SPECIFIC_HW:
        active = [r for r in active if r.bit != 0x8]
    return active


class ThrottleCollector:
    name = NAME
    lane = Lane.FAST

    def __init__(self) -> None:
        # The violation batch costs ~1.7 ms per GPU on H200: read it every VIOLATION_REFRESH_S only.
        self._violations = Periodic(VIOLATION_REFRESH_S)

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        requests = [(f, 0) for f in VIOLATION_FIELDS.values()]
        for position, g in enumerate(ctx.gpus):
            i = g.index
            rec = obs.gpu(i)
            mask = fetch(ctx, obs, i, "CurrentClocksEventReasons")
            if mask is None:  # older drivers: the deprecated name
                mask = fetch(ctx, obs, i, "CurrentClocksThrottleReasons")
            if is_number(mask):
                rec["reasons"] = int(mask)

            def read_violations(i: int = i) -> dict[str, Any]:
                values = read_fields(ctx, obs, i, requests)
                return {label: int(v) for label, f in VIOLATION_FIELDS.items()
                        if is_number(v := values.get((f, 0)))}

            phase = position / max(1, len(ctx.gpus))  # spread the GPUs' costly reads over sweeps
            read_at, violations = self._violations.get(g.uuid, ctx.now, read_violations, phase)
            if violations:
                rec["violation_read_at"] = read_at
                for label, v in violations.items():
                    rec[f"violation_ns.{label}"] = v
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).throttle
        out: list[Finding] = []
        for i, rec in sorted(obs.per_gpu.items()):
            shares: dict[str, float] = {}
            window = 0.0
            read_at = gpu_key(i, "violation_read_at")

            def has_reading(o: Observations, read_at: Callable[[Observations], Any] = read_at) -> bool:
                return read_at(o) is not None

            past = earlier_reading(history, obs, time_of=read_at, window_s=VIOLATION_WINDOW_S, has=has_reading)
            if past is not None and past[1] >= th.violation_min_window_s:
                window = past[1]
                before = past[0].per_gpu.get(i, {})
                for label in VIOLATION_FIELDS:
                    key = f"violation_ns.{label}"
                    grew = increase(rec.get(key), before.get(key))
                    if grew is not None:
                        shares[label] = grew / 1e9 / past[1]
            mask = rec.get("reasons")
            active = problem_reasons(int(mask)) if is_number(mask) else []
            seen = {r.bit for r in active}
            # Throttling between polls: a problem counter grew though the bit is clear now (DCGM's
            # thermal/power watches warn on any growth of the violation time).
            for label, bit in _COUNTER_REASON.items():
                if bit not in seen and shares.get(label, 0.0) > 0.0:
                    active.append(next(r for r in REASONS if r.bit == bit))
                    seen.add(bit)
            for r in active:
                if r.code is None:
                    continue
                share = shares.get(r.name)
                held_s = _bit_held_s(history, obs, i, r.bit) if r.bit in _SUSTAINED_BY_BIT else None
                sustained = ((share is not None and share >= th.sustained_violation_share)
                             or (held_s is not None and held_s >= th.violation_min_window_s))
                action = r.action
                if sustained and r.severity is Severity.WARNING:
                    action = max(action, Action.DRAIN)
                now_text = "active now" if is_number(mask) and int(mask) & r.bit else "between polls"
                msg = f"GPU {i}: clocks limited by {r.text} ({now_text})"
                if share is not None:
                    msg += f", {share:.0%} of the last {window:.0f} s"
                out.append(Finding(
                    r.code, r.severity, gpu_entity(ctx, i), msg, action,
                    {"reasons_mask": f"0x{int(mask):x}" if is_number(mask) else None,
                     "reasons": [x.name for x in decode(int(mask))] if is_number(mask) else [],
                     "violation_share": None if share is None else round(share, 4),
                     "window_s": round(window, 1) if share is not None else None,
                     "sustained": sustained,
                     **({"held_s": round(held_s, 1)} if held_s is not None else {})},
                    NAME,
                ))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []
        for i, rec in sorted(obs.per_gpu.items()):
            mask = rec.get("reasons")
            if is_number(mask):
                for r in REASONS:
                    out.append(Sample(
                        "gpu_throttle_reason_active", 1.0 if int(mask) & r.bit else 0.0,
                        "1 while the clocks are limited for this reason (NVML clock-event reasons).",
                        gpu=i, labels=(("reason", r.name),),
                    ))
            for label in VIOLATION_FIELDS:
                v = rec.get(f"violation_ns.{label}")
                if is_number(v):
                    out.append(Sample(
                        "gpu_throttle_violation_seconds", float(v) / 1e9,
                        "Time the GPU spent limited by this policy/reason (NVML violation counters).",
                        MetricKind.COUNTER, i, (("reason", label),),
                    ))
        return out


def _bit_held_s(history: History, now: Observations, gpu: int, bit: int) -> float | None:
    """Seconds ``bit`` has been set in every sweep of this GPU up to now, within the violation window (None
    when it is not set now). A sweep that did not read the mask ends the run: unknown is not "held"."""
    mask = now.per_gpu.get(gpu, {}).get("reasons")
    if not is_number(mask) or not int(mask) & bit:
        return None
    since = now.time
    for past in reversed(list(history)):
        if past is now or past.time >= now.time:
            continue
        if now.time - past.time > VIOLATION_WINDOW_S:
            break
        was = past.per_gpu.get(gpu, {}).get("reasons")
        if not is_number(was) or not int(was) & bit:
            break
        since = past.time
    return now.time - since


def create() -> Collector:
    return ThrottleCollector()
