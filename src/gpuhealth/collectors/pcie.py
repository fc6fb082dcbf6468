"""PCIe link: trained width and generation against the maximum, and the replay counter as a rate.

Width and generation mean different things:
- **Width** is fixed at link training. A GPU that trained at x8 in an x16 slot (a bad riser, a
  dirty or unseated connector, a failing retimer) stays at x8 until retrained: half the host↔GPU
  bandwidth. ``current < max`` width is a real fault → ``pcie.link_degraded`` (critical by default).
  NVML's ``MaxPcieLinkWidth`` is the most the GPU *and the slot* allow; sysfs ``max_link_width`` is
  the GPU's own capability. So the critical judgement takes current and maximum as a pair from NVML
  only; sysfs's maximum never stands in for NVML's. When the GPU could do more than its link runs at
  and nothing says the slot allows more (NVML's maximum equals the current width, or NVML gives no
  maximum: some drivers and VM guests), the slot may be narrower by design: a warning, not a drain.
- **Generation** is lowered by the GPU itself when idle (link power management) and raised under
  load, so ``current < max`` at idle is normal. It is judged only while the GPU is busy
  (utilization ≥ ``gen_check_min_utilization_pct``) → ``pcie.link_degraded`` warning.

Replays (the data-link layer resending a TLP after a CRC error) are counted by the GPU. Their rate
over about a minute of history is judged as DCGM's PCIe health watch does: more than
ceil(BER 1e-12 × GT/s per lane × 60 × lanes) per minute at the *current* generation and width
(Gen5 x16 → 31/min) → ``pcie.replay_rate`` warning.

Slow lane: ``PcieReplayCounter`` costs 0.17 ms and sysfs reads touch the filesystem.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from gpuhealth.catalog.thresholds import thresholds_from
from gpuhealth.collectors._shared import counter_delta, fetch, gpu_key, is_number, link_entity, sysfs_of
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane, Observations
from gpuhealth.model import Action, Finding, MetricKind, Sample, Severity

NAME = "pcie"

# Transfer rate per lane by PCIe generation (GT/s); DCGM's replay budget scales with it.
GEN_GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}

_NVML_KEYS = {
    "CurrPcieLinkGeneration": "gen_current",
    "MaxPcieLinkGeneration": "gen_max",
    "GpuMaxPcieLinkGeneration": "gen_gpu_max",
    "CurrPcieLinkWidth": "width_current",
    "MaxPcieLinkWidth": "width_max",
    "PcieReplayCounter": "replays",
}


def replay_budget_per_minute(gen: Any, lanes: Any, bit_error_rate: float) -> int | None:
    """DCGM's expected replays per minute: ceil(BER × GT/s per lane × 60 s × lanes).
    Gen5 x16 at BER 1e-12 → 31. None when generation or width is unknown."""
    if not is_number(gen) or not is_number(lanes) or gen < 1 or lanes < 1:
        return None
    gts = GEN_GT_PER_S[min(int(gen), max(GEN_GT_PER_S))]
    return math.ceil(round(bit_error_rate * gts * 1e9 * 60 * lanes, 9))


class PcieCollector:
    name = NAME
    lane = Lane.SLOW

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(NAME, ctx.now)
        sysfs = sysfs_of(ctx)
        for g in ctx.gpus:
            i = g.index
            rec = obs.gpu(i)
            for key, name in _NVML_KEYS.items():
                v = fetch(ctx, obs, i, key)
                if is_number(v):
                    rec[name] = int(v)
            util = fetch(ctx, obs, i, "UtilizationRates")
            if isinstance(util, dict) and is_number(util.get("gpu")):
                rec["util_pct"] = util["gpu"]
            dev = sysfs.pci_device(g.pci_bus_id) if g.pci_bus_id else None
            if dev is not None:
                for name, v in (("sysfs_width_current", dev.current_link_width),
                                ("sysfs_width_max", dev.max_link_width),
                                ("sysfs_gen_current", dev.current_link_gen),
                                ("sysfs_gen_max", dev.max_link_gen)):
                    if v is not None:
                        rec[name] = v
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        th = thresholds_from(ctx).pcie
        out: list[Finding] = []
        for i, rec in sorted(obs.per_gpu.items()):
            ent = link_entity(ctx, i, "pcie", "")
            # The slot's maximum and the current width as one pair from NVML (see the module doc); the GPU's
            # own capability (sysfs) against whatever current width is known is the weaker, slot-or-fault case.
            cur_w, max_w = rec.get("width_current"), rec.get("width_max")
            if not is_number(cur_w) or not is_number(max_w):
                cur_w, max_w = rec.get("width_current", rec.get("sysfs_width_current")), None
            gpu_max_w = rec.get("sysfs_width_max")
            ev: dict[str, Any] = {k: rec[k] for k in sorted(rec) if k != "util_pct" and k != "replays"}
            width_sev = Severity.parse(th.width_degraded_severity)
            if is_number(cur_w) and is_number(max_w) and 0 < cur_w < max_w:
                out.append(Finding(
                    "pcie.link_degraded", width_sev, ent,
                    f"GPU {i}: PCIe link trained at x{cur_w}, below its maximum x{max_w}",
                    Action.DRAIN, {**ev, "kind": "width"}, NAME,
                ))
            elif is_number(cur_w) and is_number(gpu_max_w) and 0 < cur_w < gpu_max_w:
                slot = ("the slot allows less" if max_w is not None else
                        "NVML gives no slot maximum to tell a narrower slot from a link trained down")
                out.append(Finding(
                    "pcie.link_degraded", Severity.WARNING, ent,
                    f"GPU {i}: PCIe link at x{cur_w}; the GPU supports x{gpu_max_w} but {slot}",
                    Action.MONITOR, {**ev, "kind": "slot_width"}, NAME,
                ))
            cur_g = rec.get("gen_current", rec.get("sysfs_gen_current"))
            max_g = rec.get("gen_max", rec.get("sysfs_gen_max"))
            util = rec.get("util_pct")
            busy = is_number(util) and util >= th.gen_check_min_utilization_pct
            if busy and is_number(cur_g) and is_number(max_g) and 0 < cur_g < max_g:
                out.append(Finding(
                    "pcie.link_degraded", Severity.WARNING, ent,
                    f"GPU {i}: PCIe Gen{cur_g} while busy ({util}% utilization), below its maximum Gen{max_g}",
                    Action.MONITOR, {**ev, "kind": "generation", "utilization_pct": util}, NAME,
                ))
            out.extend(self._replay_findings(i, rec, obs, history, ctx))
        return out

    @staticmethod
    def _replay_findings(
        i: int, rec: dict[str, Any], obs: Observations, history: History, ctx: CollectContext
    ) -> list[Finding]:
        th = thresholds_from(ctx).pcie
        d = counter_delta(history, obs, gpu_key(i, "replays"), window_s=2 * th.replay_window_s)
        if d is None or d[1] < th.replay_window_s / 2:
            return []
        gen = rec.get("gen_current", rec.get("sysfs_gen_current"))
        lanes = rec.get("width_current", rec.get("sysfs_width_current"))
        budget = replay_budget_per_minute(gen, lanes, th.replay_bit_error_rate)
        per_min = d[0] / d[1] * 60.0
        if budget is None or per_min <= budget:
            return []
        return [Finding(
            "pcie.replay_rate", Severity.WARNING, link_entity(ctx, i, "pcie", ""),
            f"GPU {i}: {per_min:.1f} PCIe replays/min over {d[1]:.0f} s, above the budget of {budget}/min "
            f"for Gen{gen} x{lanes}",
            Action.MONITOR,
            {"per_minute": round(per_min, 3), "increase": int(d[0]), "window_s": round(d[1], 1),
             "budget_per_minute": budget, "generation": gen, "lanes": lanes},
            NAME,
        )]

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        out: list[Sample] = []
        for i, rec in sorted(obs.per_gpu.items()):
            for which in ("current", "max"):
                g = rec.get(f"gen_{which}", rec.get(f"sysfs_gen_{which}"))
                if is_number(g):
                    out.append(Sample("gpu_pcie_link_generation", float(g),
                                      "PCIe link generation (which=current|max); the GPU lowers it when idle.",
                                      gpu=i, labels=(("which", which),)))
                w = rec.get(f"width_{which}", rec.get(f"sysfs_width_{which}"))
                if is_number(w):
                    out.append(Sample("gpu_pcie_link_width", float(w),
                                      "PCIe link width in lanes (which=current|max).",
                                      gpu=i, labels=(("which", which),)))
            if is_number(rec.get("replays")):
                out.append(Sample("gpu_pcie_replay", float(rec["replays"]),
                                  "PCIe data-link replays (TLP resent after an error) counted by the GPU.",
                                  MetricKind.COUNTER, i))
        return out


def create() -> Collector:
    return PcieCollector()
