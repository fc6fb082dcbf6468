#!/usr/bin/env python3
"""What an unmodified NCCL job shows from outside, fault by fault (issues 25 and 27), recorded for the tests.

Run from the repository root on a machine with 2 GPUs (``scripts/device/zerocode_signals.sh`` wraps it). One
``gpuhealth agent`` runs as shipped (zero-code on, RAS every 5 s, periodic dumps every 10 s, screening off so it
never takes the GPUs) while the scenarios below run one after the other, each an unmodified 2-rank torchrun job
(tests/integration/zerocode_job/train.py, NCCL). Beside the agent, a sampler records every 0.5 s each job's NCCL
RAS reply (JSON) and every 0.25 s each GPU's NVML readings (utilisation, power, SM clock, GPM SM/tensor
activity); for jobs launched with ``gpuhealth env``'s variables it takes both ranks' flight-recorder dumps through
their FIFOs every 10 s. The agent's /health is read every second (when it names what) and its own cost per
scenario from /proc (CPU ticks, RSS, threads, context switches).

Scenarios (the fault at ``fault_at`` seconds into the job, roughly):
  healthy_fsdp      FSDP pattern (3 all_gather + 3 reduce_scatter a step), ±15 % jitter, variables: nothing to say
  fsdp_skip         the same; rank 1 skips one reduce_scatter at step 60 and runs out of phase (silent mismatch)
  fsdp_lag          the same, no skip; rank 1 computes 1.15x (a slow rank's lag, not a mismatch), no variables
  fast_hang         all_reduce, ~10 ms steps; rank 1 host-stuck at step 600, no variables
  checkpoint        all_reduce, ~30 ms steps; rank 1 alone writes a checkpoint for 20 s at step 300 (torch.save to
                    disk again and again: CPU and I/O, as a real one), the other waits in the next collective; variables
  gpu_straggler     all_reduce, ~30 ms steps; rank 1 computes 1.3x on its GPU, no variables
  host_straggler    all_reduce, ~30 ms steps; rank 1's host waits 9 ms before each step (GPU idles), no variables

Everything lands in $OUT: run_log.txt, zerocode_signals.tar.gz (per scenario: ras.jsonl, nvml.jsonl, dumps/,
health.jsonl, agent_cost.json, job logs, steps), agent.log.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from gpuhealth.agent.view import GpuProcess  # noqa: E402
from gpuhealth.agent.zerocode import ras  # noqa: E402
from gpuhealth.agent.zerocode.discovery import discover  # noqa: E402
from gpuhealth.agent.zerocode.environ import launch_variables  # noqa: E402
from gpuhealth.agent.zerocode.fifo import DumpError, request_dump  # noqa: E402
from gpuhealth.backends.errors import NvmlError  # noqa: E402
from gpuhealth.backends.nvml_real import RealNvml  # noqa: E402

TRAIN = REPO / "tests" / "integration" / "zerocode_job" / "train.py"
SCENARIOS: list[dict[str, Any]] = [
    {"name": "healthy_fsdp", "vars": True, "secs": 45, "args": ["--pattern", "fsdp", "--jitter", "0.15",
                                                                 "--compute-s", "0.03"]},
    {"name": "fsdp_skip", "vars": True, "secs": 50, "args": ["--pattern", "fsdp", "--jitter", "0.15",
                                                              "--compute-s", "0.03", "--skip-rank", "1",
                                                              "--skip-step", "60"]},
    {"name": "fsdp_lag", "vars": False, "secs": 40, "args": ["--pattern", "fsdp", "--compute-s", "0.03",
                                                              "--slow-rank", "1", "--slow-factor", "1.15"]},
    {"name": "fast_hang", "vars": False, "secs": 40, "args": ["--compute-s", "0.01", "--hang-rank", "1",
                                                               "--hang-step", "600"]},
    {"name": "checkpoint", "vars": True, "secs": 50, "args": ["--compute-s", "0.03", "--checkpoint-rank", "1",
                                                               "--checkpoint-step", "300", "--checkpoint-s", "20"]},
    {"name": "gpu_straggler", "vars": False, "secs": 40, "args": ["--compute-s", "0.03", "--slow-rank", "1",
                                                                   "--slow-factor", "1.3"]},
    {"name": "host_straggler", "vars": False, "secs": 40, "args": ["--compute-s", "0.03", "--host-slow-rank", "1",
                                                                    "--host-slow-s", "0.009"]},
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def http_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _status(path: Path) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in path.read_text().splitlines())}


def proc_cost(pid: int) -> dict[str, float]:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    status = _status(Path(f"/proc/{pid}/status"))
    ctxt = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():  # wake-ups: every thread's context switches
        try:
            st = _status(task / "status")
            ctxt += float(st["voluntary_ctxt_switches"]) + float(st["nonvoluntary_ctxt_switches"])
        except (OSError, KeyError):
            continue
    tick = os.sysconf("SC_CLK_TCK")
    return {"cpu_s": (int(stat[11]) + int(stat[12])) / tick, "rss_kib": float(status["VmRSS"].split()[0]),
            "hwm_kib": float(status["VmHWM"].split()[0]), "threads": float(status["Threads"]), "ctxt": ctxt}


def rank_activity(pid: int) -> dict[str, float] | None:
    """A rank's own CPU seconds and I/O bytes so far (/proc/<pid>/stat, /proc/<pid>/io)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        io = _status(Path(f"/proc/{pid}/io"))
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return {"cpu_s": (int(stat[11]) + int(stat[12])) / tick, "rchar": float(io.get("rchar", 0)),
            "wchar": float(io.get("wchar", 0)), "read_bytes": float(io.get("read_bytes", 0)),
            "write_bytes": float(io.get("write_bytes", 0))}


