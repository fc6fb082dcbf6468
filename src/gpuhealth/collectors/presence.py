"""GPU presence: are all the GPUs there, and does each still answer?

- ``gpu.missing`` (critical, node): fewer GPUs in NVML (plus those outside this view) than
  ``collectors.expected_gpus``, or NVIDIA GPUs of this view on the PCI bus (sysfs) that NVML does not
  list. On the bus but not in NVML → the driver could not bring it up (reboot); not even on the bus →
  hands-on work (drain).
- Only GPUs this view was given are judged: the PCI bus shows every GPU of the host, also to a container
  given two of eight, to a Slurm job whose device cgroup allows two, and to a host that handed some to VMs.
  Outside the view (``gpu.outside_view``, info, never missing), whatever the environment detection says:
  a GPU bound to another driver (``vfio-pci``); one bound to ``nvidia`` but absent from this view's
  ``/proc/driver/nvidia/gpus`` (the host's driver lists every GPU it is bound to: a masked list is a
  container's or enroot's); one the driver lists whose ``/dev/nvidia<minor>`` is absent here (CDI, enroot)
  or refused to this process (device cgroup: Slurm ``ConstrainDevices``, Apptainer under Slurm). A GPU
  the driver lost stays this view's: unbound (its probe failed), or listed with a device node this
  process may open, yet not in NVML.
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
        self._pci: tuple[float, int | None, PciView] | None = None  # at, NVML count, what the bus showed

    def _pci_gpus(self, ctx: CollectContext, nvml_count: int | None) -> PciView:
        cached = self._pci
        if cached is not None and cached[1] == nvml_count and 0 <= ctx.now - cached[0] < self.pci_rescan_s:
            return cached[2]
        try:
            view = pci_view(ctx)
        except OSError as exc:  # sysfs unreadable: say so, judge on NVML and config alone
            view = PciView(None, {}, str(exc))
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
class PciView:
    """The NVIDIA GPUs on the PCI bus as this view sees them (``pci_view``)."""

    in_view: list[str] | None  # bus ids of the GPUs on the bus that this view was given; None: unreadable
    outside: dict[str, str]  # bus id → why it is not this view's GPU
    error: str | None = None



def pci_view(ctx: CollectContext) -> PciView:
    """The GPUs on the PCI bus, split into this view's and the others. Raises OSError when sysfs cannot be read.

    The bus shows every GPU of the host, whatever this process was given, and not every restricted view is
    a detected container (Slurm's device cgroup, Apptainer and enroot share the host's PID and cgroup
    namespaces), so the same evidence is asked everywhere; ``environment.container`` only decides what
    an unreadable driver list means."""
    sysfs = sysfs_of(ctx)
    devices = sysfs.nvidia_pci_devices()
    in_container = environment_of(ctx).container is True
    driver_gpus = sysfs.nvidia_driver_gpus()
    in_view: list[str] = []
    outside: dict[str, str] = {}
    for dev in devices:
        bdf = normalise_bdf(dev.bdf)
        why = _outside_why(dev.driver, bdf, driver_gpus, in_container, sysfs)
        if why:
            outside[bdf] = why
        else:
            in_view.append(bdf)
    return PciView(sorted(in_view), outside)


def _outside_why(driver: str | None, bdf: str, driver_gpus: dict[str, int | None] | None, in_container: bool,
                 sysfs: Any) -> str | None:
    """Why a GPU on the bus is not this view's, or None when it is. A GPU the driver lost is this view's:
    unbound (probe failed), or listed by the driver with a device node this process may open."""
    if driver is not None and driver != "nvidia":
        return f"bound to {driver}"
    if driver_gpus is None:  # the driver's list cannot be read: only a container is known to be given a part
        return "not given to this container" if in_container else None
    if bdf not in driver_gpus:
        # The host's driver lists every GPU it is bound to (its probe creates the entry); a view where a bound
        # GPU is absent was given a masked list (NVIDIA runtime, enroot). An unbound one is absent everywhere.
        if in_container:
            return "not given to this container"
        return "not listed in this view's /proc/driver/nvidia/gpus" if driver == "nvidia" else None
    minor = driver_gpus[bdf]
    if minor is None:
        return None
    if not sysfs.device_node_exists(minor):
        return "with no /dev/nvidia device node in this view"  # CDI, enroot: only the given GPUs' nodes
    if sysfs.device_node_refused(minor):
        return "refused to this process by the device cgroup"  # Slurm ConstrainDevices (or the file's mode)
    return None


def _missing(obs: Observations, ctx: CollectContext) -> Finding | None:
    count = obs.node.get("nvml_count")
    nvml_count = count or 0
    expected = obs.node.get("expected")
    pci: list[str] | None = obs.node.get("pci_gpus")
    # GPUs on the bus that this view was not given are the node's GPUs all the same: a container given
    # 2 of 8 on a node of 8 lacks none.
    outside = len(obs.node.get("pci_outside_view") or {})
    known = {normalise_bdf(g.pci_bus_id) for g in ctx.gpus if g.pci_bus_id}
    unseen = [b for b in (pci or []) if b not in known]
    if len(known) < nvml_count and pci is not None and len(pci) <= nvml_count:
        unseen = []  # a GPU without a bus id (lost) explains the difference: no GPU is unaccounted for
    short_of_expected = expected is not None and nvml_count + outside < expected
    if not short_of_expected and not unseen:
        return None
    evidence: dict[str, Any] = {"expected": expected, "nvml": count, "pci": None if pci is None else len(pci),
                                "on_pci_not_in_nvml": unseen, "outside_view": outside}
    if obs.node.get("nvml_error"):
        evidence["nvml_error"] = obs.node["nvml_error"]
    want: int = expected if expected is not None and short_of_expected else nvml_count + outside + len(unseen)
    on_bus = len(pci) + outside if pci is not None else None
    if unseen or (on_bus is not None and expected is not None and on_bus >= expected):
        action = Action.REBOOT
        why = "on the PCI bus but not initialised by the driver"
    else:
        action = Action.DRAIN
        why = "not even on the PCI bus (seating, power or hardware)"
    nvml_text = "NVML unavailable" if count is None else f"NVML lists {count}"
    beside = f" and {outside} are outside this view" if outside else ""
    where = f" ({', '.join(unseen)})" if unseen else ""
    return Finding(
        code="gpu.missing",
        severity=Severity.CRITICAL,
        entity=Entity.node(ctx.node_name),
        message=(f"{max(want - nvml_count - outside, len(unseen))} GPU(s) missing{where}: {nvml_text} of {want}"
                 f"{beside}; {why}"),
        action=action,
        evidence=evidence,
        source=NAME,
    )


def create() -> PresenceCollector:
    return PresenceCollector()
