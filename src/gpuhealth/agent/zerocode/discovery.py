"""Which processes use this node's GPUs, and which job and rank each one is — from NVML and ``/proc``.

NVML lists each GPU's compute processes (host PIDs when the agent shares the host's PID namespace:
``hostPID`` in Kubernetes). For each PID, ``/proc/<pid>/environ`` says which job and rank it is
(``environ.launch_info``), ``/proc/<pid>/status`` its user and its PID inside its own namespace (what
NCCL reports), ``/proc/<pid>/cgroup`` its container and Kubernetes pod. Paths the process names (its
FIFO, its dump file) are reached through ``/proc/<pid>/root``, so a container's own files are found
from the host. A process that is not a torch rank is still listed, by GPU.

Reading another user's ``environ`` or ``root`` needs root or CAP_SYS_PTRACE: without it the process
is listed with the reason (``error``), never dropped.

A job id and rank come from the process's environment, which its user wrote: they are trusted only within that
user. The kernel says who the process is (its uid in ``/proc/<pid>/status``); a job belongs to the uid whose
ranks the agent saw first under that id (``owners``), and a process of another uid naming the same job is kept
apart as ``<job>~uid<N>`` — watched, never joined to (nor reported to the coordinator as part of) a job another
user owns.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuhealth.agent.view import GpuProcess
from gpuhealth.agent.zerocode.environ import LaunchInfo, launch_info, parse_environ
from gpuhealth.model import RankIdentity

MAX_ENVIRON_BYTES = 1 << 20  # the kernel allows more, no launcher needs it
MAX_SMALL_FILE_BYTES = 64 * 1024
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True, slots=True)
class DiscoveredProcess:
    pid: int  # in the agent's PID namespace
    gpus: tuple[tuple[int, str], ...]  # (NVML index, UUID) of each GPU it holds
    used_memory_bytes: int | None = None
    ns_pid: int | None = None  # its PID in its own namespace (what NCCL prints); None: unknown
    uid: int | None = None
    gids: frozenset[int] = frozenset()  # its groups (real gid and supplementary): who may write its FIFO
    name: str = ""
    cmdline: str = ""
    launch: LaunchInfo | None = None
    container_id: str | None = None
    pod_uid: str | None = None
    error: str | None = None  # why part of it could not be read

    @property
    def is_rank(self) -> bool:
        return self.launch is not None and self.launch.is_rank

    @property
    def gpu_index(self) -> int | None:
        return self.gpus[0][0] if self.gpus else None

    @property
    def gpu_uuid(self) -> str | None:
        return self.gpus[0][1] if self.gpus else None

    def pids(self) -> frozenset[int]:
        """Every PID this process may be reported under (host and its own namespace)."""
        return frozenset(p for p in (self.pid, self.ns_pid) if p)

    def identity(self, host: str) -> RankIdentity | None:
        """The rank identity the coordinator gets, marked as found by discovery."""
        li = self.launch
        if li is None or not li.is_rank:
            return None
        assert li.job_id is not None and li.rank is not None and li.world_size is not None
        return RankIdentity(job_id=li.job_id, rank=li.rank, world_size=li.world_size, host=host, pid=self.pid,
                            local_rank=li.local_rank, gpu_uuid=self.gpu_uuid, gpu_index=self.gpu_index,
                            found_by="discovered")

    def to_dict(self) -> dict[str, object]:
        li = self.launch
        return {
            "pid": self.pid, "ns_pid": self.ns_pid, "uid": self.uid, "name": self.name, "cmdline": self.cmdline,
            "gpus": [{"index": i, "uuid": u} for i, u in self.gpus], "used_memory_bytes": self.used_memory_bytes,
            "job_id": li.job_id if li else None, "rank": li.rank if li else None,
            "world_size": li.world_size if li else None, "local_rank": li.local_rank if li else None,
            "torch": bool(li and li.torch_like), "dumps": None if li is None else (li.dump_ready or "ready"),
            "ras": None if li is None else (f"{li.ras_host}:{li.ras_port}" if li.ras_enabled else "disabled"),
            "container_id": self.container_id, "pod_uid": self.pod_uid, "error": self.error,
        }


@dataclass(frozen=True, slots=True)
class DiscoveredJob:
    job_id: str
    world_size: int
    ranks: Mapping[int, DiscoveredProcess] = field(default_factory=dict)  # the ranks on this node

    def by_pid(self, pid: int) -> DiscoveredProcess | None:
        return next((p for p in self.ranks.values() if pid in p.pids()), None)


@dataclass(frozen=True, slots=True)
class Discovery:
    processes: tuple[DiscoveredProcess, ...] = ()

    def jobs(self) -> list[DiscoveredJob]:
        grouped: dict[str, dict[int, DiscoveredProcess]] = {}
        worlds: dict[str, int] = {}
        for p in self.processes:
            li = p.launch
            if li is None or not li.is_rank:
                continue
            assert li.job_id is not None and li.rank is not None and li.world_size is not None
            grouped.setdefault(li.job_id, {}).setdefault(li.rank, p)
            worlds[li.job_id] = max(worlds.get(li.job_id, 0), li.world_size)
        return [DiscoveredJob(j, worlds[j], dict(sorted(r.items()))) for j, r in sorted(grouped.items())]

    def job(self, job_id: str) -> DiscoveredJob | None:
        return next((j for j in self.jobs() if j.job_id == job_id), None)

    def by_pid(self, pid: int) -> DiscoveredProcess | None:
        return next((p for p in self.processes if pid in p.pids()), None)


def _read(path: Path, limit: int) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(limit)


def _status(text: str) -> tuple[str, int | None, int | None, frozenset[int]]:
    """(Name, real UID, PID in the innermost namespace, groups) from ``/proc/<pid>/status``."""
    name, uid, ns_pid = "", None, None
    gids: set[int] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields = value.split()
        if key == "Name":
            name = value.strip()
        elif key == "Uid" and fields and fields[0].isdigit():
            uid = int(fields[0])
        elif key == "Gid" and fields and fields[0].isdigit():
            gids.add(int(fields[0]))
        elif key == "Groups":
            gids.update(int(g) for g in fields if g.isdigit())
        elif key == "NSpid" and fields and fields[-1].isdigit():
            ns_pid = int(fields[-1])
    return name, uid, ns_pid, frozenset(gids)


def _cgroup_ids(text: str) -> tuple[str | None, str | None]:
    container = pod = None
    for line in text.splitlines():
        if container is None and (m := _CONTAINER_ID.search(line)):
            container = m.group(1)
        if pod is None and (m := _POD_UID.search(line)):
            pod = m.group(1).replace("_", "-")
    return container, pod


def _why(exc: OSError, what: str, uid: int | None) -> str:
    if isinstance(exc, PermissionError):
        owner = f" (it runs as uid {uid})" if uid is not None else ""
        return (f"cannot read {what}{owner}: permission denied — the agent needs root or CAP_SYS_PTRACE to read "
                "another user's process")
    return f"cannot read {what}: {exc.strerror or exc}"


def inspect_process(pid: int, gpus: Sequence[tuple[int, str]], *, used_memory: int | None = None,
                    proc: Path = Path("/proc")) -> DiscoveredProcess | None:
    """One process, from ``/proc``; None when it has gone."""
    base = proc / str(pid)
    out = DiscoveredProcess(pid=pid, gpus=tuple(gpus), used_memory_bytes=used_memory)
    try:
        name, uid, ns_pid, gids = _status(_read(base / "status", MAX_SMALL_FILE_BYTES).decode("utf-8", "replace"))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return replace(out, error=_why(exc, f"/proc/{pid}/status", None))
    out = replace(out, name=name, uid=uid, ns_pid=ns_pid, gids=gids)
    errors: list[str] = []
    try:
        raw = _read(base / "cmdline", 4096)
        out = replace(out, cmdline=raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:512])
    except OSError:
        pass  # cmdline is for display only
    try:
        out = replace(out, launch=launch_info(parse_environ(_read(base / "environ", MAX_ENVIRON_BYTES))))
    except FileNotFoundError:
        return None
    except OSError as exc:
        errors.append(_why(exc, f"/proc/{pid}/environ", uid))
    try:
        container, pod = _cgroup_ids(_read(base / "cgroup", MAX_SMALL_FILE_BYTES).decode("utf-8", "replace"))
        out = replace(out, container_id=container, pod_uid=pod)
    except OSError:
        pass  # attribution is optional
    return replace(out, error="; ".join(errors) or None)


def bind_to_owners(processes: Sequence[DiscoveredProcess], owners: dict[str, int]) -> tuple[DiscoveredProcess, ...]:
    """Keep each job id to one uid: the owner seen before (``owners``, updated here), else the uid with the most
    ranks under that id (the lowest on a tie). Ranks of another uid naming the job become ``<job>~uid<N>``."""
    claims: dict[str, dict[int | None, int]] = {}
    for p in processes:
        if p.launch is not None and p.launch.is_rank:
            by_uid = claims.setdefault(str(p.launch.job_id), {})
            by_uid[p.uid] = by_uid.get(p.uid, 0) + 1
    for job_id, by_uid in claims.items():
        if owners.get(job_id) not in by_uid:
            owners[job_id] = min(by_uid, key=lambda u: (-by_uid[u], -1 if u is None else u))  # type: ignore[assignment]
    for gone in set(owners) - set(claims):
        del owners[gone]
    out = []
    for p in processes:
        li = p.launch
        if li is not None and li.is_rank and owners.get(str(li.job_id)) != p.uid:
            p = replace(p, launch=replace(li, job_id=f"{li.job_id}~uid{p.uid}"))
        out.append(p)
    return tuple(out)


def start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22): with the pid, who it is."""
    try:
        return int(_read(proc / str(pid) / "stat", 4096).rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class InspectCache:
    """What was read of each process, kept while the same process (pid and start time) holds its GPUs: a process's
    environment, user and container do not change, so a poll reads one small file per known process instead of
    four (issue 27). Processes that ended are forgotten at once."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, DiscoveredProcess]] = {}

    def get(self, pid: int, gpus: Sequence[tuple[int, str]], used_memory: int | None, proc: Path
            ) -> DiscoveredProcess | None:
        started = start_time(pid, proc)
        if started is None:
            return None  # gone
        known = self._seen.get(pid)
        if known is not None and known[0] == started and known[1].error is None:
            return replace(known[1], gpus=tuple(gpus), used_memory_bytes=used_memory)
        found = inspect_process(pid, gpus, used_memory=used_memory, proc=proc)
        if found is not None:
            self._seen[pid] = (started, found)
        return found

    def forget_all_but(self, pids: Iterable[int]) -> None:
        keep = set(pids)
        for pid in set(self._seen) - keep:
            del self._seen[pid]


def discover(gpu_processes: Iterable[GpuProcess], *, proc: Path = Path("/proc"),
             owners: dict[str, int] | None = None, cache: InspectCache | None = None) -> Discovery:
    """Every process NVML lists, inspected once (a process on several GPUs is one entry). ``owners`` (job id →
    uid, kept by the caller across polls) binds each job id to the user that first ran it; ``cache`` keeps what
    was read of processes seen before."""
    gpus: dict[int, list[tuple[int, str]]] = {}
    memory: dict[int, int] = {}
    for gp in gpu_processes:
        if gp.pid <= 0:
            continue
        entry = (gp.gpu_index, gp.gpu_uuid)
        if entry not in gpus.setdefault(gp.pid, []):
            gpus[gp.pid].append(entry)
        if gp.used_memory_bytes is not None:
            memory[gp.pid] = memory.get(gp.pid, 0) + gp.used_memory_bytes
    if cache is None:
        found = [inspect_process(pid, sorted(g), used_memory=memory.get(pid), proc=proc)
                 for pid, g in sorted(gpus.items())]
    else:
        found = [cache.get(pid, sorted(g), memory.get(pid), proc) for pid, g in sorted(gpus.items())]
        cache.forget_all_but(gpus)
    present = tuple(p for p in found if p is not None)
    return Discovery(bind_to_owners(present, owners if owners is not None else {}))


def path_in_process(pid: int, path: str, *, proc: Path = Path("/proc")) -> Path:
    """Where a path the process names is, seen from the agent: through its root (its mount namespace,
    a container's own files) when absolute, through its working directory when relative."""
    if os.path.isabs(path):
        return proc / str(pid) / "root" / path.lstrip("/")
    return proc / str(pid) / "cwd" / path


__all__ = ["DiscoveredJob", "DiscoveredProcess", "Discovery", "InspectCache", "bind_to_owners", "discover",
           "inspect_process", "path_in_process", "start_time"]
