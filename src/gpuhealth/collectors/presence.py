"""GPU presence: are all the GPUs there, and does each still answer?

- ``gpu.missing`` (critical, node): fewer GPUs in NVML than ``collectors.expected_gpus``, or NVIDIA
  GPUs on the PCI bus (sysfs) that NVML does not list. On the bus but not in NVML → the driver could
  not bring it up (reboot); not even on the bus → hands-on work (drain).
- Only GPUs this view was given count: the PCI bus shows every GPU of the host, also to a container given
  two of eight, and to a host that handed some to VMs. A GPU bound to another driver (``vfio-pci``) and,
  in a container, a GPU the NVIDIA runtime did not give it (absent from ``/proc/driver/nvidia/gpus`` or
  without its ``/dev/nvidia<minor>``) is outside the view: ``gpu.outside_view`` (info), never missing.
- ``gpu.lost`` (critical, that GPU): it answers GPU_IS_LOST (fell off the bus → reboot) or
  RESET_REQUIRED (→ reset the GPU). The runner leaves these codes to this collector, so a lost GPU
  shows up once, here, and not as a failure of every other collector.

MIG: each GPU's MIG mode (current and pending) and, with MIG on, its instances (``MigDevices``:
UUID, profile, GPU/compute instance ids), read every ``mig_refresh_s``. Exported as
``gpuhealth_gpu_mig_mode{which}`` and ``gpuhealth_gpu_mig_instance_info{mig_uuid, …}`` on the parent
GPU: that is what lets the exporter give a pod holding a MIG slice (the kubelet names ``MIG-…``) the
labels of the GPU it runs on. A GPU without MIG answers "not supported": nothing is exported.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.sysfs import normalise_bdf
from gpuhealth.collectors._shared import Periodic, environment_of, sysfs_of
from gpuhealth.collectors.base import CollectContext, History, Lane, Observations
from gpuhealth.model import Action, Entity, Finding, MetricKind, Sample, Severity

NAME = "presence"


class PresenceCollector:
    """``pci_rescan_s``: the sysfs PCI walk costs ~0.7 ms per GPU on a real node (it reads every PCI
    device's vendor), so it is redone only this often, or at once when NVML's GPU count changes."""

    name = NAME
    lane = Lane.FAST

    def __init__(self, pci_rescan_s: float = 60.0, mig_refresh_s: float = 30.0) -> None:
        self.pci_rescan_s = pci_rescan_s
        self._mig = Periodic(mig_refresh_s)  # MIG layout changes only when an admin repartitions
        self._pci: tuple[float, int | None, _PciView] | None = None  # at, NVML count, what the bus showed

    def _pci_gpus(self, ctx: CollectContext, nvml_count: int | None) -> _PciView:
        cached = self._pci
        if cached is not None and cached[1] == nvml_count and 0 <= ctx.now - cached[0] < self.pci_rescan_s:
            return cached[2]
        try:
            view = _pci_view(ctx)
        except OSError as exc:  # sysfs unreadable: say so, judge on NVML and config alone
            view = _PciView(None, {}, str(exc))
        self._pci = (ctx.now, nvml_count, view)
        return view

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
            if obs.gpu(i).get("present"):
                uuid = next((g.uuid for g in ctx.gpus if g.index == i), str(i))
                _, mig = self._mig.get(uuid, ctx.now, functools.partial(_read_mig, ctx, obs, i))
                obs.gpu(i).update(mig)
        view = self._pci_gpus(ctx, count)
        obs.node["pci_gpus"] = view.in_view
        obs.node["pci_outside_view"] = view.outside
        if view.error:
            obs.node["pci_error"] = view.error
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
        outside: dict[str, str] = obs.node.get("pci_outside_view") or {}
        if outside:
            reasons: dict[str, int] = {}
            for why in outside.values():
                reasons[why] = reasons.get(why, 0) + 1
            out.append(Finding(
                code="gpu.outside_view", severity=Severity.INFO, entity=Entity.node(ctx.node_name),
                message=f"{len(outside)} NVIDIA GPU(s) on the PCI bus are outside this view ("
                        + "; ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
                        + "): not judged as missing",
                action=Action.NONE, evidence={"gpus": dict(sorted(outside.items()))}, source=self.name,
            ))
        return out

    def samples(self, obs: Observations, ctx: CollectContext) -> Iterable[Sample]:
        count = obs.node.get("nvml_count")
        if count is not None:
            yield Sample("gpus", float(count), "GPUs NVML lists on this node")
        pci = obs.node.get("pci_gpus")
        if pci is not None:
            yield Sample("gpus_on_pci_bus", float(len(pci)),
                         "NVIDIA GPUs on the PCI bus given to this node or container (sysfs)")
        expected = obs.node.get("expected")
        if expected is not None:
            yield Sample("gpus_expected", float(expected), "GPUs this node should have (config)")
        for i, data in sorted(obs.per_gpu.items()):
            if "present" in data:
                yield Sample("gpu_present", 1.0 if data["present"] else 0.0,
                             "1 while the GPU answers NVML, 0 when it is lost", gpu=i)
            mode = data.get("mig_mode")
            if mode is not None:
                for which, value in zip(("current", "pending"), mode, strict=True):
                    yield Sample("gpu_mig_mode", float(value), "MIG mode: 1 enabled, 0 disabled (pending: after "
                                 "the next GPU reset).", gpu=i, labels=(("which", which),))
            for inst in data.get("mig_devices", ()):
                yield Sample("gpu_mig_instance", 1.0, "A MIG instance of this GPU (value 1): its UUID, profile and "
                             "GPU/compute instance ids.", MetricKind.INFO, i,
                             (("mig_uuid", inst["uuid"]), ("profile", inst.get("profile", "")),
                              ("gpu_instance_id", str(inst.get("gpu_instance_id", ""))),
                              ("compute_instance_id", str(inst.get("compute_instance_id", "")))))


def _read_mig(ctx: CollectContext, obs: Observations, index: int) -> dict[str, Any]:
    """MIG mode and instances of one GPU; {} where the GPU has no MIG (not supported)."""
    try:
        mode = ctx.backend.query(index, "MigMode")
    except NvmlError as exc:
        obs.note_error(index, "MigMode", exc)
        return {}
    if not (isinstance(mode, (list, tuple)) and len(mode) == 2 and all(isinstance(v, int) for v in mode)):
        return {}
    out: dict[str, Any] = {"mig_mode": [int(mode[0]), int(mode[1])], "mig_devices": []}
    if mode[0]:
        try:
            devices = ctx.backend.query(index, "MigDevices")
        except NvmlError as exc:
            obs.note_error(index, "MigDevices", exc)
            devices = []
        for d in devices if isinstance(devices, list) else []:
            if isinstance(d, dict) and isinstance(d.get("uuid"), str) and d["uuid"]:
                name = str(d.get("name", ""))
                profile = name.rsplit(" MIG ", 1)[1] if " MIG " in name else ""  # "… MIG 1g.10gb" → 1g.10gb
                out["mig_devices"].append({**d, "profile": profile})
    return out


@dataclass(frozen=True, slots=True)
class _PciView:
    in_view: list[str] | None  # bus ids of the GPUs on the bus that this view was given; None: unreadable
    outside: dict[str, str]  # bus id → why it is not this view's GPU
    error: str | None = None


def _pci_view(ctx: CollectContext) -> _PciView:
    """The GPUs on the PCI bus, split into this view's and the others (handed to another driver, or, in a
    container, not given to it by the NVIDIA runtime). Raises OSError when sysfs cannot be read."""
    sysfs = sysfs_of(ctx)
    devices = sysfs.nvidia_pci_devices()
    in_container = environment_of(ctx).container is True
    driver_gpus = sysfs.nvidia_driver_gpus() if in_container else None
    in_view: list[str] = []
    outside: dict[str, str] = {}
    for dev in devices:
        bdf = normalise_bdf(dev.bdf)
        if dev.driver is not None and dev.driver != "nvidia":
            outside[bdf] = f"bound to {dev.driver}"
        elif in_container and not _given_to_container(bdf, driver_gpus, sysfs):
            outside[bdf] = "not given to this container"
        else:
            in_view.append(bdf)
    return _PciView(sorted(in_view), outside)


def _given_to_container(bdf: str, driver_gpus: dict[str, int | None] | None, sysfs: Any) -> bool:
    if driver_gpus is None or bdf not in driver_gpus:
        return False  # the NVIDIA runtime mounts only the container's GPUs under /proc/driver/nvidia/gpus
    minor = driver_gpus[bdf]
    return minor is None or bool(sysfs.device_node_exists(minor))  # CDI: the device node tells


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
