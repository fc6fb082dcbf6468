"""The agent's footprint, thread by thread: where its CPU, wake-ups and memory go, and whether every check
still keeps its cadence (issue 34).

Runs ``gpuhealth agent`` as shipped (a subprocess with a config file) in three states — idle, one job watched,
four jobs watched — and for each, over ``--seconds`` (≥ 60), reports for all of the agent's processes
(children included):

- CPU per thread (utime + stime from ``/proc/<pid>/task/<tid>/stat``) and wake-ups per second per thread
  (voluntary + involuntary context switches from ``/proc/<pid>/task/<tid>/status``); threads are named by
  the names Python gave them (``py-spy dump`` maps native thread ids to them; the kernel's ``comm`` otherwise);
- RSS split into anonymous and file-backed (``RssAnon``/``RssFile``, max over the window) and the largest
  mappings (``/proc/<pid>/smaps``);
- the Python modules loaded (the agent runs with ``PYTHONPROFILEIMPORTTIME=1``: its count and the heaviest
  imports by cumulative import time, by top-level package);
- a sampling profile (``py-spy record --nonblocking``, in a second window after the measured one so the
  sampler's own CPU and ptrace stops do not land in the numbers): the functions where the CPU goes;
- the age of each collector's freshest reading (``/health``: ``time`` − ``last_success_time``, worst seen in
  the window, against its interval) and the zero-code watcher's RAS queries per second against one per job
  per poll interval — so a saving that slows detection shows as a regression.

The "job watched" states run real torchrun jobs (``tests/integration/zerocode_job/train.py``, launched with
the variables a zero-code launch exports), found by the agent's zero-code discovery through the same code path
as on GPUs: NVML's compute processes (``ComputeRunningProcesses``) → ``/proc/<pid>/environ`` → one NCCL RAS
query per job per poll. On this CPU box the GPUs are the 8 simulated H200s cloned from the real recording, the
jobs run on Gloo, NVML's process list is the scenario's (the jobs' own pids) and RAS is a local server speaking
NCCL's protocol and format with the job's own pids, counts rising. ``--live``: the agent reads this machine's
GPUs through NVML and the jobs run on NCCL (their own RAS, on by default since NCCL 2.24) — on a 1-GPU machine::

    PYTHONPATH=src python benchmarks/agent_footprint.py --live --ranks-per-job 1 --seconds 60 --json out.json

``--tree LABEL=SRC`` (repeatable) runs one agent per source tree at the same time on the same jobs, e.g. the
code before a change (``git worktree add /tmp/before <commit>``) beside this one: on a loaded machine only a
side-by-side run compares fairly. Default: this checkout's ``src``.

    PYTHONPATH=src python benchmarks/agent_footprint.py [--states idle,one,four] [--seconds 60] \\
        [--tree before=/tmp/before/src --tree after=src] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "tests" / "integration" / "zerocode_job" / "train.py"
SCENARIO = "recording: nvml_h200x2.json\ngpu_count: 8\n"
TICK = os.sysconf("SC_CLK_TCK")
LANE_INTERVAL_S = {"fast": 5.0, "slow": 60.0}  # collectors.fast_interval_s / slow_interval_s, the defaults
STATES = {"idle": 0, "one": 1, "four": 4}  # state → jobs watched


# ------------------------------------------------------------------------------------------- /proc parsing
@dataclass(frozen=True)
class TaskSample:
    tid: int
    comm: str
    cpu_ticks: int  # utime + stime
    switches: int  # voluntary + involuntary context switches
    cpu_ns: int = 0  # time on a CPU (schedstat): the same as the ticks, to the nanosecond


def parse_stat(text: str) -> tuple[str, int]:
    """(comm, utime + stime in ticks) from a ``/proc/<pid>/task/<tid>/stat`` line. ``comm`` may hold spaces
    and parentheses: it is everything between the first ``(`` and the last ``)``."""
    open_, close = text.index("("), text.rindex(")")
    rest = text[close + 2:].split()
    # rest[0] is field 3 (state); utime and stime are fields 14 and 15
    return text[open_ + 1:close], int(rest[11]) + int(rest[12])


def parse_schedstat(text: str) -> int:
    """Nanoseconds on a CPU from ``/proc/<pid>/task/<tid>/schedstat`` (its first field): what the 10 ms ticks of
    ``stat`` say, precise enough for a thread that runs for microseconds at a time."""
    return int(text.split()[0])


def parse_status(text: str) -> dict[str, int]:
    """The numeric fields of ``/proc/<pid>/status`` (kB values in kB), e.g. ``RssAnon``, ``voluntary_ctxt_switches``."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        parts = value.split()
        if sep and parts and parts[0].isdigit():
            out[key] = int(parts[0])
    return out


