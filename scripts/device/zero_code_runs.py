#!/usr/bin/env python3
"""Zero-code runs on real GPUs (issue 15): an unmodified torchrun job, the agent, NCCL RAS, the FIFO.

Run from the repository root on a machine with >= 2 GPUs (``scripts/device/zero_code_runs.sh`` wraps it):

1. ``gpuhealth agent`` starts as-is (zero-code discovery on by default: poll 5 s, hang threshold 30 s).
2. Three unmodified jobs (tests/integration/zerocode_job/train.py under torchrun, 2 ranks on the same 2 GPUs)
   run at once: A with no variable set (rank 1 host-stuck at step 600; world group + a second group),
   B launched with ``gpuhealth env``'s variables (rank 1 host-stuck; its own RAS port), D a mismatch (rank 1
   broadcasts where rank 0 all-reduces; its own RAS port). RAS replies (JSON and text) are recorded healthy and
   hung; the agent's /health is read every second until it names each job's culprit (``rank.stuck``), and for
   B until the evidence (dumps, stacks, triage) has arrived.
3. C: a 1.3x straggler (rank 1) launched with the variables: 10 s baseline, 8 s of back-to-back RAS queries,
   14 s with a FIFO dump of both ranks every 2 s; per-step times from rank 0; the last dumps triaged.

Everything lands in $OUT: run_log.txt (stdout), zero_code_records.tar.gz (RAS replies, health documents,
evidence folders, dumps, steps, summary.json), agent.log.
``--cpu`` dry-runs the same script on CPU (Gloo, the pipe stand-in; no RAS, no NVML) to check the script.

Ran once on 2 x H200 (2026-11-26; fixtures in tests/fixtures/zerocode/h200x2_nccl2.28.9). Fixed after that run:
the driver's own triage child lacked PYTHONPATH (C's triage failed; the committed dumps were triaged afterwards),
and the healthy RAS replies were asked before the first collective made the communicator (nothing listened yet):
they are now asked once RAS answers, and C's are recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
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
from gpuhealth.agent.zerocode.evidence import run_triage  # noqa: E402
from gpuhealth.agent.zerocode.fifo import DumpError, request_dump  # noqa: E402

JOB = REPO / "tests" / "integration" / "zerocode_job" / "train.py"
T0 = time.time()
SUMMARY: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}] {msg}", flush=True)


class Job:
    def __init__(self, name: str, work: Path, args: list[str], env: dict[str, str], port: int, cpu: bool) -> None:
        self.name, self.log_path, self.port = name, work / f"job_{name}.log", port
        full = {**os.environ, **env, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={port}", str(JOB), "--backend", "gloo" if cpu else "nccl", *args]
        if cpu:
            cmd.append("--emulate-pipe")
        self.fh = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=full, stdout=self.fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.time()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"rank \d+/\d+ pid (\d+) ready", self.text())]

    def onset(self) -> float | None:
        m = re.search(r"(?:hangs|broadcasts instead) at step \d+ t=([\d.]+)", self.text())
        return float(m.group(1)) if m else None

    def stop(self) -> None:
        # torchrun starts its workers in sessions of their own: killing its group alone left a hung job's
        # rank 0 spinning in all_reduce on GPU 0, and the next job's rank 0 ran 1.5x slow beside it
        workers = self.pids()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the job's own process group, by its id
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        deadline = time.time() + 15
        while time.time() < deadline and any(Path(f"/proc/{pid}").exists() for pid in workers):
            time.sleep(0.1)  # gone, and their CUDA contexts with them, before the next job starts
        self.fh.close()


def health() -> dict[str, Any]:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9400/health", timeout=3) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc
    except Exception as exc:
        return {"error": str(exc)}


def stuck_findings(doc: dict[str, Any]) -> list[dict[str, Any]]:
    found = list(doc.get("findings") or [])
    for g in doc.get("gpus") or []:
        found += g.get("findings") or []
    return [f for f in found if f.get("code") == "rank.stuck"]


def coordinator_verdicts(work: Path) -> list[dict[str, Any]]:
    """The coordinator's verdicts, from its database (read-only; WAL lets it write meanwhile)."""
    db = work / "coordinator.db"
    if not db.exists():
        return []
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)
        try:
            rows = con.execute("SELECT job_id, kind, created_at, json FROM verdicts ORDER BY id").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return []
    return [{"job_id": r[0], "kind": r[1], "created_at": r[2], **json.loads(r[3])} for r in rows]


