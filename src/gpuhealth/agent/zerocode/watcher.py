"""The zero-code extension: every PyTorch/NCCL job on this node's GPUs, found, watched and triaged with
no import in the job.

Each poll (``poll_interval_s``):

1. NVML's compute processes → ``discovery`` (job, rank, world size from ``/proc/<pid>/environ``);
   new ranks are announced to listeners (the coordinator link) as ``RankIdentity(found_by="discovered")``.
2. Each job's NCCL RAS service is asked (``ras``; one query reaches one random process of a node, so
   jobs sharing the port are asked until each has answered) and the per-job ``HangJudge`` decides.
3. A hang is a ``rank.stuck`` finding naming rank, process, GPU and node, with that GPU's findings and
   its utilisation/power (a GPU 100 % busy at near-idle power is spinning: evidence, never a verdict
   alone). A culprit on another node is reported here as info (that node's agent reports it).
4. When the job was launched with the pipe variables (``gpuhealth env``), the hang's evidence is taken
   in the background: every local rank's flight-recorder dump, py-spy stacks, triage (``evidence``).
   With ``periodic_dump_s`` set, such jobs are also dumped every so often and triaged for stragglers.

``ras.unavailable`` (info) says why a job cannot be watched through RAS. Nothing here blocks the agent:
RAS queries and dumps run on this extension's own threads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.agent.view import AgentView, GpuProcess, ListsGpuProcesses
from gpuhealth.agent.zerocode import ras
from gpuhealth.agent.zerocode.discovery import DiscoveredJob, DiscoveredProcess, Discovery, InspectCache, discover
from gpuhealth.agent.zerocode.evidence import Evidence, collect
from gpuhealth.agent.zerocode.fifo import DumpError, request_dump
from gpuhealth.agent.zerocode.hang import Activity, BehindRank, HangJudge, HangVerdict, Process
from gpuhealth.agent.zerocode.stacks import pyspy_stacks
from gpuhealth.model import Action, Entity, EntityKind, Finding, MetricKind, RankIdentity, Sample, Severity

log = logging.getLogger("gpuhealth.agent.zerocode")

SOURCE = "zerocode"
SPIN_UTIL_MIN = 0.95  # a GPU this busy …
SPIN_POWER_MAX = 0.25  # … at no more than this share of its power limit is spinning, not computing
# Stragglers with no launch variables, from the GPUs alone (issue 25, measured on 2 x H200 with NVML's GPM):
# a GPU-side straggler keeps its SMs busier than its peers, whose SMs idle in NCCL's waiting kernels (SM activity
# 95 % vs 74 % for a rank doing 1.3x the work: ratio 1.29; 1.15x: 1.15; a healthy job 1.00); a host-side one
# leaves its GPU idle while the host is late (busy 75 % vs 99 %). Info until their false-alarm rate is known.
GPU_HINT_POLLS = 6  # polls of readings (30 s at the default poll) before a hint
GPU_HINT_SM_RATIO = 1.10
GPU_HINT_SM_MIN = 0.30
HOST_HINT_BUSY_GAP = 0.10
HOST_HINT_PEERS_BUSY = 0.90


@dataclass(slots=True)
class ZeroCodeSettings:
    enabled: bool = True
    poll_interval_s: float = 5.0
    hang_threshold_s: float = 30.0  # counts still this long, a rank behind, over >= 2 polls: a hang
    # ... or this long (and at least 50 of the job's own gaps between launches) when the rank behind runs here and
    # is idle on its host (no CPU, no I/O): a job of hundreds of collectives a second is named within seconds
    fast_hang_floor_s: float = 5.0
    ras_timeout_s: float = 10.0
    ras_format: str = "json"  # text on NCCL without JSON (older than 2.28.9) either way
    dump_on_hang: bool = True
    dump_timeout_s: float = 15.0
    stacks: bool = True
    stacks_native: bool = False
    periodic_dump_s: float = 300.0  # pipe-enabled jobs are dumped this often for stragglers (0: never); BENCHMARKS
    evidence_dir: str = "/run/gpuhealth/zerocode"
    keep_evidence: int = 16  # evidence folders kept (oldest removed first)
    triage_timeout_s: float = 120.0
    record_dir: str | None = None  # every RAS reply is also written here (recordings for tests)
    simulated_processes: bool = False  # watch a simulated backend's listed processes as this machine's


def settings_from(config: Any) -> ZeroCodeSettings:
    """The settings a config asks for: its ``zerocode`` section where there is one, else the defaults
    (the evidence folder beside the rank socket, which ranks and operators already share)."""
    out = ZeroCodeSettings()
    socket_path = getattr(getattr(config, "agent", None), "socket_path", None)
    if socket_path:
        out.evidence_dir = str(Path(socket_path).parent / "zerocode")
    section = getattr(config, "zerocode", None)
    for name in ZeroCodeSettings.__dataclass_fields__:
        if section is not None and hasattr(section, name):
            setattr(out, name, getattr(section, name))
    return out


@dataclass
class JobState:
    judge: HangJudge
    ras_error: str | None = None
    ras_seen: bool = False
    verdict: HangVerdict | None = None  # a hang (or a hung mismatch)
    diverged: list[HangVerdict] = field(default_factory=list)  # collectives that differ while the job goes on
    evidence: Evidence | None = None
    evidence_running: bool = False
    last_periodic: float = 0.0
    periodic_findings: list[Finding] = field(default_factory=list)
    gpu_history: list[dict[int, dict[str, float]]] = field(default_factory=list)  # per poll: rank -> GPU readings
    launched: list[bool] = field(default_factory=list)  # per poll of that history: did the job launch more since


@dataclass(frozen=True, slots=True)
class PollResult:
    discovery: Discovery
    statuses: Mapping[str, ras.RasStatus]
    verdicts: Mapping[str, HangVerdict]
    findings: list[Finding]
    seconds: float


def _loopback(host: str) -> bool:
    """localhost, 127/8, ::1, or the unspecified address (RAS listening everywhere is reached on loopback too)."""
    h = host.strip().lower().strip("[]")
    if h in ("localhost", "", "0.0.0.0", "::", "::1", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _netns_pid(p: DiscoveredProcess, proc: Path) -> int | None:
    """The process's PID when it lives in another network namespace than the agent (its own localhost)."""
    try:
        theirs = os.stat(proc / str(p.pid) / "ns" / "net").st_ino
        return p.pid if theirs != os.stat("/proc/self/ns/net").st_ino else None
    except OSError:
        return None


