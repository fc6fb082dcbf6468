"""Which bus-bandwidth reference a node's GPUs may be judged against, from what NVML says of their
NVLinks (any ``NvmlBackend``: the live driver, or a recording in tests).

The built-in busbw curves were measured through NVSwitch on NVLink 4.0 (H100/H200 SXM, 18 links of
each GPU to the switches). Judging anything else against them drains healthy nodes: 8 × H100 NVL
(bridged pairs, the rest over PCIe) reads a tenth of that curve, an A100 NVSwitch board two thirds.
So ``nvlink`` is claimed only when every GPU's active links go to NVSwitches (remote device type)
at NVLink 4.0; other layouts get their own name, which has no built-in curve (``busbw.unjudged``,
info) unless the operator's thresholds file gives one:

- ``nvlink``: every GPU has the SXM5 board's 18 links and its active ones go to NVSwitches, NVLink 4.0
  (H800's 8 links read under half the curve: not this). Where the driver does not say the remote device
  type, 18 active 4.0 links on every GPU stand in for it.
- ``nvswitch-nvlink<major>``: through NVSwitches at another NVLink version (``nvswitch-nvlink3`` on
  A100, ``nvswitch-nvlink5`` on Blackwell).
- ``nvlink-direct``: links to other GPUs, no switch (bridges, a 4-GPU board's mesh).
- ``nvlink-partial``: some GPUs have active links and some none.
- ``pcie``: no GPU has an active link. ``unknown``: NVML could not say.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.backends.base import NVLINK_MAX_LINKS, NvmlBackend
from gpuhealth.backends.errors import NvmlError

NVLINK_STATE_ACTIVE = 1
REMOTE_GPU, REMOTE_NPU, REMOTE_SWITCH = 0, 1, 2  # NVML_NVLINK_DEVICE_TYPE_*; 0xFF (UNKNOWN) is "not said"
# nvmlDeviceGetNvLinkVersion's enum → NVLink major version (NVML_NVLINK_VERSION_1_0 = 1 … 5_0 = 7).
NVLINK_MAJOR = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5}
REFERENCE_MAJOR = 4  # the version the built-in curves were measured on
SXM_LINKS = 18


@dataclass(slots=True)
class GpuLinks:
    index: int
    links: int = 0  # links NVML reports a state for, active or not: the GPU's own link count
    active: int = 0
    versions: set[int] = field(default_factory=set)  # NVLink majors of the active links
    remotes: set[int | None] = field(default_factory=set)  # remote device types (None: not said)


@dataclass(frozen=True, slots=True)
class Topology:
    name: str
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "why": self.why}


def _read(backend: NvmlBackend, index: int, link: int, key: str) -> Any:
    try:
        return backend.nvlink(index, link, key)
    except NvmlError:
        return None


def gpu_links(backend: NvmlBackend, index: int) -> GpuLinks:
    out = GpuLinks(index)
    for link in range(NVLINK_MAX_LINKS):
        state = _read(backend, index, link, "state")
        if isinstance(state, int) and not isinstance(state, bool):
            out.links += 1  # a link this GPU does not have answers an error (not supported, invalid argument)
        if state != NVLINK_STATE_ACTIVE:
            continue
        out.active += 1
        version = _read(backend, index, link, "version")
        out.versions.add(NVLINK_MAJOR.get(version, 0) if isinstance(version, int) else 0)
        remote = _read(backend, index, link, "remote_type")
        known = isinstance(remote, int) and remote in (REMOTE_GPU, REMOTE_NPU, REMOTE_SWITCH)
        out.remotes.add(remote if known else None)
    return out


def classify(gpus: Sequence[GpuLinks]) -> Topology:
    """The topology name of these GPUs' NVLinks (see the module docstring)."""
    if not gpus:
        return Topology("unknown", "no GPU to look at")
    linked = [g for g in gpus if g.active]
    if not linked:
        return Topology("pcie", "no GPU has an active NVLink")
    if len(linked) < len(gpus):
        bare = ", ".join(str(g.index) for g in gpus if not g.active)
        return Topology("nvlink-partial", f"GPU(s) {bare} have no active NVLink while others do")
    remotes = set().union(*(g.remotes for g in gpus))
    versions = set().union(*(g.versions for g in gpus))
    if REMOTE_GPU in remotes or any(r not in (REMOTE_SWITCH, None) for r in remotes):
        return Topology("nvlink-direct", "NVLinks go to other GPUs, not to NVSwitches")
    if len(versions) != 1 or 0 in versions:
        return Topology("unknown", f"NVLink versions {sorted(versions)} (0: not said)")
    (major,) = versions
    if None in remotes:  # the driver does not say what is at the far end
        if major == REFERENCE_MAJOR and all(g.active == SXM_LINKS for g in gpus):
            return Topology("nvlink", f"{SXM_LINKS} active NVLink {major}.0 links on every GPU (SXM board; "
                                      "remote device type not said)")
        return Topology("unknown", "the remote device type of the NVLinks is not said, and the link count is "
                                   "not an SXM board's")
    if major != REFERENCE_MAJOR:
        return Topology(f"nvswitch-nvlink{major}", f"NVLink {major}.0 through NVSwitches")
    if any(g.links != SXM_LINKS for g in gpus):
        counts = sorted({g.links for g in gpus})
        return Topology(f"nvswitch-nvlink{major}-links{'-'.join(map(str, counts))}",
                        f"NVLink {major}.0 through NVSwitches with {counts} links per GPU, not the SXM5 board's "
                        f"{SXM_LINKS}")
    return Topology("nvlink", f"NVLink {major}.0 through NVSwitches on every GPU ({SXM_LINKS} links)")


def ranks_gpus(backend: NvmlBackend, count: int, world: int, visible: str | None) -> list[int] | None:
    """NVML indices of the GPUs the ranks of a local run use, one each: the first ``world`` of
    ``CUDA_VISIBLE_DEVICES`` (NVML indices — the diag runner sets them with CUDA_DEVICE_ORDER=PCI_BUS_ID —
    or UUIDs), else of all GPUs. None when an entry names no GPU here."""
    if not visible:
        return list(range(min(world, count)))
    uuids: dict[str, int] = {}
    out: list[int] = []
    for part in [p.strip() for p in visible.split(",") if p.strip()][:world]:
        if part.isdigit() and int(part) < count:
            out.append(int(part))
            continue
        if not uuids:
            for i in range(count):
                with contextlib.suppress(NvmlError):
                    uuids[str(backend.query(i, "UUID"))] = i
        found = next((i for u, i in uuids.items() if part.startswith("GPU-") and u.startswith(part)), None)
        if found is None:
            return None
        out.append(found)
    return out


def detect(backend: NvmlBackend, world: int, visible: str | None = None) -> Topology:
    """Classify the GPUs of a local run of ``world`` ranks (``ranks_gpus``)."""
    try:
        count = backend.device_count()
    except NvmlError as exc:
        return Topology("unknown", f"NVML: {exc}")
    indices = ranks_gpus(backend, count, world, visible)
    if indices is None:
        return Topology("unknown", f"CUDA_VISIBLE_DEVICES={visible!r} names a GPU NVML does not list")
    return classify([gpu_links(backend, i) for i in indices])
