"""Which processes use each GPU: NVML's compute-process list, else the holders of ``/dev/nvidia<minor>``.

NVML lists each GPU's compute processes. Where an entry comes back without a readable PID (until
``backends.nvml_real.plain`` learnt pynvml's process objects, all of them did on 2 × H200), the
processes are found the way ``fuser /dev/nvidia*`` finds them: every process holding the GPU's
character device (major 195, minor = NVML ``MinorNumber``) open. The device is matched by its number
(``st_rdev``), not its name, so a container's own ``/dev`` counts too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuhealth.agent.view import GpuProcess
from gpuhealth.backends.base import NvmlBackend
from gpuhealth.collectors.base import GpuIdentity

NVIDIA_MAJOR = 195  # the NVIDIA driver's character devices; minor 255 is nvidiactl, 254 nvidia-modeset


def _pid_of(entry: Any) -> int | None:
    if isinstance(entry, Mapping):
        pid = entry.get("pid")
        return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
    return None


def _memory_of(entry: Any) -> int | None:
    mem = entry.get("usedGpuMemory") if isinstance(entry, Mapping) else None
    return mem if isinstance(mem, int) and 0 <= mem < 1 << 60 else None  # NVML's "not available" is 2^64-1


def device_holders(minors: Mapping[int, GpuIdentity], *, major: int = NVIDIA_MAJOR, proc: Path = Path("/proc")
                   ) -> list[GpuProcess]:
    """Processes with an open descriptor on one of the character devices ``(major, minor)``."""
    out: list[GpuProcess] = []
    own = os.getpid()
    try:
        entries = [e for e in os.scandir(proc) if e.name.isdigit() and int(e.name) != own]
    except OSError:
        return out
    for entry in entries:
        held: set[int] = set()
        try:
            fds = list(os.scandir(Path(entry.path) / "fd"))
        except OSError:
            continue  # gone, or not ours to read
        for fd in fds:
            try:
                if not os.readlink(fd.path).startswith("/dev/"):
                    continue  # sockets, pipes, files: no stat needed
                st = os.stat(fd.path)
            except OSError:
                continue
            if os.major(st.st_rdev) == major and os.minor(st.st_rdev) in minors:
                held.add(os.minor(st.st_rdev))
        out += [GpuProcess(minors[m].index, minors[m].uuid, int(entry.name)) for m in sorted(held)]
    return out


def gpu_processes(backend: NvmlBackend, gpus: Sequence[GpuIdentity], *, proc: Path = Path("/proc"),
                  major: int = NVIDIA_MAJOR) -> list[GpuProcess]:
    """Each GPU's compute processes from NVML; a GPU whose entries carry no PID is asked of ``/proc``."""
    out: list[GpuProcess] = []
    unreadable: dict[int, GpuIdentity] = {}
    for g in gpus:
        try:
            entries = backend.query(g.index, "ComputeRunningProcesses")
        except Exception:  # a GPU that cannot say has no processes we can name
            continue
        entries = entries if isinstance(entries, list) else []
        for e in entries:
            pid = _pid_of(e)
            if pid is not None:
                out.append(GpuProcess(g.index, g.uuid, pid, _memory_of(e)))
        if any(_pid_of(e) is None for e in entries):
            try:
                minor = backend.query(g.index, "MinorNumber")
            except Exception:
                continue
            if isinstance(minor, int) and 0 <= minor < 254:
                unreadable[minor] = g
    if unreadable:
        seen = {(p.gpu_index, p.pid) for p in out}
        out += [p for p in device_holders(unreadable, major=major, proc=proc) if (p.gpu_index, p.pid) not in seen]
    return out


__all__ = ["NVIDIA_MAJOR", "device_holders", "gpu_processes"]