def parse_smaps(text: str) -> dict[str, int]:
    """Resident kB per mapping name from ``/proc/<pid>/smaps`` (anonymous mappings as ``[anon]``; one
    file's several mappings summed)."""
    out: Counter[str] = Counter()
    name = ""
    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and not head[0].endswith(":"):
            name = head[5].strip() if len(head) == 6 else "[anon]"
        elif line.startswith("Rss:"):
            out[name] += int(line.split()[1])
    return dict(out)


def parse_importtime(lines: Iterable[str]) -> list[tuple[str, int, int]]:
    """(module, self µs, cumulative µs) from ``-X importtime`` lines (``import time: 12 | 345 | name``); the
    header line is skipped. The indent of a name shows nesting; it is stripped."""
    out = []
    for line in lines:
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            out.append((m.group(4), int(m.group(1)), int(m.group(2))))
    return out


def parse_pyspy_threads(dump: str) -> dict[int, str]:
    """Native thread id → Python thread name from ``py-spy dump`` (``Thread 14455 (idle): "gpuhealth-http-0"``)."""
    return {int(t): n for t, n in re.findall(r'^Thread (?:0x)?(\d+) \([^)]*\): "([^"]*)"', dump, re.M)}


def parse_pyspy_raw(text: str) -> tuple[Counter[str], Counter[str], int]:
    """From ``py-spy record --format raw --threads [--subprocesses]``: samples per leaf function (``name (file)``),
    per thread (the first frame after the ``process …`` one, as py-spy names it) and the total."""
    leaves: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        if frames[0].startswith("process ") and len(frames) > 1:
            frames = frames[1:]
        total += n
        threads[frames[0]] += n
        leaf = re.sub(r":\d+\)$", ")", frames[-1])  # one row per function, not per line
        leaves[leaf] += n
    return leaves, threads, total


# ------------------------------------------------------------------------------------------- the agent's tree
def tree_pids(pid: int) -> list[int]:
    """``pid`` and every descendant (``/proc/<pid>/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in _listdir(f"/proc/{p}/task"):
            try:
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    return out


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def sample_tasks(pids: Sequence[int]) -> dict[tuple[int, int], TaskSample]:
    out = {}
    for pid in pids:
        for t in _listdir(f"/proc/{pid}/task"):
            try:
                comm, ticks = parse_stat(Path(f"/proc/{pid}/task/{t}/stat").read_text())
                st = parse_status(Path(f"/proc/{pid}/task/{t}/status").read_text())
                ns = parse_schedstat(Path(f"/proc/{pid}/task/{t}/schedstat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            switches = st.get("voluntary_ctxt_switches", 0) + st.get("nonvoluntary_ctxt_switches", 0)
            out[(pid, int(t))] = TaskSample(int(t), comm, ticks, switches, ns)
    return out


def memory_kb(pids: Sequence[int]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for pid in pids:
        try:
            st = parse_status(Path(f"/proc/{pid}/status").read_text())
        except OSError:
            continue
        for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"):
            total[k] += st.get(k, 0)
    return dict(total)


def thread_names(pid: int, pyspy: str | None) -> dict[int, str]:
    if not pyspy:
        return {}
    try:
        dump = subprocess.run([pyspy, "dump", "--nonblocking", "-p", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_pyspy_threads(dump)


# ------------------------------------------------------------------------------------------- jobs
class _RisingCounts:
    """RAS replies for ``FakeRas``: every query answers with each rank's collective counts one higher (a
    healthy job that makes progress), in NCCL 2.28.9's JSON format."""

    def __init__(self, pids: dict[int, int]) -> None:
        from zc_fakes import Comm, Rank, json_reply

        self._make = lambda n: json_reply([Comm(0x5EED, [Rank(r, p, r, {"AllReduce": n}) for r, p in pids.items()])])

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> dict[str, str]:
        return {"json": self._make(i + 1)}


