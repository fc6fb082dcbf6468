"""ECC errors, row remapping and retired pages, judged as DCGM's memory health watch does.

- A volatile double-bit (uncorrectable) error since the last reset → ``ecc.dbe_volatile``, critical,
  reset the GPU (DCGM: failure).
- Corrected (single-bit) errors growing faster than the budget → ``ecc.sbe_rate``, warning.
- Row remapping (Ampere and later): a failed remap → ``memory.row_remap_failed``, critical, RMA;
  a pending remap → ``memory.row_remap_pending``, warning, reset (the spare row is used only after a
  reset); ≥ 512 rows remapped for uncorrectable errors, or a bank with no spare row left →
  ``memory.row_remap_spares_low``, warning, plan an RMA.
- ECC turned off (``EccMode`` current = 0) → ``ecc.disabled``, warning: nothing above can be seen.
- Retired pages (pre-Ampere; Hopper answers "Not Supported", which is normal):
  ``memory.retired_pages`` by DCGM's limits, and a pending retirement → reset.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuhealth.catalog.thresholds import thresholds_from
from gpuhealth.collectors._shared import counter_delta, fetch, gpu_entity, gpu_key, is_number
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Finding, MetricKind, Sample, Severity

NAME = "ecc"

_ECC_KEYS = {
    ("corrected", "volatile"): "TotalEccErrors_CORRECTED_VOLATILE",
    ("corrected", "aggregate"): "TotalEccErrors_CORRECTED_AGGREGATE",
    ("uncorrected", "volatile"): "TotalEccErrors_UNCORRECTED_VOLATILE",
    ("uncorrected", "aggregate"): "TotalEccErrors_UNCORRECTED_AGGREGATE",
}
_HISTOGRAM_LEVELS = ("max", "high", "partial", "low", "none")


def _remapped_rows(value: Any) -> dict[str, int] | None:
    """NVML ``RemappedRows`` → (corrected rows, uncorrected rows, pending, failure)."""
    if isinstance(value, (list, tuple)) and len(value) >= 4 and all(is_number(v) for v in value[:4]):
        return {
            "correctable": int(value[0]),
            "uncorrectable": int(value[1]),
            "pending": int(bool(value[2])),
            "failed": int(bool(value[3])),
        }
    if isinstance(value, dict):
        keys = ("corrRows", "uncRows", "isPending", "failureOccurred")
        if all(k in value for k in keys):
            return {
                "correctable": int(value["corrRows"]),
                "uncorrectable": int(value["uncRows"]),
                "pending": int(bool(value["isPending"])),
                "failed": int(bool(value["failureOccurred"])),
            }
    return None


class EccCollector:
    name = NAME
    lane = Lane.FAST

    def __init__(self) -> None:
        # ECC mode changes only take effect at a reboot, and the call costs ~0.16 ms: read once per GPU.
        self._modes: dict[str, dict[str, int]] = {}

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def _mode(self, ctx: CollectContext, obs: Observations, index: int, uuid: str) -> dict[str, int]:
        cached = self._modes.get(uuid)
        if cached is not None:
            return cached
        out: dict[str, int] = {}
        pair = fetch(ctx, obs, index, "EccMode")  # [current, pending]
        if isinstance(pair, (list, tuple)) and len(pair) == 2 and all(is_number(v) for v in pair):
            out = {"ecc_mode": int(pair[0]), "ecc_mode_pending": int(pair[1])}
        else:
            cur = fetch(ctx, obs, index, "CurrentEccMode")
            if is_number(cur):
                out = {"ecc_mode": int(cur)}
        if out:
            self._modes[uuid] = out
        return out

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        b = ctx.backend
        for g in ctx.gpus:
            i = g.index
            rec = obs.gpu(i)
            rec.update(self._mode(ctx, obs, i, g.uuid))
            for (etype, scope), key in _ECC_KEYS.items():
                obs.read(b, i, key, store_as=f"{etype}_{scope}")
            rows = _remapped_rows(fetch(ctx, obs, i, "RemappedRows"))
            if rows is not None:
                rec["remap"] = rows
            hist = fetch(ctx, obs, i, "RowRemapperHistogram")
            if isinstance(hist, dict):
                rec["remap_histogram"] = {k: int(hist[k]) for k in _HISTOGRAM_LEVELS if is_number(hist.get(k))}
            for cause in ("SBE", "DBE"):
                pages = fetch(ctx, obs, i, f"RetiredPages_{cause}")
                if isinstance(pages, (list, tuple)):
                    rec[f"retired_{cause.lower()}"] = len(pages)
                elif is_number(pages):
                    rec[f"retired_{cause.lower()}"] = int(pages)
            obs.read(b, i, "RetiredPagesPendingStatus", store_as="retired_pending")
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx)
        out: list[Finding] = []
        for i, rec in sorted(obs.per_gpu.items()):
            ent = gpu_entity(ctx, i)
            if rec.get("ecc_mode") == 0:
                pending = rec.get("ecc_mode_pending")
                out.append(Finding(
                    "ecc.disabled", Severity.WARNING, ent,
                    f"GPU {i}: ECC is disabled — memory errors go undetected"
                    + (" (enabled at the next reboot)" if pending == 1 else ""),
                    Action.MONITOR, {"ecc_mode": 0, "ecc_mode_pending": pending}, NAME,
                ))
            dbe = rec.get("uncorrected_volatile")
            if is_number(dbe) and dbe >= th.ecc.dbe_volatile_critical:
                out.append(Finding(
                    "ecc.dbe_volatile", Severity.CRITICAL, ent,
                    f"GPU {i}: {int(dbe)} uncorrectable (double-bit) ECC error(s) since the last reset",
                    Action.RESET_GPU,
                    {"uncorrected_volatile": int(dbe), "uncorrected_aggregate": rec.get("uncorrected_aggregate")},
                    NAME,
                ))
            d = counter_delta(history, obs, gpu_key(i, "corrected_volatile"))
            if d is not None and d[1] >= th.ecc.sbe_rate_min_window_s:
                per_min = d[0] / d[1] * 60.0
                if per_min >= th.ecc.sbe_rate_per_minute_warning:
                    out.append(Finding(
                        "ecc.sbe_rate", Severity.WARNING, ent,
                        f"GPU {i}: corrected ECC errors at {per_min:.1f}/min over {d[1]:.0f} s "
                        f"(limit {th.ecc.sbe_rate_per_minute_warning:g}/min)",
                        Action.MONITOR,
                        {"per_minute": round(per_min, 3), "increase": int(d[0]), "window_s": round(d[1], 1),
                         "limit_per_minute": th.ecc.sbe_rate_per_minute_warning},
                        NAME,
                    ))
            out.extend(self._remap_findings(i, rec, ctx, th.memory.remap_uncorrectable_warning))
            out.extend(self._retired_findings(i, rec, ctx))
        return out

    @staticmethod
    def _remap_findings(i: int, rec: dict[str, Any], ctx: CollectContext, unc_limit: int) -> list[Finding]:
        out: list[Finding] = []
        ent = gpu_entity(ctx, i)
        remap = rec.get("remap")
        if isinstance(remap, dict):
            ev = dict(remap)
            if remap["failed"]:
                out.append(Finding(
                    "memory.row_remap_failed", Severity.CRITICAL, ent,
                    f"GPU {i}: a row remapping failed — memory errors can no longer be repaired in place",
                    Action.RMA, ev, NAME,
                ))
            if remap["pending"]:
                out.append(Finding(
                    "memory.row_remap_pending", Severity.WARNING, ent,
                    f"GPU {i}: a row remapping is pending; reset the GPU to apply it",
                    Action.RESET_GPU, ev, NAME,
                ))
            if remap["uncorrectable"] >= unc_limit:
                out.append(Finding(
                    "memory.row_remap_spares_low", Severity.WARNING, ent,
                    f"GPU {i}: {remap['uncorrectable']} rows remapped for uncorrectable errors (≥ {unc_limit})",
                    Action.RMA, {**ev, "limit": unc_limit}, NAME,
                ))
        hist = rec.get("remap_histogram")
        if isinstance(hist, dict) and hist.get("none", 0) > 0 and not (
            isinstance(remap, dict) and remap["uncorrectable"] >= unc_limit
        ):
            out.append(Finding(
                "memory.row_remap_spares_low", Severity.WARNING, ent,
                f"GPU {i}: {hist['none']} memory bank(s) have no spare rows left",
                Action.RMA, {"histogram": dict(hist)}, NAME,
            ))
        return out

    def _retired_findings(self, i: int, rec: dict[str, Any], ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).memory
        ent = gpu_entity(ctx, i)
        sbe, dbe = rec.get("retired_sbe"), rec.get("retired_dbe")
        pending = rec.get("retired_pending")
        if not is_number(sbe) and not is_number(dbe) and not is_number(pending):
            return []  # Not Supported (Hopper uses row remapping): normal
        total = int(sbe or 0) + int(dbe or 0)
        ev = {"sbe": sbe, "dbe": dbe, "pending": pending, "total": total}
        out: list[Finding] = []
        if total >= th.retired_pages_critical:
            out.append(Finding(
                "memory.retired_pages", Severity.CRITICAL, ent,
                f"GPU {i}: {total} retired pages (limit {th.retired_pages_critical})", Action.RMA, ev, NAME,
            ))
        elif is_number(dbe) and dbe >= th.retired_pages_dbe_warning:
            out.append(Finding(
                "memory.retired_pages", Severity.WARNING, ent,
                f"GPU {i}: {int(dbe)} pages retired for double-bit errors (≥ {th.retired_pages_dbe_warning})",
                Action.MONITOR, ev, NAME,
            ))
        if is_number(pending) and pending:
            out.append(Finding(
                "memory.retired_pages", Severity.WARNING, ent,
                f"GPU {i}: a page retirement is pending; reset the GPU to apply it", Action.RESET_GPU, ev, NAME,
            ))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []
        for i, rec in sorted(obs.per_gpu.items()):
            if is_number(rec.get("ecc_mode")):
                out.append(Sample("gpu_ecc_mode_enabled", float(rec["ecc_mode"]),
                                  "1 when ECC is enabled on the GPU.", gpu=i))
            for (etype, scope) in _ECC_KEYS:
                v = rec.get(f"{etype}_{scope}")
                if is_number(v):
                    out.append(Sample(
                        "gpu_ecc_errors", float(v),
                        "ECC errors counted by the GPU; scope=volatile since the last reset, "
                        "aggregate over the GPU's life.",
                        MetricKind.COUNTER, i, (("type", etype), ("scope", scope)),
                    ))
            remap = rec.get("remap")
            if isinstance(remap, dict):
                for cause in ("correctable", "uncorrectable"):
                    out.append(Sample("gpu_remapped_rows", float(remap[cause]),
                                      "DRAM rows remapped to spares, by the error that caused it.",
                                      gpu=i, labels=(("cause", cause),)))
                out.append(Sample("gpu_row_remap_pending", float(remap["pending"]),
                                  "1 when a row remapping waits for a GPU reset.", gpu=i))
                out.append(Sample("gpu_row_remap_failed", float(remap["failed"]),
                                  "1 when a row remapping failed (RMA).", gpu=i))
            hist = rec.get("remap_histogram")
            if isinstance(hist, dict):
                for level, count in hist.items():
                    out.append(Sample("gpu_row_remap_bank_availability", float(count),
                                      "Memory banks by how many spare rows they have left (level=max…none).",
                                      gpu=i, labels=(("level", level),)))
            for cause in ("sbe", "dbe"):
                v = rec.get(f"retired_{cause}")
                if is_number(v):
                    out.append(Sample("gpu_retired_pages", float(v),
                                      "Memory pages retired by the driver, by cause (pre-Ampere GPUs).",
                                      gpu=i, labels=(("cause", cause),)))
            if is_number(rec.get("retired_pending")):
                out.append(Sample("gpu_retired_pages_pending", float(rec["retired_pending"]),
                                  "1 when a page retirement waits for a GPU reset.", gpu=i))
        return out


def create() -> Collector:
    return EccCollector()