def record_ras(rec: Path, tag: str, port: int, timings: list[dict[str, Any]]) -> None:
    for fmt in ("json", "text"):
        try:
            reply = ras.query("localhost", port, fmt=fmt, timeout_s=10)
        except Exception as exc:
            timings.append({"tag": tag, "fmt": fmt, "error": str(exc)})
            continue
        ext = "json" if reply.format == "json" else "txt"
        (rec / "ras" / f"{tag}.{ext}").write_text(reply.text)
        timings.append({"tag": tag, "fmt": reply.format, "seconds": round(reply.seconds, 4)})


def wait_ready(job: Job, until: float) -> bool:
    while time.time() < until:
        if len(job.pids()) >= 2:
            return True
        if job.proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def phase_hangs(work: Path, rec: Path, cpu: bool, deadline: float) -> None:
    jobs = {
        "A": Job("A", work, ["--steps", "0", "--compute-s", "0.01", "--hang-rank", "1", "--hang-step", "600",
                             "--subgroup"], {}, 29510, cpu),
        "B": Job("B", work, ["--steps", "0", "--compute-s", "0.01", "--hang-rank", "1", "--hang-step", "600"],
                 {**launch_variables("zcB"), "NCCL_RAS_ADDR": "localhost:28029"}, 29520, cpu),
        "D": Job("D", work, ["--steps", "0", "--compute-s", "0.01", "--mismatch-rank", "1", "--mismatch-step", "600"],
                 {"NCCL_RAS_ADDR": "localhost:28030"}, 29530, cpu),
    }
    ports = {"A": 28028, "B": 28029, "D": 28030}
    timings: list[dict[str, Any]] = []
    result: dict[str, Any] = {name: {} for name in jobs}
    try:
        for j in jobs.values():
            ok = wait_ready(j, time.time() + 60)
            result[j.name]["ready_s"] = round(time.time() - j.started, 1) if ok else None
            log(f"job {j.name} ready={ok} pids={j.pids()}")
        # the healthy phase: RAS replies and their cost (before the fault at step 600; RAS starts with the
        # first communicator, a moment after "ready")
        until = time.time() + 5
        while time.time() < until and jobs["A"].onset() is None:
            try:
                ras.query("localhost", 28028, timeout_s=2)
                break
            except Exception:
                time.sleep(0.05)
        for i in range(3):
            for name, port in ports.items():
                if jobs[name].onset() is None:
                    record_ras(rec, f"{name}_healthy_{i}", port, timings)
        burst = []
        for _ in range(10):
            if jobs["A"].onset() is not None:
                break
            t = time.perf_counter()
            try:
                ras.query("localhost", 28028, fmt="json", timeout_s=10)
                burst.append(time.perf_counter() - t)
            except Exception as exc:
                log(f"burst query failed: {exc}")
                break
        SUMMARY["ras_query_seconds_healthy_A"] = [round(b, 4) for b in burst]
        pending = set(jobs)
        hung_recorded: dict[str, int] = {}
        while pending and time.time() < deadline:
            doc = health()
            for name in sorted(pending):
                j = jobs[name]
                onset = j.onset()
                if onset is None:
                    continue
                result[name]["onset"] = onset
                if hung_recorded.get(name, 0) < 3 and time.time() - onset > 6 * (hung_recorded.get(name, 0) + 1):
                    record_ras(rec, f"{name}_hung_{hung_recorded.get(name, 0)}", ports[name], timings)
                    hung_recorded[name] = hung_recorded.get(name, 0) + 1
                pids = set(j.pids())
                mine = [f for f in stuck_findings(doc) if f.get("evidence", {}).get("host_pid") in pids]
                if mine and "named_after_s" not in result[name]:
                    result[name]["named_after_s"] = round(time.time() - onset, 1)
                    result[name]["finding"] = mine[0]
                    (rec / "health" / f"{name}_named.json").write_text(json.dumps(doc, indent=1))
                    log(f"job {name}: named after {result[name]['named_after_s']} s: {mine[0]['message'][:300]}")
                ev = mine[0].get("evidence", {}).get("evidence") if mine else None
                job_ids = {f.get("evidence", {}).get("job_id") for f in mine}
                verdicts = [v for v in coordinator_verdicts(work) if v["job_id"] in job_ids and v["kind"] == "hang"]
                if verdicts and "coordinator_after_s" not in result[name]:
                    v = verdicts[0]
                    result[name]["coordinator_after_s"] = round(v["created_at"] - onset, 1)
                    result[name]["coordinator"] = {k: v.get(k) for k in (
                        "verdict", "summary", "culprits", "culprit_details", "reported_by", "evidence")}
                    got = v.get("evidence") or {}
                    log(f"job {name}: coordinator verdict after {result[name]['coordinator_after_s']} s: "
                        f"{str(v.get('summary'))[:400]}; dumps {sorted(got.get('fr_dumps') or {})}, "
                        f"stacks {got.get('stacks_ranks')}")
                mismatch = [f for f in doc.get("findings") or [] if f.get("code") == "collective.launch_mismatch"
                            and f.get("evidence", {}).get("job_id") == f"torch:127.0.0.1:{j.port}"]
                if mismatch and "named_after_s" not in result[name]:
                    result[name]["named_after_s"] = round(time.time() - onset, 1)
                    result[name]["finding"] = mismatch[0]
                    log(f"job {name}: mismatch named after {result[name]['named_after_s']} s: "
                        f"{mismatch[0]['message'][:300]}")
                if isinstance(ev, dict) and "evidence_after_s" not in result[name]:
                    result[name]["evidence_after_s"] = round(time.time() - onset, 1)
                    result[name]["evidence"] = ev
                    (rec / "health" / f"{name}_evidence.json").write_text(json.dumps(doc, indent=1))
                    log(f"job {name}: evidence after {result[name]['evidence_after_s']} s: {json.dumps(ev)[:600]}")
                done = ("named_after_s" in result[name] and ("coordinator_after_s" in result[name] or name == "D")
                        and ("evidence_after_s" in result[name] or name != "B"))
                if done and (hung_recorded.get(name, 0) >= 2 or name == "B"):
                    pending.discard(name)
            time.sleep(1.0)
        (rec / "health" / "final.json").write_text(json.dumps(health(), indent=1))
    finally:
        for j in jobs.values():
            j.stop()
            shutil.copy(j.log_path, rec / "jobs")
        SUMMARY["hangs"] = result
        SUMMARY["ras_timings"] = timings
        zc = work / "run" / "zerocode"
        if zc.is_dir():
            shutil.copytree(zc, rec / "evidence", dirs_exist_ok=True)