class Sampler:
    """RAS every 0.5 s, NVML every 0.25 s, FIFO dumps every 10 s (jobs with the variables)."""

    def __init__(self, nvml: RealNvml, folder: Path, dumps: bool) -> None:
        self.nvml, self.folder, self.dumps = nvml, folder, dumps
        self.stop = threading.Event()
        self.gpm: dict[int, Any] = {}

    def processes(self) -> list[GpuProcess]:
        out = []
        for i in range(self.nvml.device_count()):
            uuid = self.nvml.query(i, "UUID")
            try:
                procs = self.nvml.query(i, "ComputeRunningProcesses")
            except NvmlError:
                continue
            out += [GpuProcess(i, uuid, int(p["pid"]), p.get("usedGpuMemory")) for p in procs or []
                    if isinstance(p, dict) and p.get("pid")]
        return out

    def run_ras(self) -> None:
        with (self.folder / "ras.jsonl").open("w") as fh, (self.folder / "ranks.jsonl").open("w") as rk:
            while not self.stop.is_set():
                t = time.time()
                try:
                    ranks = {str(p.launch.rank): {"pid": p.pid, **(rank_activity(p.pid) or {})}
                             for p in discover(self.processes()).processes if p.launch and p.launch.rank is not None}
                    rk.write(json.dumps({"t": t, "ranks": ranks}) + "\n")
                except Exception as exc:
                    rk.write(json.dumps({"t": t, "error": str(exc)}) + "\n")
                try:
                    reply = ras.query("localhost", 28028, fmt="json", timeout_s=3.0)
                    fh.write(json.dumps({"t": t, "seconds": reply.seconds, "format": reply.format,
                                         "text": reply.text}) + "\n")
                except Exception as exc:
                    fh.write(json.dumps({"t": t, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
                fh.flush()
                self.stop.wait(0.5)

    def run_nvml(self) -> None:
        with (self.folder / "nvml.jsonl").open("w") as fh:
            while not self.stop.is_set():
                t = time.time()
                rows = []
                for i in range(self.nvml.device_count()):
                    row: dict[str, Any] = {"gpu": i}
                    for key in ("UtilizationRates", "PowerUsage", "ClockInfo_SM", "EnforcedPowerLimit"):
                        try:
                            row[key] = self.nvml.query(i, key)
                        except NvmlError as exc:
                            row[key] = f"error {exc.code}"
                    try:
                        row["gpm"] = self.nvml.query(i, "GpmMetrics")
                    except NvmlError as exc:
                        row["gpm"] = f"error {exc.code}"
                    rows.append(row)
                fh.write(json.dumps({"t": t, "gpus": rows}) + "\n")
                fh.flush()
                self.stop.wait(0.25)

    def run_dumps(self) -> None:
        out = self.folder / "dumps"
        out.mkdir()
        n = 0
        while not self.stop.wait(10.0):
            disc = discover(self.processes())
            for job in disc.jobs():
                for rank, p in job.ranks.items():
                    try:
                        d = request_dump(p, timeout_s=8.0)
                        (out / f"{n:02d}_rank{rank}.pkl").write_bytes(d.data)
                    except DumpError as exc:
                        (out / f"{n:02d}_rank{rank}.error").write_text(str(exc))
            (out / f"{n:02d}_t").write_text(f"{time.time():.3f}\n")
            n += 1

    def start(self) -> list[threading.Thread]:
        targets = [self.run_ras, self.run_nvml] + ([self.run_dumps] if self.dumps else [])
        threads = [threading.Thread(target=t, daemon=True) for t in targets]
        for th in threads:
            th.start()
        return threads


def kill_job(job: subprocess.Popen[bytes]) -> None:
    """torchrun starts its workers in sessions of their own: kill every descendant by pid, then torchrun."""
    import psutil

    try:
        family = psutil.Process(job.pid).children(recursive=True)
    except psutil.Error:
        family = []
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            pass
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    psutil.wait_procs(family, timeout=10)


def run_scenario(sc: dict[str, Any], work: Path, agent_url: str, agent_pid: int, nvml: RealNvml) -> dict[str, Any]:
    folder = work / sc["name"]
    folder.mkdir()
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1"}
    if sc["vars"]:
        env.update(launch_variables(sc["name"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29533",
           f"--rdzv-id={sc['name']}", str(TRAIN), "--backend", "nccl", "--steps", "0",
           "--steps-out", str(folder / "steps_rank0.jsonl"), *sc["args"]]
    logf = (folder / "job.log").open("w")
    t0 = time.time()
    job = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sampler = Sampler(nvml, folder, sc["vars"])
    threads = sampler.start()
    cost0 = proc_cost(agent_pid)
    first_named: dict[str, float] = {}
    health_f = (folder / "health.jsonl").open("w")
    while time.time() - t0 < sc["secs"] and job.poll() is None:
        time.sleep(1.0)
        try:
            doc = http_json(agent_url + "/health")
        except Exception as exc:
            health_f.write(json.dumps({"t": time.time(), "error": str(exc)}) + "\n")
            continue
        found = [f for f in doc.get("findings", []) + [x for g in doc.get("gpus", []) for x in g["findings"]]
                 if f.get("source") in ("zerocode",) or f["code"].startswith(("rank.", "collective.", "ras."))]
        health_f.write(json.dumps({"t": time.time(), "findings": found}) + "\n")
        for f in found:
            first_named.setdefault(f["code"], round(time.time() - t0, 1))
    cost1 = proc_cost(agent_pid)
    sampler.stop.set()
    kill_job(job)
    for th in threads:
        th.join(12)
    wall = time.time() - t0
    cost = {"wall_s": round(wall, 1), "cpu_s": round(cost1["cpu_s"] - cost0["cpu_s"], 3),
            "cpu_share_pct": round(100 * (cost1["cpu_s"] - cost0["cpu_s"]) / wall, 3),
            "rss_mib": round(cost1["rss_kib"] / 1024, 1), "hwm_mib": round(cost1["hwm_kib"] / 1024, 1),
            "threads": cost1["threads"], "wakeups_per_s": round((cost1["ctxt"] - cost0["ctxt"]) / wall, 1)}
    (folder / "agent_cost.json").write_text(json.dumps(cost))
    summary = {"scenario": sc["name"], "t0": t0, "first_named_s": first_named, "agent": cost}
    (folder / "summary.json").write_text(json.dumps(summary))
    log(f"{sc['name']}: {json.dumps(summary)}")
    time.sleep(3)  # NCCL's RAS port and the GPUs free before the next job
    return summary


VALIDATE: list[dict[str, Any]] = [
    {"name": "one_job_vars", "vars": True, "secs": 50, "args": ["--pattern", "fsdp", "--compute-s", "0.03"]},
    {"name": "four_jobs", "vars": True, "secs": 50, "jobs": 4, "args": ["--compute-s", "0.03"]},
    {"name": "fast_hang", "vars": False, "secs": 35, "args": ["--compute-s", "0.01", "--hang-rank", "1",
                                                               "--hang-step", "600"]},
    {"name": "checkpoint", "vars": True, "secs": 45, "args": ["--compute-s", "0.03", "--checkpoint-rank", "1",
                                                               "--checkpoint-step", "300", "--checkpoint-s", "20"]},
    {"name": "fsdp_skip", "vars": True, "secs": 50, "args": ["--pattern", "fsdp", "--jitter", "0.15",
                                                              "--compute-s", "0.03", "--skip-rank", "1",
                                                              "--skip-step", "60"]},
    {"name": "gpu_straggler", "vars": False, "secs": 50, "args": ["--compute-s", "0.03", "--slow-rank", "1",
                                                                   "--slow-factor", "1.3"]},
    {"name": "host_straggler", "vars": False, "secs": 50, "args": ["--compute-s", "0.03", "--host-slow-rank", "1",
                                                                    "--host-slow-s", "0.009"]},
]


def start_agent(work: Path, name: str, port: int, src: Path, out: Path) -> subprocess.Popen[bytes]:
    cfg = work / f"{name}.yaml"
    (work / name).mkdir()
    cfg.write_text(json.dumps({
        "agent": {"listen": f"127.0.0.1:{port}", "socket_path": str(work / name / "agent.sock"),
                  "state_dir": str(work / name / "state")},
        "diag": {"enabled": False},
        "zerocode": {"periodic_dump_s": 30},
    }))
    path = str(src) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "gpuhealth.cli.main", "agent", "--config", str(cfg)],
                            stdout=(out / f"agent_{name}.log").open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": path})


def watch(url: str, t0: float, first: dict[str, float]) -> None:
    try:
        doc = http_json(url + "/health")
    except Exception:
        return
    for f in doc.get("findings", []) + [x for g in doc.get("gpus", []) for x in g["findings"]]:
        if f["code"].startswith(("rank.", "collective.")):
            key = f"{f['code']}:{f['severity']}:{f['entity']['id']}"
            first.setdefault(key, round(time.time() - t0, 1))


def validate(out: Path, work: Path) -> None:
    """Issues 25 and 27 after the change: the agent before (the tree at ce1dad2, carried as .oldsrc) and after,
    side by side on the same jobs: what each names and when, and what each costs."""
    agents = {"after": start_agent(work, "after", 9502, REPO / "src", out),
              "before": start_agent(work, "before", 9503, REPO / ".oldsrc" / "src", out)}
    urls = {"after": "http://127.0.0.1:9502", "before": "http://127.0.0.1:9503"}
    for url in urls.values():
        for _ in range(120):
            try:
                urllib.request.urlopen(url + "/ready", timeout=1)
                break
            except Exception:
                time.sleep(0.25)
    results: list[dict[str, Any]] = []

    def cost_window(label: str, secs: float, jobs: list[subprocess.Popen[bytes]], t0: float) -> dict[str, Any]:
        c0 = {k: proc_cost(a.pid) for k, a in agents.items()}
        first: dict[str, dict[str, float]] = {k: {} for k in agents}
        start = time.time()
        while time.time() - start < secs:
            time.sleep(1.0)
            for k, url in urls.items():
                watch(url, t0, first[k])
        c1 = {k: proc_cost(a.pid) for k, a in agents.items()}
        wall = time.time() - start
        row = {"scenario": label, "t0": t0, "named": first, "cost": {
            k: {"cpu_share_pct": round(100 * (c1[k]["cpu_s"] - c0[k]["cpu_s"]) / wall, 3),
                "rss_mib": round(c1[k]["rss_kib"] / 1024, 1), "hwm_mib": round(c1[k]["hwm_kib"] / 1024, 1),
                "threads": c1[k]["threads"], "wakeups_per_s": round((c1[k]["ctxt"] - c0[k]["ctxt"]) / wall, 1)}
            for k in agents}}
        log(json.dumps(row))
        return row

    results.append(cost_window("idle", 30, [], time.time()))
    for sc in VALIDATE:
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1"}
        jobs = []
        folder = work / sc["name"]
        folder.mkdir()
        t0 = time.time()
        for j in range(sc.get("jobs", 1)):
            e = dict(env)
            if sc["vars"]:
                e.update(launch_variables(f"{sc['name']}{j}"))
            if j:
                e["NCCL_RAS_ADDR"] = f"localhost:{28028 + j}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={29533 + j}",
                   f"--rdzv-id={sc['name']}{j}", str(TRAIN), "--backend", "nccl", "--steps", "0", *sc["args"]]
            jobs.append(subprocess.Popen(cmd, stdout=(folder / f"job{j}.log").open("w"), stderr=subprocess.STDOUT,
                                         env=e, start_new_session=True))
        row = cost_window(sc["name"], sc["secs"], jobs, t0)
        for job in jobs:
            kill_job(job)
        for log_file in folder.glob("job*.log"):
            for line in log_file.read_text().splitlines():
                if " t=" in line and ("hangs" in line or "skips" in line or "checkpoints" in line):
                    row["fault_at_s"] = round(float(line.rsplit("t=", 1)[1]) - t0, 1)
        results.append(row)
        time.sleep(3)
    for a in agents.values():
        a.send_signal(signal.SIGTERM)
        a.wait(20)
    (out / "validate.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--idle-s", type=float, default=30.0, help="agent cost with no job first")
    ap.add_argument("--validate", action="store_true", help="the agent before and after, side by side")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    work = Path(tempfile.mkdtemp(prefix="zcsig-"))
    if args.validate:
        validate(out, work)
        log("done")
        return
    cfg = work / "agent.yaml"
    cfg.write_text(json.dumps({
        "agent": {"listen": "127.0.0.1:9502", "socket_path": str(work / "run" / "agent.sock"),
                  "state_dir": str(work / "state")},
        "diag": {"enabled": False},
        "zerocode": {"periodic_dump_s": 10},
    }))
    (work / "run").mkdir()
    agent_log = (out / "agent.log").open("w")
    path = str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    agent = subprocess.Popen([sys.executable, "-m", "gpuhealth.cli.main", "agent", "--config", str(cfg)],
                             stdout=agent_log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": path})
    url = "http://127.0.0.1:9502"
    for _ in range(120):
        try:
            urllib.request.urlopen(url + "/ready", timeout=1)
            break
        except Exception:
            time.sleep(0.25)
    nvml = RealNvml()
    nvml.init()
    summaries = []
    c0 = proc_cost(agent.pid)
    time.sleep(args.idle_s)
    c1 = proc_cost(agent.pid)
    idle = {"wall_s": args.idle_s, "cpu_share_pct": round(100 * (c1["cpu_s"] - c0["cpu_s"]) / args.idle_s, 3),
            "rss_mib": round(c1["rss_kib"] / 1024, 1), "threads": c1["threads"],
            "wakeups_per_s": round((c1["ctxt"] - c0["ctxt"]) / args.idle_s, 1)}
    log(f"idle agent: {json.dumps(idle)}")
    only = set(filter(None, args.only.split(",")))
    for sc in SCENARIOS:
        if only and sc["name"] not in only:
            continue
        try:
            summaries.append(run_scenario(sc, work, url, agent.pid, nvml))
        except Exception as exc:
            log(f"{sc['name']} failed: {type(exc).__name__}: {exc}")
    agent.send_signal(signal.SIGTERM)
    agent.wait(20)
    (work / "summary.json").write_text(json.dumps({"idle": idle, "scenarios": summaries}, indent=1))
    with tarfile.open(out / "zerocode_signals.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="zerocode_signals", filter=lambda ti: None if ti.name.endswith(".sock") else ti)
    log("done")


if __name__ == "__main__":
    main()