@dataclass
class Job:
    tag: str
    proc: subprocess.Popen[bytes]
    log: Path
    ras: Any = None
    pids: dict[int, int] = field(default_factory=dict)  # rank → pid

    def wait_ready(self, ranks: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.findall(r"rank (\d+)/\d+ pid (\d+) ready", self.log.read_text(errors="replace"))
            if len(found) >= ranks:
                self.pids = {int(r): int(p) for r, p in found}
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"job {self.tag} did not start: {self.log.read_text(errors='replace')[-2000:]}")

    def stop(self) -> None:
        for pid in self.pids.values():
            _kill(pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        if self.ras is not None:
            self.ras.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def start_jobs(n: int, ranks: int, work: Path, live: bool) -> list[Job]:
    from gpuhealth.agent.zerocode.environ import launch_variables

    jobs = []
    for j in range(n):
        tag = f"bench{j}"
        env = {**os.environ, **launch_variables(tag, folder=str(work))}
        env.pop("PYTHONPROFILEIMPORTTIME", None)
        ras = None
        if not live:  # the job's NCCL RAS: a local server, its replies made once the ranks' pids are known
            from zc_fakes import FakeRas

            ras = FakeRas([{"json": ""}])
            env["NCCL_RAS_ADDR"] = f"127.0.0.1:{ras.port}"
        if live:
            # rank r of job j on GPU (j * ranks + r) mod the GPUs there are: four jobs share one GPU on a 1-GPU box
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str((j * ranks + r) % _gpu_count()) for r in range(ranks))
        log = work / f"{tag}.log"
        args = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(TRAIN),
                "--backend", "nccl" if live else "gloo", "--steps", "0", "--compute-s", "0.05"]
        with log.open("wb") as fh:
            proc = subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                    cwd=work)
        jobs.append(Job(tag, proc, log, ras))
    for job in jobs:
        job.wait_ready(ranks)
        if job.ras is not None:
            job.ras.replies = _RisingCounts(job.pids)  # a reply per query, made when asked
    return jobs


def _gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return max(1, out.count("GPU "))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scenario_for(jobs: Sequence[Job]) -> str:
    """The 8-GPU scenario with each rank's pid in NVML's process list of GPU (job × ranks + rank), as NVML
    lists a rank on the GPU it uses. The RAS address reaches the agent through the rank's environment."""
    lines = [SCENARIO.rstrip("\n")]
    procs: dict[int, list[dict[str, int]]] = {}
    gpu = 0
    for job in jobs:
        for _rank, pid in sorted(job.pids.items()):
            procs.setdefault(gpu % 8, []).append({"pid": pid, "usedGpuMemory": 1 << 30})
            gpu += 1
    if procs:
        lines.append("overrides:")
        for g, entries in sorted(procs.items()):
            lines.append(f'  "{g}": {{ComputeRunningProcesses: {json.dumps(entries)}}}')
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- one agent
class Agent:
    def __init__(self, label: str, src: Path, work: Path, scenario: Path | None) -> None:
        self.label, self.work = label, work
        work.mkdir(parents=True, exist_ok=True)
        cfg = work / "agent.yaml"
        # simulated: the scenario's process list names this machine's ranks (a tree without the key cannot run it)
        cfg.write_text(f"agent:\n  pod_resources_socket: {work / 'none.sock'}\n  socket_path: {work / 'agent.sock'}\n"
                       f"  state_dir: {work / 'state'}\n"
                       + ("zerocode:\n  simulated_processes: true\n" if scenario is not None else ""))
        self.port = _free_port()
        args = [sys.executable, "-m", "gpuhealth.cli.main", "agent", "--config", str(cfg),
                "--listen", f"127.0.0.1:{self.port}"]
        if scenario is not None:
            args += ["--scenario", str(scenario)]
        env = {**os.environ, "PYTHONPATH": str(src.resolve()), "PYTHONPROFILEIMPORTTIME": "1"}
        self.log = work / "agent.log"
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        raise RuntimeError(f"agent {self.label} not ready: {self.log.read_text(errors='replace')[-2000:]}")

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=15) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Window:
    """What one agent did over the measured window."""

    start: dict[tuple[int, int], TaskSample] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    mem_max: dict[str, int] = field(default_factory=dict)
    ages: dict[str, list[float]] = field(default_factory=dict)
    intervals: dict[str, float] = field(default_factory=dict)
    runs0: dict[str, int] = field(default_factory=dict)
    runs1: dict[str, int] = field(default_factory=dict)
    ras0: float = 0.0