def dump_both(pids: list[int], folder: Path) -> list[dict[str, Any]]:
    disc = discover([GpuProcess(i, f"GPU-{i}", p) for i, p in enumerate(pids)])
    out: list[dict[str, Any]] = []
    threads, results = [], {}

    def one(p: Any) -> None:
        try:
            results[p.launch.rank] = request_dump(p, timeout_s=10)
        except DumpError as exc:
            results[p.launch.rank] = exc

    for p in disc.processes:
        t = threading.Thread(target=one, args=(p,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    folder.mkdir(parents=True, exist_ok=True)
    for rank, res in sorted(results.items()):
        if isinstance(res, Exception):
            out.append({"rank": rank, "error": str(res)})
        else:
            (folder / f"rank{rank}.pkl").write_bytes(res.data)
            out.append({"rank": rank, "seconds": round(res.seconds, 3), "bytes": len(res.data)})
    return out


def phase_straggler(work: Path, rec: Path, cpu: bool) -> None:
    steps = work / "C_steps.jsonl"
    job = Job("C", work, ["--steps", "0", "--compute-s", "0.02", "--slow-rank", "1", "--slow-factor", "1.3",
                          "--steps-out", str(steps)], launch_variables("zcC"), 29540, cpu)
    marks: dict[str, float] = {}
    dumps: list[dict[str, Any]] = []
    try:
        if not wait_ready(job, time.time() + 60):
            log("job C did not start")
            return
        marks["ready"] = time.time()
        time.sleep(10)
        marks["ras_start"] = time.time()
        n = 0
        record_ras(rec, "C_healthy_0", 28028, [])
        while time.time() - marks["ras_start"] < 8:
            try:
                ras.query("localhost", 28028, fmt="json", timeout_s=10)
                n += 1
            except Exception:
                time.sleep(0.1)
        marks["ras_end"] = time.time()
        record_ras(rec, "C_healthy_1", 28028, [])
        SUMMARY["ras_back_to_back_queries"] = n
        marks["dump_start"] = time.time()
        while time.time() - marks["dump_start"] < 14:
            t = time.time()
            dumps.append({"t": t, "ranks": dump_both(job.pids(), work / "C_dumps")})
            time.sleep(max(0.0, 2.0 - (time.time() - t)))
        marks["dump_end"] = time.time()
        report, err = run_triage(work / "C_dumps", world_size=2, timeout_s=60)
        rep = report or {}
        SUMMARY["straggler_triage"] = {"verdict": rep.get("verdict"), "summary": rep.get("summary"), "error": err}
        log(f"C triage: {SUMMARY['straggler_triage']}")
        # the agent's own periodic dumps (GPUHEALTH_ZEROCODE_PERIODIC_DUMP_S) → its straggler finding → the
        # coordinator's straggler verdict for the job
        until = time.time() + 25
        while time.time() < until:
            got = [v for v in coordinator_verdicts(work) if v["kind"] == "straggler" and v["job_id"].endswith(":29540")]
            if got:
                SUMMARY["coordinator_straggler"] = {"after_ready_s": round(got[0]["created_at"] - marks["ready"], 1),
                                                    "summary": got[0].get("summary"),
                                                    "culprits": got[0].get("culprits")}
                log(f"C at the coordinator: {SUMMARY['coordinator_straggler']}")
                break
            time.sleep(1.0)
        else:
            log("C: no straggler verdict at the coordinator")
    finally:
        job.stop()
        shutil.copy(job.log_path, rec / "jobs")
        SUMMARY["straggler_marks"] = marks
        SUMMARY["straggler_dumps"] = dumps
        if steps.exists():
            shutil.copy(steps, rec / "C_steps.jsonl")
            rows = [json.loads(line) for line in steps.read_text().splitlines() if line.strip()]

            def mean(a: float, b: float) -> float | None:
                dts = [r["dt"] for r in rows if a <= r["t"] < b]
                return round(sum(dts) / len(dts) * 1000, 3) if dts else None

            if marks.get("dump_end"):
                SUMMARY["straggler_step_ms"] = {
                    "baseline": mean(marks["ready"] + 2, marks["ras_start"]),
                    "ras_back_to_back": mean(marks["ras_start"], marks["ras_end"]),
                    "dump_every_2s": mean(marks["dump_start"], marks["dump_end"]),
                }
                log(f"C step ms: {SUMMARY['straggler_step_ms']}")
        if (work / "C_dumps").is_dir():
            shutil.copytree(work / "C_dumps", rec / "C_dumps", dirs_exist_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU (Gloo, pipe stand-in, no RAS/NVML)")
    ap.add_argument("--budget-s", type=float, default=175.0)
    args = ap.parse_args()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="zc_out_"))
    # the triage children this driver starts; packages carried in (PYTHONPATH already set) stay visible
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    work = Path(tempfile.mkdtemp(prefix="zc_"))
    rec = work / "rec"
    for sub in ("ras", "health", "jobs"):
        (rec / sub).mkdir(parents=True)
    env = {**os.environ, "GPUHEALTH_AGENT_STATE_DIR": str(work / "state"),
           "GPUHEALTH_AGENT_SOCKET_PATH": str(work / "run" / "agent.sock"),
           "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}"}
    os.environ["PATH"] = env["PATH"]
    coord_log = open(work / "coordinator.log", "w")  # noqa: SIM115
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "gpuhealth.cli.main", "coordinator", "--listen", "127.0.0.1:9500", "--metrics-listen",
         "127.0.0.1:9501", "--db", str(work / "coordinator.db"), "--evidence-dir", str(work / "coordinator_evidence")],
        env=env, stdout=coord_log, stderr=subprocess.STDOUT, start_new_session=True)
    env["GPUHEALTH_AGENT_COORDINATOR"] = "127.0.0.1:9500"
    env["GPUHEALTH_ZEROCODE_PERIODIC_DUMP_S"] = "5"  # the agent's own straggler dumps, often enough to see here
    agent_log = open(work / "agent.log", "w")  # noqa: SIM115
    agent_cmd = [sys.executable, "-m", "gpuhealth.cli.main", "agent", "--listen", "127.0.0.1:9400"]
    if args.cpu:
        agent_cmd += ["--nvml-snapshot", str(REPO / "src" / "gpuhealth" / "data" / "nvml_h200x2.json")]
    agent = subprocess.Popen(agent_cmd, env=env, stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(60):
            if "node" in health() or agent.poll() is not None:
                break
            time.sleep(0.5)
        log(f"agent up: {'node' in health()}")
        SUMMARY["env"] = subprocess.run(["bash", "-c", "nvidia-smi -L; python3 -c \"import torch; print('torch', "
                                         "torch.__version__, 'nccl', torch.cuda.nccl.version() if "
                                         "torch.cuda.is_available() else None)\""],
                                        capture_output=True, text=True, check=False).stdout
        log(SUMMARY["env"])
        phase_hangs(work, rec, args.cpu, deadline=T0 + args.budget_s - 55)
        log("hang phase done")
        if time.time() - T0 < args.budget_s - 45:
            phase_straggler(work, rec, args.cpu)
    finally:
        try:
            with urllib.request.urlopen("http://127.0.0.1:9400/screen", timeout=3) as r:
                (rec / "health" / "screen.json").write_bytes(r.read())
        except Exception as exc:
            log(f"/screen: {exc}")
        jobs = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "jobs", "--coordinator", "127.0.0.1:9500",
                               "--json"], env=env, capture_output=True, text=True, check=False, timeout=30)
        (rec / "coordinator").mkdir(exist_ok=True)
        (rec / "coordinator" / "jobs.json").write_text(jobs.stdout or jobs.stderr)
        (rec / "coordinator" / "verdicts.json").write_text(json.dumps(coordinator_verdicts(work), indent=1))
        if (work / "coordinator_evidence").is_dir():
            shutil.copytree(work / "coordinator_evidence", rec / "coordinator" / "evidence", dirs_exist_ok=True)
        for proc in (agent, coordinator):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        agent_log.close()
        coord_log.close()
        shutil.copy(work / "coordinator.log", rec / "coordinator" / "coordinator.log")
        (rec / "summary.json").write_text(json.dumps(SUMMARY, indent=1, default=str))
        with tarfile.open(out / "zero_code_records.tar.gz", "w:gz") as tar:
            tar.add(rec, arcname="zero_code_records")
        text = (work / "agent.log").read_text(errors="replace")
        (out / "agent.log").write_text(text[-2_000_000:])
        log(f"summary: {json.dumps({k: SUMMARY.get(k) for k in ('straggler_step_ms', 'straggler_triage')})}")
        for v in coordinator_verdicts(work):
            log(f"coordinator verdict: {v['job_id']} {v['kind']}: {str(v.get('summary'))[:200]}")
        for name, r in (SUMMARY.get("hangs") or {}).items():
            log(f"job {name}: named_after_s={r.get('named_after_s')} evidence_after_s={r.get('evidence_after_s')} "
                f"coordinator_after_s={r.get('coordinator_after_s')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