class ZeroCodeWatcher:
    name = "zerocode"

    def __init__(self, settings: ZeroCodeSettings | None = None, *,
                 processes: Callable[[], Sequence[GpuProcess]] | None = None, proc: Path = Path("/proc"),
                 query: Callable[..., ras.RasReply] = ras.query, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or ZeroCodeSettings()
        self._processes = processes
        self._proc = proc
        self._query = query
        self._clock = clock
        self.view: AgentView | None = None
        self._host = os.uname().nodename
        self._lock = threading.RLock()
        self._discovery = Discovery()
        self._jobs: dict[str, JobState] = {}
        self._announced: dict[tuple[str, int], RankIdentity] = {}
        self._owners: dict[str, int] = {}  # job id -> the uid that owns it (discovery.bind_to_owners)
        self._inspected = InspectCache()  # what was read of each process, while it lives
        self._on_identity: list[Callable[[RankIdentity], None]] = []
        self._on_disconnect: list[Callable[[RankIdentity], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpuhealth-zc")
        self._counters = {"ras_queries": 0, "ras_errors": 0, "dumps_ok": 0, "dumps_failed": 0, "polls": 0}
        self._last_ras_s = 0.0
        self._last_poll_s = 0.0

    # -- extension ---------------------------------------------------------------------------------

    def start(self, view: AgentView) -> None:
        self.view = view
        self._host = view.node_name or self._host
        if self._processes is None:
            simulated = view.simulated and not self.settings.simulated_processes
            if simulated or not isinstance(view, ListsGpuProcesses):
                log.info("zero-code discovery off: %s", "the GPUs are simulated" if view.simulated
                         else "this agent cannot list GPU processes")
                return
            self._processes = view.gpu_processes
        self._thread = threading.Thread(target=self._run, name="gpuhealth-zerocode", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.settings.ras_timeout_s + 2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # the watcher never stops watching for one bad poll
                log.exception("zero-code poll failed")
            self._stop.wait(self.settings.poll_interval_s)

    # -- listeners (the coordinator link) -----------------------------------------------------------

    def add_listener(self, on_identity: Callable[[RankIdentity], None] | None = None,
                     on_disconnect: Callable[[RankIdentity], None] | None = None) -> None:
        with self._lock:
            if on_identity is not None:
                self._on_identity.append(on_identity)
                for ident in self._announced.values():  # those found before the listener came
                    on_identity(ident)
            if on_disconnect is not None:
                self._on_disconnect.append(on_disconnect)

    def _announce(self, disc: Discovery) -> None:
        current: dict[tuple[str, int], RankIdentity] = {}
        for p in disc.processes:
            ident = p.identity(self._host)
            if ident is not None:
                current[(ident.job_id, ident.rank)] = ident
        with self._lock:
            new = [i for k, i in current.items() if self._announced.get(k) != i]
            gone = [i for k, i in self._announced.items() if k not in current]
            self._announced = current
            on_identity, on_disconnect = list(self._on_identity), list(self._on_disconnect)
        for ident in new:
            for cb in on_identity:
                _safely(cb, ident)
        for ident in gone:
            for cb in on_disconnect:
                _safely(cb, ident)

    # -- what is known ------------------------------------------------------------------------------

    def discovery(self) -> Discovery:
        with self._lock:
            return self._discovery

    def ranks(self, job_id: str | None = None) -> list[RankIdentity]:
        with self._lock:
            idents = list(self._announced.values())
        return sorted((i for i in idents if job_id is None or i.job_id == job_id), key=lambda i: (i.job_id, i.rank))

    def verdict(self, job_id: str) -> HangVerdict | None:
        with self._lock:
            st = self._jobs.get(job_id)
            return st.verdict if st else None

    def evidence(self, job_id: str) -> Evidence | None:
        with self._lock:
            st = self._jobs.get(job_id)
            return st.evidence if st else None

    # -- one poll -----------------------------------------------------------------------------------

    def poll_once(self, now: float | None = None) -> PollResult:
        started = time.monotonic()
        now = self._clock() if now is None else now
        procs = list(self._processes()) if self._processes is not None else []
        disc = discover(procs, proc=self._proc, owners=self._owners, cache=self._inspected)
        with self._lock:
            self._discovery = disc
        self._announce(disc)
        jobs = disc.jobs()
        statuses = self._ask_ras(jobs)
        verdicts: dict[str, HangVerdict] = {}
        with self._lock:
            for job in jobs:
                # the first periodic dump one interval after the job is found: its first collectives are
                # warm-up (a rank timing its loop while the others wait) and would read as a straggler
                st = self._jobs.setdefault(job.job_id, JobState(
                    HangJudge(self.settings.hang_threshold_s, fast_floor_s=self.settings.fast_hang_floor_s),
                    last_periodic=now))
                status = statuses.get(job.job_id)
                if isinstance(status, ras.RasStatus):
                    st.ras_seen, st.ras_error = True, None
                    judged = st.judge.observe(status, now, _activity(job, status, self._proc))
                    st.verdict = next((v for v in judged if v.kind != "diverged"), None)
                    st.diverged = [v for v in judged if v.kind == "diverged"]
                else:
                    st.ras_error = status if isinstance(status, str) else "no answer from RAS"
                    st.verdict, st.diverged = None, []
                if st.verdict is None and st.evidence is not None and not st.evidence_running:
                    st.evidence = None  # the hang is over: the next one gets fresh evidence
                if st.verdict is not None:
                    verdicts[job.job_id] = st.verdict
                    self._maybe_collect(job, st)
                elif self._periodic_due(job, st, now):
                    self._maybe_collect(job, st, periodic=True, now=now)
            for gone in set(self._jobs) - {j.job_id for j in jobs}:
                del self._jobs[gone]
            self._counters["polls"] += 1
        readings = self._gpu_readings()
        with self._lock:
            for job in jobs:
                st = self._jobs[job.job_id]
                row = {r: dict(readings[p.gpu_index]) for r, p in job.ranks.items()
                       if p.gpu_index is not None and p.gpu_index in readings}
                st.gpu_history = [*st.gpu_history, row][-GPU_HINT_POLLS:]
                st.launched = [*st.launched, st.judge.last_advance == now][-GPU_HINT_POLLS:]
        findings = self.findings(disc, jobs)
        if self.view is not None:
            self.view.publish_findings(SOURCE, findings, interval_s=self.settings.poll_interval_s)
        self._last_poll_s = time.monotonic() - started
        return PollResult(disc, {k: v for k, v in statuses.items() if isinstance(v, ras.RasStatus)}, verdicts,
                          findings, self._last_poll_s)

    def _ask_ras(self, jobs: list[DiscoveredJob]) -> dict[str, ras.RasStatus | str]:
        """One status per job: RAS listens on each node once per port, answering for a random process."""
        out: dict[str, ras.RasStatus | str] = {}
        by_addr: dict[tuple[str, int, int | None], list[DiscoveredJob]] = {}
        for job in jobs:
            first = next(iter(job.ranks.values()))
            li = first.launch
            assert li is not None
            if not li.ras_enabled:
                out[job.job_id] = "NCCL RAS is off in this job (NCCL_RAS_ENABLE=0 at launch)"
                continue
            if not _loopback(li.ras_host):
                # the job's environment names the address: the agent connects only to loopback (the job's own
                # network namespace), never to a host a process points it at
                out[job.job_id] = (f"NCCL_RAS_ADDR names {li.ras_host[:64]}, not loopback: the agent asks NCCL RAS "
                                   "only on loopback")
                continue
            by_addr.setdefault(("localhost", li.ras_port, _netns_pid(first, self._proc)), []).append(job)
        for (host, port, netns), group in by_addr.items():
            waiting = {j.job_id: j for j in group}
            for _attempt in range(len(group) + 2):
                try:
                    reply = self._query(host, port, fmt=self.settings.ras_format, timeout_s=self.settings.ras_timeout_s,
                                        netns_pid=netns)
                    status = ras.parse(reply)
                except (ras.RasUnavailable, ras.RasProtocolError, TimeoutError, OSError) as exc:
                    with self._lock:
                        self._counters["ras_errors"] += 1
                    for job_id in waiting:
                        out[job_id] = str(exc) or type(exc).__name__
                    break
                with self._lock:
                    self._counters["ras_queries"] += 1
                    self._last_ras_s = reply.seconds
                self._record(reply)
                pids = status.pids()
                for job_id, job in list(waiting.items()):
                    if any(p.pids() & pids for p in job.ranks.values()):
                        out[job_id] = status
                        del waiting[job_id]
                if not waiting:
                    break
            for job_id in waiting:
                out.setdefault(job_id, f"RAS at {host}:{port} answered for other jobs only (this job's NCCL may "
                                       "predate RAS, or run as another user: SO_REUSEPORT shares a port per user)")
        return out

    def _record(self, reply: ras.RasReply) -> None:
        if not self.settings.record_dir:
            return
        folder = Path(self.settings.record_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"ras_{time.time():.3f}.{reply.format}").write_text(reply.text)

    # -- evidence -----------------------------------------------------------------------------------

    def _periodic_due(self, job: DiscoveredJob, st: JobState, now: float) -> bool:
        every = self.settings.periodic_dump_s
        ready = all(p.launch is not None and p.launch.dump_ready is None for p in job.ranks.values())
        return every > 0 and ready and not st.evidence_running and now - st.last_periodic >= every

    def _maybe_collect(self, job: DiscoveredJob, st: JobState, *, periodic: bool = False, now: float = 0.0) -> None:
        if st.evidence_running or (not periodic and (st.evidence is not None or not self.settings.dump_on_hang)):
            return
        if not any(p.launch is not None and p.launch.dump_ready is None for p in job.ranks.values()) and periodic:
            return
        st.evidence_running = True
        if periodic:
            st.last_periodic = now
        root = Path(self.settings.evidence_dir)
        kind = "periodic" if periodic else "hang"
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{int(time.time() * 1000) % 1000:03d}"
        folder = root / f"{_safe(job.job_id)}-{kind}-{stamp}"

        def run() -> None:
            try:
                ev = collect(job, folder, dump_timeout_s=self.settings.dump_timeout_s,
                             stacks=self.settings.stacks and not periodic, native=self.settings.stacks_native,
                             triage_timeout_s=self.settings.triage_timeout_s, proc=self._proc, on_dump=self._count_dump)
            except Exception as exc:
                log.exception("evidence for job %s failed", job.job_id)
                ev = Evidence(str(folder), triage_error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                st.evidence_running = False
                if periodic:
                    st.periodic_findings = _periodic_findings(ev, job.job_id)
                    shutil.rmtree(folder, ignore_errors=True)  # only the verdict is kept
                else:
                    st.evidence = ev
            if not periodic:
                log.warning("job %s: evidence in %s: %s", job.job_id, ev.folder, ev.summary())
            self._prune(root)

        self._pool.submit(run)

    def _count_dump(self, _rank: int, ok: bool) -> None:
        with self._lock:
            self._counters["dumps_ok" if ok else "dumps_failed"] += 1

    def _prune(self, root: Path) -> None:
        try:
            folders = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
        except OSError:
            return
        for old in folders[:-self.settings.keep_evidence] if self.settings.keep_evidence > 0 else folders:
            shutil.rmtree(old, ignore_errors=True)

    # -- RankSource for the coordinator's requests (discovered ranks) ---------------------------------

    def iter_dumps(self, job_id: str, rank: int | None, out_dir: str | None = None, timeout_s: float = 30.0
                   ) -> Iterator[tuple[int, bytes | str | Exception]]:
        job = self.discovery().job(job_id)
        targets = dict(job.ranks) if job is not None else {}
        if rank is not None:
            targets = {rank: targets[rank]} if rank in targets else {}
            if not targets:
                yield rank, LookupError(f"rank {rank} of job {job_id} was not found on this node")
                return
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, len(targets)))) as pool:
            futs = {pool.submit(request_dump, p, timeout_s=timeout_s, proc=self._proc): r for r, p in targets.items()}
            for fut in concurrent.futures.as_completed(futs):
                r = futs[fut]
                try:
                    yield r, fut.result().data
                    self._count_dump(r, True)
                except DumpError as exc:
                    self._count_dump(r, False)
                    yield r, exc

    def request_stacks(self, job_id: str, rank: int | None, timeout_s: float = 10.0
                       ) -> dict[int, dict[str, Any] | Exception]:
        job = self.discovery().job(job_id)
        out: dict[int, dict[str, Any] | Exception] = {}
        for r, p in (job.ranks.items() if job is not None else []):
            if rank is None or r == rank:
                answer = pyspy_stacks(p.pid, native=self.settings.stacks_native, timeout_s=timeout_s)
                out[r] = answer if "py_spy" in answer else RuntimeError(str(answer.get("py_spy_error")))
        return out

    # -- findings and samples -------------------------------------------------------------------------

    def findings(self, disc: Discovery, jobs: list[DiscoveredJob]) -> list[Finding]:
        out: list[Finding] = []
        readings = self._gpu_readings()
        with self._lock:
            states = {j.job_id: self._jobs.get(j.job_id) for j in jobs}
        for job in jobs:
            st = states[job.job_id]
            if st is None:
                continue
            if st.ras_error is not None:
                out.append(Finding(
                    "ras.unavailable", Severity.INFO, Entity(EntityKind.JOB, job.job_id),
                    f"job {job.job_id}: NCCL RAS not available ({st.ras_error}); its hangs are not seen without "
                    "configuration here", Action.NONE, {"job_id": job.job_id, "reason": st.ras_error}, SOURCE))
            if st.verdict is not None:
                out += self._hang_findings(job, st, readings)
            out += [_diverged_finding(job, v) for v in st.diverged]
            out += st.periodic_findings
            # a hint only over polls at each of which the job launched more: a hung rank's GPU idles too, and so
            # does a rank writing a checkpoint (seen on 2 x H200: a "host-side" hint right after a 20 s checkpoint
            # when the window still held it)
            moving = len(st.launched) >= GPU_HINT_POLLS and all(st.launched)
            if moving and st.verdict is None and not any(f.code.startswith("rank.straggler")
                                                         for f in st.periodic_findings):
                out += _gpu_straggler_hints(job, st.gpu_history)
        return out

    def _hang_findings(self, job: DiscoveredJob, st: JobState, readings: Mapping[int, Mapping[str, float]]
                       ) -> list[Finding]:
        v = st.verdict
        assert v is not None
        out: list[Finding] = []
        gpu_findings = self.view.current_findings() if self.view is not None else []
        for c in v.culprits:
            local = job.by_pid(c.rank.pid) if c.rank.pid is not None else None
            ev = _culprit_evidence(job, v, c, local, readings)
            ev["threshold_s"] = self.settings.hang_threshold_s
            if local is not None and local.gpu_uuid is not None:
                ev["gpu_findings"] = [f.to_dict() for f in gpu_findings if f.entity.id == local.gpu_uuid
                                      or (f.entity.gpu_index == local.gpu_index and f.entity.kind is EntityKind.GPU)]
            if st.evidence is not None:
                ev["evidence"] = st.evidence.summary()
            elif st.evidence_running:
                ev["evidence"] = "being collected (flight-recorder dumps, stacks, triage)"
            who = (f"rank {local.launch.rank} (process {local.pid}, GPU {local.gpu_index})"
                   if local is not None and local.launch is not None else
                   f"process {c.rank.pid} on node {c.rank.host or '?'} (GPU {c.rank.nvml_dev})")
            verdict_word = "hung" if v.kind == "hang" else "launched different collectives"
            msg = (f"job {job.job_id} {verdict_word}: {who} stopped at {c.op} #{c.count} while {c.ahead_ranks} "
                   f"rank(s) reached #{c.ahead_count} in communicator {c.comm}; no progress for {v.stalled_s:.0f} s")
            tri = (st.evidence.report or {}).get("summary") if st.evidence is not None else None
            if tri:
                msg += f". Flight recorder: {tri}"
            entity = Entity(EntityKind.RANK, str(local.launch.rank) if local is not None and local.launch is not None
                            else f"{c.rank.host}:{c.rank.pid}", local.gpu_index if local is not None else None)
            out.append(Finding("rank.stuck", Severity.CRITICAL if local is not None else Severity.INFO, entity, msg,
                               Action.CHECK_JOB if local is not None else Action.NONE, ev, SOURCE))
        return out

    def _gpu_readings(self) -> dict[int, dict[str, float]]:
        """Utilisation, power and power limit per GPU index, from the agent's last telemetry."""
        out: dict[int, dict[str, float]] = {}
        if self.view is None:
            return out
        wanted = {"gpu_utilization_ratio": "util", "gpu_power_watts": "power_w", "gpu_power_limit_watts": "limit_w",
                  "gpu_sm_active_ratio": "sm"}
        for s in self.view.snapshot().samples:
            if s.gpu is not None and s.name in wanted:
                out.setdefault(s.gpu, {})[wanted[s.name]] = s.value
        return out

    def samples(self) -> list[Sample]:
        disc = self.discovery()
        with self._lock:
            counters, last_ras = dict(self._counters), self._last_ras_s
            ras_ok = {j: st.ras_error is None and st.ras_seen for j, st in self._jobs.items()}
        per_gpu: dict[tuple[int, str], int] = {}
        for p in disc.processes:
            for index, _uuid in p.gpus:
                key = (index, "rank" if p.is_rank else "other")
                per_gpu[key] = per_gpu.get(key, 0) + 1
        out = [Sample("agent_gpu_processes", float(n), "Compute processes on the GPU, by kind (a torch rank or other)",
                      gpu=i, labels=(("kind", kind),)) for (i, kind), n in sorted(per_gpu.items())]
        out += [Sample("agent_discovered_ranks", float(len(j.ranks)), "Ranks of the job found on this node (zero-code)",
                       labels=(("job_id", j.job_id),)) for j in disc.jobs()]
        out += [Sample("agent_ras_available", 1.0 if ok else 0.0, "1 while the job's NCCL RAS service answers",
                       labels=(("job_id", j),)) for j, ok in sorted(ras_ok.items())]
        out += [
            Sample("agent_ras_queries", float(counters["ras_queries"]), "NCCL RAS status queries answered",
                   MetricKind.COUNTER),
            Sample("agent_ras_query_seconds", last_ras, "Duration of the last NCCL RAS status query"),
            *(Sample("agent_fr_dumps", float(counters[key]), "Flight-recorder dumps taken through a rank's FIFO",
                     MetricKind.COUNTER, labels=(("result", result),))
              for key, result in (("dumps_ok", "ok"), ("dumps_failed", "failed"))),
        ]
        return out


def _culprit_evidence(job: DiscoveredJob, v: HangVerdict, c: BehindRank, local: DiscoveredProcess | None,
                      readings: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "job_id": job.job_id, "kind": v.kind, "communicator": c.comm, "collective": c.op, "launched": c.count,
        "others_launched": c.ahead_count, "waiting_ranks": c.ahead_ranks, "comm_rank": c.rank.comm_rank,
        "pid": c.rank.pid, "node": c.rank.host, "nvml_dev": c.rank.nvml_dev, "stalled_s": round(v.stalled_s, 1),
        "polls": v.polls, "local": local is not None, "behind": [b.describe() for b in v.behind][:32],
        "source": "NCCL RAS",
    }
    if local is not None and local.launch is not None:
        ev.update(rank=local.launch.rank, world_size=local.launch.world_size, host_pid=local.pid,
                  gpu_uuid=local.gpu_uuid, gpu_index=local.gpu_index, local_rank=local.launch.local_rank,
                  dumps=local.launch.dump_ready or "ready")
    spinning = {}
    for rank, p in job.ranks.items():
        r = readings.get(p.gpu_index) if p.gpu_index is not None else None
        if r and "util" in r and "power_w" in r:
            share = r["power_w"] / r["limit_w"] if r.get("limit_w") else None
            spinning[str(rank)] = {"gpu": p.gpu_index, "utilization": round(r["util"], 3),
                                   "power_w": round(r["power_w"], 1),
                                   "power_share": None if share is None else round(share, 3),
                                   "spinning": bool(share is not None and r["util"] >= SPIN_UTIL_MIN
                                                    and share <= SPIN_POWER_MAX)}
    if spinning:
        ev["gpus"] = spinning  # a GPU busy at near-idle power spins in a kernel: evidence, not a verdict
    return ev


def _diverged_finding(job: DiscoveredJob, v: HangVerdict) -> Finding:
    names = []
    for c in v.culprits:
        local = job.by_pid(c.rank.pid) if c.rank.pid is not None else None
        who = (f"rank {local.launch.rank}" if local is not None and local.launch is not None
               else f"process {c.rank.pid} on {c.rank.host or '?'}")
        names.append(f"{who} launched {c.op} up to #{c.count} (the others #{c.ahead_count})"
                     if c.count != c.ahead_count else f"{who} launched {c.op} up to #{c.count}")
    op = v.culprits[0].op if v.culprits else "?"
    msg = (f"job {job.job_id}: its ranks launched different collectives and NCCL paired them — "
           f"{'; '.join(names)}; held for {v.stalled_s:.0f} s while the job goes on: every result computed "
           "since is silently wrong")
    return Finding("collective.launch_mismatch", Severity.CRITICAL, Entity(EntityKind.JOB, job.job_id), msg,
                   Action.CHECK_JOB, {"job_id": job.job_id, "communicator": v.comms[0] if v.comms else None,
                                      "collective": op, "collectives": sorted({c.op for c in v.culprits}),
                                      "ranks": names, "stalled_s": round(v.stalled_s, 1),
                                      "polls": v.polls, "source": "NCCL RAS"}, SOURCE)


SILENT_MISMATCH_CODES = ("collective.type_mismatch", "collective.size_mismatch", "collective.dtype_mismatch")


def _periodic_findings(ev: Evidence, job_id: str) -> list[Finding]:
    """What a periodic dump's triage proves about a running job, tagged with the job for the coordinator:

    - stragglers (the detector's own codes and words): the coordinator keeps them as the job's stragglers (a
      discovered job sends no steps);
    - silent mismatches: two ranks recorded different collectives (type, size or dtype) at the same sequence
      number of a group, and the op **completed** on both: every rank is past it, so no timing of the dumps
      explains it, and the results are wrong. Critical: the loss curve looks fine while the model is garbage.

    Live dumps are taken a moment apart: any other verdict (an op one rank's dump does not show yet) is about
    that, not the job, and is dropped."""
    out: list[Finding] = []
    report = ev.report or {}
    verdict = report.get("verdict")
    if verdict not in ("straggler", "mismatch"):
        return out
    for f in report.get("findings") or []:
        try:
            finding = Finding.from_dict(f)
        except (KeyError, ValueError, TypeError):
            continue
        tagged = {**finding.evidence, "job_id": job_id, "source": "periodic flight-recorder dumps"}
        if verdict == "straggler" and (finding.code.startswith("rank.straggler") or finding.code == "job.slowdown"):
            out.append(dataclasses.replace(finding, evidence=tagged))
        elif (verdict == "mismatch" and finding.code in SILENT_MISMATCH_CODES
              and finding.evidence.get("completed") is True):
            where = (finding.evidence.get("group"), finding.evidence.get("seq"))
            if any((g.evidence.get("group"), g.evidence.get("seq")) == where for g in out):
                continue  # one finding per collective: the other side of a tie says the same (both in "variants")
            out.append(dataclasses.replace(
                finding, severity=Severity.CRITICAL, entity=Entity(EntityKind.JOB, job_id),
                message=f"job {job_id}: {finding.message}", evidence=tagged))
    return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1]
                                                                 + ordered[len(ordered) // 2]) / 2


def _gpu_straggler_hints(job: DiscoveredJob, history: Sequence[Mapping[int, Mapping[str, float]]]) -> list[Finding]:
    """Info ``rank.straggler`` hints from the local ranks' GPUs over the last polls (``GPU_HINT_*``): the rank whose
    GPU's SMs are busier than every peer's by the ratio (GPU-side: it computes more, or slower), or whose GPU
    idles while every peer's is busy (host-side: its data loader or host code is late). Only for a job that keeps
    launching (the caller checks): a hung rank's GPU idles too, and so does a rank writing a checkpoint."""
    if len(history) < GPU_HINT_POLLS:
        return []
    ranks = sorted(set.intersection(*(set(h) for h in history)))
    if len(ranks) < 2:
        return []

    def medians(part: Sequence[Mapping[int, Mapping[str, float]]], key: str) -> dict[int, float]:
        return {r: _median([h[r][key] for h in part if key in h[r]] or [0.0]) for r in ranks}

    sm, busy = medians(history, "sm"), medians(history, "util")
    # a hint must hold in both halves of the window: a healthy job's ranks trade places (a flight-recorder dump
    # held one for a few seconds: one half's ratio 1.28, the other's 0.96), a straggler stays put (1.28, 1.29)
    halves = (history[:len(history) // 2], history[len(history) // 2:])
    half_sm, half_busy = [medians(h, "sm") for h in halves], [medians(h, "util") for h in halves]
    out: list[Finding] = []
    for r in ranks:
        peers = [p for p in ranks if p != r]
        peer_sm, peer_busy = _median([sm[p] for p in peers]), _median([busy[p] for p in peers])
        ev: dict[str, Any] = {"job_id": job.job_id, "rank": r, "gpu": job.ranks[r].gpu_index,
                              "source": "GPU activity (NVML)", "polls": len(history),
                              "sm_active": round(sm[r], 3), "peers_sm_active": round(peer_sm, 3),
                              "busy": round(busy[r], 3), "peers_busy": round(peer_busy, 3)}
        sm_held = all(h[r] >= GPU_HINT_SM_MIN and h[r] >= GPU_HINT_SM_RATIO * _median([h[p] for p in peers]) > 0
                      for h in half_sm)
        host_held = all(_median([h[p] for p in peers]) >= HOST_HINT_PEERS_BUSY
                        and _median([h[p] for p in peers]) - h[r] >= HOST_HINT_BUSY_GAP for h in half_busy)
        if sm_held:
            ratio = sm[r] / peer_sm
            out.append(Finding(
                "rank.straggler", Severity.INFO, Entity(EntityKind.RANK, str(r), job.ranks[r].gpu_index),
                f"job {job.job_id}: rank {r}'s GPU keeps its SMs {ratio:.2f}x as busy as its peers' "
                f"({sm[r]:.0%} vs {peer_sm:.0%}): a GPU-side straggler (more work, or a slower GPU); a hint from "
                "the GPUs alone", Action.NONE, {**ev, "kind": "gpu", "ratio": round(ratio, 3)}, SOURCE))
        elif host_held:
            out.append(Finding(
                "rank.straggler", Severity.INFO, Entity(EntityKind.RANK, str(r), job.ranks[r].gpu_index),
                f"job {job.job_id}: rank {r}'s GPU is busy {busy[r]:.0%} of the time while its peers' are "
                f"{peer_busy:.0%}: a host-side straggler (its data loader or host code is late); a hint from the "
                "GPUs alone", Action.NONE, {**ev, "kind": "host", "idle_share": round(1 - busy[r], 3)}, SOURCE))
    return out


def _activity(job: DiscoveredJob, status: ras.RasStatus, proc: Path) -> dict[Process, Activity]:
    """Each local rank's CPU seconds and I/O bytes now (``/proc/<pid>/stat``, ``/proc/<pid>/io``), keyed as RAS
    names its process (host, pid in its namespace); a rank RAS shows whose pid and GPU match a local one."""
    local = {pid: p for p in job.ranks.values() for pid in p.pids()}
    out: dict[Process, Activity] = {}
    for comm in status.communicators:
        for r in comm.ranks:
            p = local.get(r.pid or -1)
            if p is None or (r.nvml_dev is not None and p.gpu_index is not None and r.nvml_dev != p.gpu_index):
                continue  # another node's process with the same number
            act = read_activity(p.pid, proc)
            if act is not None:
                out[(r.host, r.pid or 0)] = act
    return out


def read_activity(pid: int, proc: Path = Path("/proc")) -> Activity | None:
    """CPU seconds (user + system, every thread) and bytes read and written (``rchar`` + ``wchar``: page cache
    included, so a checkpoint's writes count before they reach the disk); None when unreadable."""
    try:
        stat = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(stat[11]) + int(stat[12])) / _CLOCK_TICKS
        io = 0.0
        for line in (proc / str(pid) / "io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("rchar", "wchar"):
                io += float(value)
    except (OSError, IndexError, ValueError):
        return None
    return Activity(cpu, io)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:80] or "_"


def _safely(cb: Callable[[RankIdentity], None], ident: RankIdentity) -> None:
    try:
        cb(ident)
    except Exception:
        log.exception("zero-code listener failed")


__all__ = ["PollResult", "ZeroCodeSettings", "ZeroCodeWatcher", "settings_from"]