def ras_queries(agent: Agent) -> float:
    with urllib.request.urlopen(agent.url + "/metrics", timeout=15) as r:
        text = r.read().decode()
    m = re.search(r"^gpuhealth_agent_ras_queries_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def observe_health(agent: Agent, w: Window, poll_s: float = 5.0) -> dict[str, int]:
    """Each collector's age (``time`` − ``last_success_time``) now, kept in ``w``; returns its ``runs_total``."""
    health = agent.get("/health")
    now = float(health["node"]["time"])
    runs = {}
    for c in health["node"].get("collectors", []):
        last = c.get("last_success_time")
        if last:
            w.ages.setdefault(c["name"], []).append(max(0.0, now - float(last)))
        lane = poll_s if c["name"] == "zerocode" else LANE_INTERVAL_S.get(str(c.get("lane")))
        if lane:
            w.intervals[c["name"]] = lane
        runs[c["name"]] = int(c.get("runs_total") or 0)
    return runs


def measure(agents: Sequence[Agent], seconds: float, pyspy: str | None, jobs: int, poll_s: float,
            scrape_s: float) -> dict[str, Any]:
    """Everything the window needs from /proc, sampled once a second (reading /proc costs the agent nothing);
    the agent's HTTP is asked only every ``scrape_s`` (/health and /metrics, as Prometheus scrapes), so the
    measurement adds no more wake-ups than a real scraper."""
    windows = {a.label: Window() for a in agents}
    for a in agents:
        w = windows[a.label]
        w.names = thread_names(a.proc.pid, pyspy)
        w.runs0 = observe_health(a, w, poll_s)
        w.ras0 = ras_queries(a)
        w.start = sample_tasks(tree_pids(a.proc.pid))
    t0 = time.monotonic()
    next_scrape = t0 + scrape_s
    while time.monotonic() - t0 < seconds:
        scrape = time.monotonic() >= next_scrape
        for a in agents:
            w = windows[a.label]
            for k, v in memory_kb(tree_pids(a.proc.pid)).items():
                w.mem_max[k] = max(v, w.mem_max.get(k, 0))
            if scrape:
                observe_health(a, w, poll_s)
        if scrape:
            next_scrape += scrape_s
        time.sleep(min(1.0, max(0.0, seconds - (time.monotonic() - t0))))
    elapsed = time.monotonic() - t0
    ends = {a.label: sample_tasks(tree_pids(a.proc.pid)) for a in agents}  # before this round's own requests
    out = {}
    for a in agents:
        w = windows[a.label]
        w.runs1 = observe_health(a, w, poll_s)
        pids = tree_pids(a.proc.pid)
        w.names.update({k: v for k, v in thread_names(a.proc.pid, pyspy).items() if k not in w.names})
        out[a.label] = report(a, w, ends[a.label], pids, elapsed, jobs, poll_s)
    return out


def report(a: Agent, w: Window, end: dict[tuple[int, int], TaskSample], pids: list[int], elapsed: float,
           jobs: int, poll_s: float) -> dict[str, Any]:
    rows = []
    for key, s in end.items():
        s0 = w.start.get(key)
        ticks = (s.cpu_ticks - (s0.cpu_ticks if s0 else 0)) / TICK
        cpu = (s.cpu_ns - (s0.cpu_ns if s0 else 0)) / 1e9
        wakes = s.switches - (s0.switches if s0 else 0)
        name = w.names.get(s.tid) or s.comm
        rows.append({"pid": key[0], "tid": s.tid, "thread": name, "cpu_s": round(cpu, 4), "stat_cpu_s": ticks,
                     "cpu_pct": round(cpu / elapsed * 100, 3), "wakeups_per_s": round(wakes / elapsed, 2),
                     "new": s0 is None})
    rows.sort(key=lambda r: (-r["cpu_s"], -r["wakeups_per_s"]))
    cpu_total = sum(r["cpu_s"] for r in rows)
    stat_total = sum(r["stat_cpu_s"] for r in rows)
    smaps: Counter[str] = Counter()
    for pid in pids:
        try:
            smaps.update(parse_smaps(Path(f"/proc/{pid}/smaps").read_text()))
        except OSError:
            pass
    ages = {name: {"worst_age_s": round(max(v), 1), "interval_s": w.intervals.get(name),
                   "runs": w.runs1.get(name, 0) - w.runs0.get(name, 0),
                   "runs_expected": round(elapsed / w.intervals[name], 1) if name in w.intervals else None}
            for name, v in sorted(w.ages.items())}
    ras = ras_queries(a) - w.ras0
    return {
        "seconds": round(elapsed, 1), "processes": len(pids), "threads": len(rows),
        "cpu_pct_of_one_core": round(cpu_total / elapsed * 100, 3),
        "stat_cpu_pct_of_one_core": round(stat_total / elapsed * 100, 3),  # the same from 10 ms ticks
        "wakeups_per_s": round(sum(r["wakeups_per_s"] for r in rows), 1),
        "rss_mib_max": round(w.mem_max.get("VmRSS", 0) / 1024, 1),
        "rss_anon_mib_max": round(w.mem_max.get("RssAnon", 0) / 1024, 1),
        "rss_file_mib_max": round(w.mem_max.get("RssFile", 0) / 1024, 1),
        "largest_mappings_kib": dict(smaps.most_common(8)),
        "per_thread": rows,
        "freshness": ages,
        "ras_queries_per_s": round(ras / elapsed, 3),
        "ras_expected_per_s": round(jobs / poll_s, 3),
        "modules": modules_of(a.log),
    }


def modules_of(log: Path) -> dict[str, Any]:
    mods = parse_importtime(log.read_text(errors="replace").splitlines())
    by_top: Counter[str] = Counter()
    for name, _self_us, _cum in mods:
        by_top[name.split(".")[0]] += 1
    tops = [(n, cum) for n, _s, cum in mods if "." not in n]
    return {"count": len(mods), "by_package": dict(by_top.most_common(12)),
            "heaviest_import_ms": {n: round(c / 1000, 1) for n, c in sorted(tops, key=lambda t: -t[1])[:10]}}


def profile(agents: Sequence[Agent], seconds: float, pyspy: str | None, work: Path, rate: int) -> dict[str, Any]:
    """A second window: py-spy samples each agent (non-blocking) at once; the top functions and threads."""
    if not pyspy or seconds <= 0:
        return {}
    procs = {}
    for a in agents:
        out = work / f"{a.label}.pyspy.txt"
        procs[a.label] = (out, subprocess.Popen(
            [pyspy, "record", "--nonblocking", "--threads", "--subprocesses", "--format", "raw", "--rate", str(rate),
             "--duration", str(int(seconds)), "--output", str(out), "--pid", str(a.proc.pid)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    result = {}
    for label, (out, p) in procs.items():
        p.wait(seconds + 60)
        if not out.exists():
            result[label] = {"error": "py-spy wrote nothing"}
            continue
        leaves, threads, total = parse_pyspy_raw(out.read_text(errors="replace"))
        result[label] = {"samples": total, "rate_hz": rate,
                         "top_functions": {k: v for k, v in leaves.most_common(15)},
                         "threads": {k: v for k, v in threads.most_common(12)}}
    return result


# ------------------------------------------------------------------------------------------- driver
def run_state(state: str, trees: dict[str, Path], args: argparse.Namespace, pyspy: str | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"gpuhealth-footprint-{state}-"))
    jobs = start_jobs(STATES[state], args.ranks_per_job, work, args.live) if STATES[state] else []
    agents: list[Agent] = []
    try:
        scenario = None
        if not args.live:
            scenario = work / "scenario.yaml"
            scenario.write_text(scenario_for(jobs))
        agents = [Agent(label, src, work / label, scenario) for label, src in trees.items()]
        for a in agents:
            a.wait_ready()
        time.sleep(args.warmup)
        measured = measure(agents, args.seconds, pyspy, len(jobs), args.poll_s, args.scrape_s)
        prof = profile(agents, args.profile_seconds, pyspy, work, args.profile_rate)
        for label in measured:
            measured[label]["profile"] = prof.get(label, {})
        return {"state": state, "jobs": len(jobs), "ranks_per_job": args.ranks_per_job, "agents": measured}
    finally:
        for a in agents:
            a.stop()
        for job in jobs:
            job.stop()
        shutil.rmtree(work, ignore_errors=True)


def print_state(r: dict[str, Any]) -> None:
    print(f"\n## {r['state']}: {r['jobs']} job(s) × {r['ranks_per_job']} rank(s)")
    for label, m in r["agents"].items():
        print(f"\n### {label}: {m['cpu_pct_of_one_core']} % of a core, {m['wakeups_per_s']} wake-ups/s, "
              f"RSS {m['rss_mib_max']} MiB (anon {m['rss_anon_mib_max']}, file {m['rss_file_mib_max']}), "
              f"{m['processes']} process(es), {m['threads']} threads, {m['modules']['count']} modules; "
              f"RAS {m['ras_queries_per_s']}/s (expected {m['ras_expected_per_s']}/s)")
        print("| thread | CPU % | wake-ups/s |\n|---|---|---|")
        for t in m["per_thread"]:
            print(f"| {t['thread']}{' (new)' if t['new'] else ''} | {t['cpu_pct']} | {t['wakeups_per_s']} |")
        print("freshness (worst age s / interval s, runs / expected):",
              ", ".join(f"{k} {v['worst_age_s']}/{v['interval_s']} {v['runs']}/{v['runs_expected']}"
                        for k, v in m["freshness"].items()))
        print("largest mappings (KiB):", m["largest_mappings_kib"])
        print("modules by package:", m["modules"]["by_package"])
        print("heaviest imports (ms):", m["modules"]["heaviest_import_ms"])
        p = m.get("profile") or {}
        if p.get("samples") is not None:
            print(f"profile: {p['samples']} samples at {p['rate_hz']} Hz; top functions:")
            for k, v in p["top_functions"].items():
                print(f"  {v:6d}  {k}")
            print("  by thread:", p["threads"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--states", default="idle,one,four", help="comma-separated: idle, one, four")
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window per state (default 60)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds between ready and the window (default 15; --live: 90, so the screen a live agent "
                         "runs on idle GPUs at start, in a child process, is over)")
    ap.add_argument("--profile-seconds", type=float, default=30.0, help="py-spy window after it (0: none)")
    ap.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--ranks-per-job", type=int, default=2)
    ap.add_argument("--scrape-s", type=float, default=15.0, help="/health and /metrics this often (Prometheus's 15 s)")
    ap.add_argument("--poll-s", type=float, default=5.0, help="zerocode.poll_interval_s the agent runs with")
    ap.add_argument("--live", action="store_true", help="this machine's GPUs through NVML; NCCL jobs")
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=SRC",
                    help="an agent per source tree, side by side (default: this checkout's src)")
    ap.add_argument("--json", default="", help="also write the whole result here")
    args = ap.parse_args()
    if args.warmup is None:
        args.warmup = 90.0 if args.live else 15.0
    sys.path.insert(0, str(REPO / "src"))
    sys.path.insert(0, str(REPO / "tests" / "unit" / "agent" / "zerocode"))  # zc_fakes: the RAS stand-in
    trees = dict(t.split("=", 1) for t in args.tree) if args.tree else {"agent": str(REPO / "src")}
    pyspy = shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                       if (Path(sys.executable).parent / "py-spy").exists() else None)
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "cores": os.cpu_count(), "load_avg_1m_start": round(os.getloadavg()[0], 2), "live": args.live,
           "py_spy": bool(pyspy), "trees": trees}
    print(f"# agent footprint — {env}")
    results = []
    for state in args.states.split(","):
        r = run_state(state, {k: Path(v) for k, v in trees.items()}, args, pyspy)
        r["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
        print_state(r)
        results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "states": results}, indent=1))


if __name__ == "__main__":
    main()
