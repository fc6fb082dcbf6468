"""GPU presence: are all the GPUs there, and does each still answer?

- ``gpu.missing`` (critical, node): fewer GPUs in NVML than ``collectors.expected_gpus``, or NVIDIA
  GPUs on the PCI bus (sysfs) that NVML does not list. On the bus but not in NVML → the driver could
  not bring it up (reboot); not even on the bus → hands-on work (drain).
- ``gpu.lost`` (critical, that GPU): it answers GPU_IS_LOST (fell off the bus → reboot) or
  RESET_REQUIRED (→ reset the GPU). The runner leaves these codes to this collector, so a lost GPU
  shows up once, here, and not as a failure of every other collector.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.sysfs import normalise_bdf
from gpuhealth.collectors._shared import sysfs_of
from gpuhealth.collectors.base import CollectContext, History, Lane, Observations
from gpuhealth.model import Action, Entity, Finding, Sample, Severity

NAME = "presence"


class PresenceCollector:
    """``pci_rescan_s``: the sysfs PCI walk costs ~0.7 ms per GPU on a real node (it reads every PCI
    device's vendor), so it is redone only this often, or at once when NVML's GPU count changes."""

    name = NAME
    lane = Lane.FAST

    def __init__(self, pci_rescan_s: float = 60.0) -> None:
        self.pci_rescan_s = pci_rescan_s
        self._pci: tuple[float, int | None, list[str] | None, str | None] | None = None  # at, count, bdfs, error

    def _pci_gpus(self, ctx: CollectContext, nvml_count: int | None) -> tuple[list[str] | None, str | None]:
        cached = self._pci
        if cached is not None and cached[1] == nvml_count and 0 <= ctx.now - cached[0] < self.pci_rescan_s:
            return cached[2], cached[3]
        bdfs: list[str] | None
        error: str | None = None
        try:
            bdfs = sorted(normalise_bdf(d.bdf) for d in sysfs_of(ctx).nvidia_pci_devices())
        except OSError as exc:  # sysfs unreadable: say so, judge on NVML and config alone
            bdfs, error = None, str(exc)
        self._pci = (ctx.now, nvml_count, bdfs, error)
        return bdfs, error

    def supported(self, ctx: CollectContext) -> bool:
        return True

    def collect(self, ctx: CollectContext) -> Observations:
        obs = Observations(collector=self.name, time=ctx.now)
        try:
            count: int | None = ctx.backend.device_count()
        except NvmlError as exc:
            obs.note_error(None, "device_count", exc)
            obs.node["nvml_error"] = exc.message
            count = None
        obs.node["nvml_count"] = count
        bus_ids: dict[int, str] = {g.index: g.pci_bus_id for g in ctx.gpus}
        for i in range(count or 0):
            try:
                ctx.backend.query(i, "UUID")
                obs.gpu(i)["present"] = True
            except NvmlError as exc:
                if exc.gpu_gone:
                    obs.gpu(i).update(present=False, gone_code=exc.code, gone_message=exc.message)
                else:
                    obs.note_error(i, "UUID", exc)
            if i in bus_ids:
                obs.gpu(i)["pci_bus_id"] = bus_ids[i]
        pci, pci_error = self._pci_gpus(ctx, count)
        obs.node["pci_gpus"] = pci
        if pci_error:
            obs.node["pci_error"] = pci_error
        obs.node["expected"] = ctx.config.collectors.expected_gpus
        return obs

    def evaluate(self, obs: Observations, history: History, ctx: CollectContext) -> list[Finding]:
        out: list[Finding] = []
        for i, data in sorted(obs.per_gpu.items()):
            if data.get("present", True):
                continue
            ident = ctx.gpu_by_index(i)
            code = data.get("gone_code")
            reset_only = code == errors.RESET_REQUIRED
            bus = data.get("pci_bus_id") or (ident.pci_bus_id if ident else "")
            out.append(Finding(
                code="gpu.lost",
                severity=Severity.CRITICAL,
                entity=Entity.gpu(ident.uuid if ident else f"unknown-gpu-{i}", i),
                message=(f"GPU {i}{f' ({bus})' if bus else ''} "
                         f"{'needs a reset' if reset_only else 'is lost (fell off the bus)'}: "
                         f"NVML says '{data.get('gone_message', '')}'"),
                action=Action.RESET_GPU if reset_only else Action.REBOOT,
                evidence={"nvml_code": code, "nvml_message": data.get("gone_message"),
                          "pci_bus_id": data.get("pci_bus_id") or (ident.pci_bus_id if ident else None)},
                source=self.name,
            ))
        missing = _missing(obs, ctx)
        if missing is not None:
            out.append(missing)
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        count = obs.node.get("nvml_count")
        if count is not None:
            yield Sample("gpus", float(count), "GPUs NVML lists on this node")
        pci = obs.node.get("pci_gpus")
        if pci is not None:
            yield Sample("gpus_on_pci_bus", float(len(pci)), "NVIDIA GPUs on the PCI bus (sysfs)")
        expected = obs.node.get("expected")
        if expected is not None:
            yield Sample("gpus_expected", float(expected), "GPUs this node should have (config)")
        for i, data in sorted(obs.per_gpu.items()):
            if "present" in data:
                yield Sample("gpu_present", 1.0 if data["present"] else 0.0,
                             "1 while the GPU answers NVML, 0 when it is lost", gpu=i)


def _missing(obs: Observations, ctx: CollectContext) -> Finding | None:
    count = obs.node.get("nvml_count")
    nvml_count = count or 0
    expected = obs.node.get("expected")
    pci: list[str] | None = obs.node.get("pci_gpus")
    known = {normalise_bdf(g.pci_bus_id) for g in ctx.gpus if g.pci_bus_id}
    unseen = [b for b in (pci or []) if b not in known]
    if len(known) < nvml_count and pci is not None and len(pci) <= nvml_count:
        unseen = []  # a GPU without a bus id (lost) explains the difference: no GPU is unaccounted for
    short_of_expected = expected is not None and nvml_count < expected
    if not short_of_expected and not unseen:
        return None
    evidence: dict[str, Any] = {"expected": expected, "nvml": count, "pci": None if pci is None else len(pci),
                                "on_pci_not_in_nvml": unseen}
    if obs.node.get("nvml_error"):
        evidence["nvml_error"] = obs.node["nvml_error"]
    want: int = expected if expected is not None and short_of_expected else nvml_count + len(unseen)
    on_bus = len(pci) if pci is not None else None
    if unseen or (on_bus is not None and expected is not None and on_bus >= expected):
        action = Action.REBOOT
        why = "on the PCI bus but not initialised by the driver"
    else:
        action = Action.DRAIN
        why = "not even on the PCI bus (seating, power or hardware)"
    nvml_text = "NVML unavailable" if count is None else f"NVML lists {count}"
    where = f" ({', '.join(unseen)})" if unseen else ""
    return Finding(
        code="gpu.missing",
        severity=Severity.CRITICAL,
        entity=Entity.node(ctx.node_name),
        message=f"{max(want - nvml_count, len(unseen))} GPU(s) missing: {nvml_text} of {want}{where}; {why}",
        action=action,
        evidence=evidence,
        source=NAME,
    )


def create() -> PresenceCollector:
    return PresenceCollector()
