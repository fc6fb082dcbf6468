"""Issue 17, before and after, side by side in one run: what an attack or a crash costs the agent.

Both trees are real code: ``--before`` and ``--after`` are git revisions, unpacked with ``git archive``
into a temporary folder and put first on ``PYTHONPATH`` of every process started for them (the
same interpreter and dependencies, this repository's venv).

1. **Rank socket memory** — a hub (``RankHub``) in its own process; ``--connections`` (300) local
   connections each push an unfinished 8 MiB line as fast as the hub takes it, for ``--push-s``
   seconds; then they close. The hub process's peak RSS (VmHWM) during, and RSS 3 s after.
2. **Step records lost per agent SIGKILL** — a real coordinator, a real agent with its coordinator
   link, 4 ranks streaming 200 records/s each into its socket; the agent is SIGKILLed and restarted
   ``--kills`` (3) times, 2.5 s apart; the coordinator's database says what arrived
   (``tests/integration/step_loss.py``).
3. **Slowloris on the agent's HTTP port** — a real agent (8 simulated GPUs); ``--sockets`` (1,000)
   connections send a request line and trickle header lines, never the blank line; meanwhile
   ``/metrics`` is scraped every 0.2 s. The agent's peak thread count, and the scrapes' latency.
4. ``/metrics`` with and without gzip (after only): bytes on the wire and the compression time.

Issue 24 (``--round 24``; ``--before`` defaults to ``84accc1``, the tree before it), every attack through
the shipped commands:

5. **Triage memory per input format** — ``gpuhealth triage FOLDER --json`` on one hostile file of each kind
   (a pickle of 1-byte opcodes, a pickle of entries just under the unpickler's budget, JSON of tensor-heavy
   entries at the whole-file limit, one entry of 65,536 tensors × 64 dimensions (the caps), the JSON
   gzip-compressed, a zip of two): the triage process's peak RSS (its own VmHWM, written at exit), under
   an address-space cap of ``--triage-cap`` (3 GiB) so a tree that would take more stops there.
6. **The coordinator and a hostile ``fr_pickle``** — a real ``gpuhealth coordinator``, an agent (raw
   gRPC) answering a live triage (``gpuhealth triage --job``) with a 32 MiB pickle of empty sets for rank 0:
   the coordinator's VmHWM before and after. (``--sections coordinator8``: for 8 ranks, what holding the
   dumps in memory until the end cost; run it with ``--before c7cb9a9``, the tree before they were spooled.)
7. **The rank socket before a hello** — a real ``gpuhealth agent``; one, then four connections each send
   one 8 MiB line of empty records with no hello: the agent's VmHWM. Then 1,024 connections with hellos
   from one process, and a real rank (another process) says hello: is it let in?
8. **Half-open requests on the coordinator's metrics port** — 2,000 connections send a request line and
   part of the headers: the coordinator's threads and RSS, and how long it holds them.

Issue 30 (``--round 30``; ``--before`` defaults to ``1466299``, the tree before its items 5, 7, 8 and 9):

9. **An agent passing tenants' dumps on** (``dumps``) — a real ``gpuhealth coordinator`` and ``gpuhealth agent``
   (simulated node), two ranks answering a dump request with 32 MiB pickles inline, ``gpuhealth triage --job``:
   the agent's VmHWM before and after the triage (the chart's limit is 256 Mi).
10. **One archive as one input** (``archive``) — ``gpuhealth triage`` on a zip of six 60 MiB JSON dumps: its peak
    RSS, under ``--triage-cap``.
11. **The rank socket's share without peer pids** (``share``) — the hub in its own PID namespace (an agent pod
    without ``hostPID``: pid 0 for every peer), one process sends 300 hellos to one job: how many it holds,
    and whether another process of the same user, and one of another user, get in.

    .venv/bin/python benchmarks/hardening.py [--before d4c7f54] [--after HEAD] [--json OUT]
    .venv/bin/python benchmarks/hardening.py --round 24 [--before 84accc1] [--json OUT]
    .venv/bin/python benchmarks/hardening.py --round 30 [--before 1466299] [--sections dumps,archive,share]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from agent_process import AgentProcess  # noqa: E402
from step_loss import measure as measure_loss  # noqa: E402

MiB = 1 << 20
HUB_HOST = REPO / "tests" / "integration" / "rank_hub_host.py"
SCENARIO = "recording: nvml_h200x2.json\ngpu_count: 8\n"


@contextlib.contextmanager
def tree(rev: str) -> Iterator[Path]:
    """The source tree of ``rev``, unpacked."""
    with tempfile.TemporaryDirectory(prefix=f"gh-{rev.replace('/', '_')}-") as d:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", d], input=archive.stdout, check=True)
        yield Path(d)


def _env(source: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(source / "src")}


# ------------------------------------------------------------------------------------ 1. rank socket
def _hub_stats(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("stats\n")
    proc.stdin.flush()
    out: dict[str, Any] = json.loads(proc.stdout.readline())
    return out


def rank_socket(source: Path, connections: int, push_s: float) -> dict[str, Any]:
    sock_dir = Path(tempfile.mkdtemp(prefix="gh-hub-", dir="/tmp"))
    path = sock_dir / "a.sock"
    proc = subprocess.Popen([sys.executable, str(HUB_HOST), str(path), "{}"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_env(source))
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        base = _hub_stats(proc)
        for _ in range(connections):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            s.setblocking(False)
            socks.append(s)
        left = {s: 8 * MiB for s in socks}
        chunk = b"x" * (256 * 1024)
        deadline = time.monotonic() + push_s
        while left and time.monotonic() < deadline:
            for s in list(left):
                try:
                    left[s] -= s.send(chunk[: min(len(chunk), left[s])])
                except BlockingIOError:
                    continue
                except OSError:
                    left[s] = 0
                if left[s] <= 0:
                    del left[s]
            time.sleep(0.001)
        during = _hub_stats(proc)
        pushed = connections * 8 * MiB - sum(left.values())
        for s in socks:
            s.close()
        time.sleep(3.0)
        after = _hub_stats(proc)
        return {"connections": connections, "pushed_mib": round(pushed / MiB), "base_rss_mib": base["VmRSS"] // 1024,
                "peak_rss_mib": during["VmHWM"] // 1024, "rss_after_close_mib": after["VmRSS"] // 1024,
                "connected_at_peak": during["connected"]}
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()


# ---------------------------------------------------------------------------------------- 3. slowloris
def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def _scrape(port: int, timeout: float = 10.0) -> float | None:
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
            resp.read()
    except OSError:
        return None
    return time.perf_counter() - started


def slowloris(source: Path, work: Path, sockets: int, attack_s: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    scenario = work / "node.yaml"
    scenario.write_text(SCENARIO)
    cfg = work / "agent.yaml"
    cfg.write_text(json.dumps({"agent": {"socket_path": str(work / "agent.sock"),
                                         "pod_resources_socket": str(work / "none.sock")}}))
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(scenario)],
                         env={"PYTHONPATH": str(source / "src")})
    attackers: list[socket.socket] = []
    try:
        agent.wait_ready(60)
        time.sleep(5.0)  # past the first sweeps of both lanes
        quiet = [t for t in (_scrape(agent.port) for _ in range(50)) if t is not None]
        base_threads = _threads(agent.proc.pid)
        for _ in range(sockets):
            s = socket.socket()
            s.settimeout(1.0)
            try:
                s.connect(("127.0.0.1", agent.port))
                s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                s.close()
                continue
            attackers.append(s)
        peak, latencies, failed = base_threads, [], 0
        deadline = time.monotonic() + attack_s
        while time.monotonic() < deadline:
            for s in attackers:
                with contextlib.suppress(OSError):
                    s.send(b"X-a: b\r\n")
            t = _scrape(agent.port)
            if t is None:
                failed += 1
            else:
                latencies.append(t)
            peak = max(peak, _threads(agent.proc.pid))
            time.sleep(0.2)
        lat = sorted(latencies)
        return {"sockets": len(attackers), "threads_before": base_threads, "threads_peak": peak,
                "scrapes": len(latencies) + failed, "scrapes_failed": failed,
                "scrape_ms_quiet_p50": round(1000 * statistics.median(quiet), 1),
                "scrape_ms_p50": round(1000 * statistics.median(lat), 1) if lat else None,
                "scrape_ms_max": round(1000 * lat[-1], 1) if lat else None}
    finally:
        for s in attackers:
            s.close()
        agent.stop()


# ---------------------------------------------------------------------------------------------- 4. gzip
def gzip_figures(source: Path, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    scenario = work / "node.yaml"
    scenario.write_text(SCENARIO)
    cfg = work / "agent.yaml"
    cfg.write_text(json.dumps({"agent": {"socket_path": str(work / "agent.sock"),
                                         "pod_resources_socket": str(work / "none.sock")}}))
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(scenario)],
                         env={"PYTHONPATH": str(source / "src")})
    try:
        agent.wait_ready(60)
        time.sleep(2.0)
        plain = urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=10).read()
        req = urllib.request.Request(f"http://127.0.0.1:{agent.port}/metrics", headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            wire = resp.read()
            encoding = resp.headers.get("Content-Encoding")
        times = []
        for _ in range(50):
            t0 = time.process_time()
            gzip.compress(plain, compresslevel=1, mtime=0)
            times.append(time.process_time() - t0)
        return {"plain_bytes": len(plain), "gzip_bytes": len(wire), "encoding": encoding,
                "gzip_ms_cpu_median": round(1000 * statistics.median(times), 2)}
    finally:
        agent.stop()


# ----------------------------------------------------------------------------- 5. triage memory (issue 24)
def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _tree_kib(pid: int, key: str) -> int:
    """``key`` summed over ``pid`` and its children: the agent serves its rank socket from a child (issue 30), so
    the agent's cost is both processes' (for VmHWM: each one's peak, an upper bound of their peak together)."""
    total = _status_kib(pid, key)
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                total += _status_kib(int(entry.name), key)
        except (OSError, IndexError, ValueError):
            continue
    return total


# ``gpuhealth ARGS`` in a fresh interpreter under RLIMIT_AS, writing its own VmHWM at exit: the peak of that
# process alone (wait4's ru_maxrss would carry this benchmark's own size, copied at fork, across the exec).
_MEASURED_CLI = (
    "import atexit, resource, sys\n"
    "cap, out = int(sys.argv[1]), sys.argv[2]\n"
    "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
    "def _hwm():\n"
    "    with open('/proc/self/status') as f, open(out, 'w') as o:\n"
    "        o.write(next(l.split()[1] for l in f if l.startswith('VmHWM:')))\n"
    "atexit.register(_hwm)\n"
    "sys.argv = ['gpuhealth', *sys.argv[3:]]\n"
    "from gpuhealth.cli.main import main\n"
    "main()\n"
)


def _peak_run(args: list[str], env: dict[str, str], cap: int) -> dict[str, Any]:
    """``gpuhealth ARGS`` under RLIMIT_AS=cap: exit status, its peak RSS (VmHWM), seconds, the problems it names."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as hwm:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _MEASURED_CLI, str(cap), hwm.name, *args], stdout=out,
                              stderr=err, env=env, check=False)
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read().decode(errors="replace")
        peak_kib = int(hwm.read() or 0)
    try:
        report = json.loads(stdout)
        errors = [p["message"][:120] for p in report.get("problems", []) if p.get("severity") == "error"]
    except ValueError:
        errors = []
    return {"rc": proc.returncode, "peak_rss_mib": round(peak_kib / 1024),
            "seconds": round(seconds, 1), "traceback": "Traceback" in stderr,
            "memory_error": "MemoryError" in stderr, "errors": errors[:2],
            "stderr_tail": stderr.strip().splitlines()[-1][:200] if stderr.strip() else ""}


def _hostile_inputs(root: Path) -> dict[str, Path]:
    """One folder per input kind, each holding one hostile file (built once, read by both trees)."""
    import gzip as gz
    import pickle
    import zipfile

    sys.path.insert(0, str(REPO / "tests" / "unit" / "flightrec"))
    from frbuild import dump, entry

    def folder(name: str) -> Path:
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    out: dict[str, Path] = {}
    for mib in (16, 64):
        out[f"pickle_empty_sets_{mib}MiB"] = folder(f"pickle_empty_sets_{mib}")
        (out[f"pickle_empty_sets_{mib}MiB"] / "rank0.pkl").write_bytes(b"\x80\x04" + b"\x8f" * (mib * MiB - 3) + b".")
    out["pickle_empty_lists_16MiB"] = folder("pickle_empty_lists")
    (out["pickle_empty_lists_16MiB"] / "rank0.pkl").write_bytes(b"\x80\x04" + b"]" * (16 * MiB - 3) + b".")
    # Entries of 60,000 one-dimension tensors each: a real dump's shape, just under the unpickler's budget.
    ents = [entry(i + 1, json_style=False, sizes=[[1000 + j] for j in range(60_000)], out_sizes=[[7]])
            for i in range(27)]
    out["pickle_entries_near_budget"] = folder("pickle_entries")
    (out["pickle_entries_near_budget"] / "rank0.pkl").write_bytes(pickle.dumps(dump(ents, json_style=False), 2))
    # JSON of tensor-heavy entries up to the whole-file limit (64 MiB): the most records per byte.
    js: list[dict[str, Any]] = []
    size = 0
    while True:
        e = entry(len(js) + 1, sizes=[[1000 + j] for j in range(60_000)], out_sizes=[[7]])
        n = len(json.dumps(e, separators=(",", ":")))
        if size + n > 64 * MiB - 4096:
            break
        js.append(e)
        size += n
    text = json.dumps(dump(js), separators=(",", ":"), sort_keys=True).encode()
    out["json_tensors_64MiB"] = folder("json_tensors")
    (out["json_tensors_64MiB"] / "rank0.json").write_bytes(text)
    one = entry(1, sizes=[[1000 + d for d in range(64)] for _ in range(65_536)], out_sizes=[[7]])
    out["json_one_entry_65536x64"] = folder("json_one_entry")
    (out["json_one_entry_65536x64"] / "rank0.json").write_text(json.dumps(dump([one]), separators=(",", ":")))
    out["gzip_json_tensors_64MiB"] = folder("gzip_json")
    (out["gzip_json_tensors_64MiB"] / "rank0.json.gz").write_bytes(gz.compress(text, compresslevel=6))
    out["zip_two_json_tensors_64MiB"] = folder("zip_json")
    with zipfile.ZipFile(out["zip_two_json_tensors_64MiB"] / "dumps.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("rank0.json", text)
        z.writestr("rank1.json", text)
    return out


def triage_memory(trees: dict[str, Path], work: Path, cap: int) -> dict[str, Any]:
    inputs = _hostile_inputs(work / "inputs")
    results: dict[str, Any] = {}
    for kind, folder in inputs.items():
        size = sum(p.stat().st_size for p in folder.iterdir())
        results[kind] = {"file_mib": round(size / MiB, 1)}
        for name, source in trees.items():
            print(f"[{name}] triage {kind} ...", file=sys.stderr, flush=True)
            results[kind][name] = _peak_run(["triage", str(folder), "--json"], _env(source), cap)
    return results


# ---------------------------------------------------------------- 6. coordinator and fr_pickle (issue 24)
def _start_coordinator(source: Path, work: Path, metrics: bool = False
                       ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    ready = work / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "gpuhealth.cli.main", "coordinator", "--listen", "127.0.0.1:0",
                             "--metrics-listen", "127.0.0.1:0" if metrics else "off", "--db", str(work / "c.db"),
                             "--evidence-dir", str(work / "ev"), "--ready-file", str(ready), "--hang-floor", "3600"],
                            stdout=subprocess.DEVNULL, stderr=(work / "coordinator.log").open("wb"), env=_env(source))
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((work / "coordinator.log").read_text()[-2000:])
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def coordinator_fr_pickle(source: Path, work: Path, hostile_ranks: int = 1) -> dict[str, Any]:
    import asyncio

    sys.path.insert(0, str(REPO / "tests"))
    from simagent import SimAgent, step_batch_message

    from gpuhealth.proto import gpuhealth_v1_pb2 as pb

    work.mkdir(parents=True, exist_ok=True)
    hostile = b"\x80\x04" + b"\x8f" * (32 * MiB) + b"."
    healthy = json.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []}).encode()
    proc, ports = _start_coordinator(source, work)

    async def attack() -> dict[str, Any]:
        agent = SimAgent(f"127.0.0.1:{ports['grpc_port']}", "node-a")
        await agent.register()
        await agent.connect()
        await agent.send(step_batch_message(1, "victim", list(range(hostile_ranks + 1)), 1))
        await agent.wait_acked(1)
        await asyncio.sleep(1.0)
        before = _status_kib(proc.pid, "VmHWM")
        answered: set[int] = set()

        async def answer() -> None:
            while True:
                for req in list(agent.requests):
                    if req.request_id in answered:
                        continue
                    answered.add(req.request_id)
                    if req.kind == pb.DUMP_FLIGHT_RECORDER:
                        answers = [(r, hostile) for r in range(hostile_ranks)] + [(hostile_ranks, healthy)]
                        for rank, payload in answers:
                            await agent.send(pb.AgentMessage(result=pb.RequestResult(
                                request_id=req.request_id, rank=rank, ok=True, payload=payload,
                                format="fr_pickle" if payload is hostile else "fr_json",
                                final=rank == hostile_ranks)).SerializeToString())
                    else:
                        await agent.send(pb.AgentMessage(result=pb.RequestResult(
                            request_id=req.request_id, rank=-1, ok=False, error="no stacks", final=True)
                        ).SerializeToString())
                await asyncio.sleep(0.05)

        task = asyncio.create_task(answer())
        started = time.monotonic()
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpuhealth.cli.main", "triage", "--job", "victim", "--coordinator",
            f"127.0.0.1:{ports['grpc_port']}", "--json", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=_env(source))
        out, _ = await asyncio.wait_for(cli.communicate(), 600)
        task.cancel()
        try:
            report = json.loads(out)
        except ValueError:
            report = {}
        errors = [p["message"][:120] for p in report.get("problems", []) if p.get("severity") == "error"]
        return {"vmhwm_before_mib": before // 1024, "vmhwm_after_mib": _status_kib(proc.pid, "VmHWM") // 1024,
                "triage_seconds": round(time.monotonic() - started, 1), "verdict": report.get("verdict"),
                "errors": errors, "coordinator_alive": proc.poll() is None}

    try:
        return asyncio.run(attack())
    finally:
        proc.terminate()
        proc.wait(30)


# ------------------------------------------------------------------ 7. rank socket before a hello (issue 24)
def rank_socket_before_hello(source: Path, work: Path) -> dict[str, Any]:
    from gpuhealth.instrument import protocol
    from gpuhealth.model import RankIdentity

    work.mkdir(parents=True, exist_ok=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="gh-rs-", dir="/tmp"))
    scenario = work / "node.yaml"
    scenario.write_text(SCENARIO)
    cfg = work / "agent.yaml"
    cfg.write_text(json.dumps({"agent": {"socket_path": str(sock_dir / "a.sock"),
                                         "pod_resources_socket": str(work / "none.sock")}}))
    agent = AgentProcess(work, ["--config", str(cfg), "--scenario", str(scenario)], env=_env(source))
    line = b'{"type":"steps","records":[' + b"{}," * ((8 * MiB - 64) // 3) + b"{}]}\n"
    out: dict[str, Any] = {}
    flood: list[socket.socket] = []
    try:
        agent.wait_ready(60)
        time.sleep(3.0)
        out["vmhwm_at_rest_mib"] = _tree_kib(agent.proc.pid, "VmHWM") // 1024
        for n, key in ((1, "one_line"), (3, "four_lines")):
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(sock_dir / "a.sock"))
                with contextlib.suppress(OSError):
                    s.sendall(line)
                s.close()
            time.sleep(1.0)
            out[f"vmhwm_after_{key}_mib"] = _tree_kib(agent.proc.pid, "VmHWM") // 1024
        for i in range(1024):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(sock_dir / "a.sock"))
                s.sendall(protocol.encode(protocol.hello(RankIdentity("flood", i, 1024, "h", os.getpid()))))
            except OSError:
                s.close()
                continue
            flood.append(s)
        time.sleep(2.0)
        script = ("import os, socket, sys; from gpuhealth.instrument import protocol; "
                  "from gpuhealth.model import RankIdentity, StepRecord; s = socket.socket(socket.AF_UNIX); "
                  "s.connect(sys.argv[1]); s.sendall(protocol.encode(protocol.hello(RankIdentity('real', 0, 1, 'h', "
                  "os.getpid())))); s.sendall(protocol.encode(protocol.steps([StepRecord('real', 0, 0, 1.7e9, 0.1, "
                  "0.08, 0.02)]))); s.settimeout(3); print(repr(s.recv(200)))")
        real = subprocess.run([sys.executable, "-c", script, str(sock_dir / "a.sock")], capture_output=True,
                              text=True, env=_env(source), timeout=60)
        out["real_rank_after_1024_hellos"] = (real.stdout.strip() or real.stderr.strip().splitlines()[-1])[:200]
        metrics = agent.metrics()
        out["real_rank_connected"] = 'gpuhealth_agent_job_ranks_connected{job_id="real"} 1.0' in metrics
        out["flood_ranks_connected"] = next((float(m.rsplit(" ", 1)[1]) for m in metrics.splitlines()
                                             if m.startswith('gpuhealth_agent_job_ranks_connected{job_id="flood"}')),
                                            0.0)
        return out
    finally:
        for s in flood:
            s.close()
        agent.stop()
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()


# ------------------------------------------------------- 8. half-open requests on coordinator /metrics
def coordinator_half_open(source: Path, work: Path, sockets: int) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    proc, ports = _start_coordinator(source, work, metrics=True)
    port = ports["metrics_port"]
    attackers: list[socket.socket] = []
    try:
        time.sleep(2.0)
        base_threads, base_rss = _threads(proc.pid), _status_kib(proc.pid, "VmRSS") // 1024
        for _ in range(sockets):
            s = socket.socket()
            s.settimeout(2.0)
            try:
                s.connect(("127.0.0.1", port))
                s.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                s.close()
                continue
            attackers.append(s)
        time.sleep(2.0)
        peak_threads, peak_rss = _threads(proc.pid), _status_kib(proc.pid, "VmRSS") // 1024
        scrape = _scrape(port, timeout=10.0)
        # How long until the server let go of them (each reads EOF), at most 120 s.
        started = time.monotonic()
        open_ = list(attackers)
        for s in open_:
            s.setblocking(False)
        while open_ and time.monotonic() - started < 120:
            still = []
            for s in open_:
                try:
                    if s.recv(1) == b"":
                        continue
                except BlockingIOError:
                    still.append(s)
                    continue
                except OSError:
                    continue
            open_ = still
            time.sleep(0.5)
        return {"sockets": len(attackers), "threads_before": base_threads, "threads_peak": peak_threads,
                "rss_before_mib": base_rss, "rss_peak_mib": peak_rss,
                "scrape_ms_during": round(1000 * scrape, 1) if scrape is not None else None,
                "all_released_after_s": round(time.monotonic() - started, 1) if not open_ else None,
                "still_held_after_120_s": len(open_)}
    finally:
        for s in attackers:
            s.close()
        proc.terminate()
        proc.wait(30)


def round_24(args: argparse.Namespace, results: dict[str, Any]) -> None:
    before_rev = args.before if args.before != "d4c7f54" else "84accc1"
    results["before"] = before_rev
    sections = set(args.sections.split(","))
    with tree(before_rev) as before, tree(args.after) as after, tempfile.TemporaryDirectory() as work:
        trees = {"before": before, "after": after}
        if "triage" in sections:
            results["triage_memory"] = triage_memory(trees, Path(work), args.triage_cap)
        for name, source in trees.items() if "coordinator" in sections else ():
            print(f"[{name}] coordinator + 32 MiB fr_pickle ...", file=sys.stderr, flush=True)
            results.setdefault("coordinator_fr_pickle", {})[name] = coordinator_fr_pickle(source,
                                                                                         Path(work) / f"c-{name}")
        for name, source in trees.items() if "coordinator8" in sections else ():
            print(f"[{name}] coordinator + 8 ranks' 32 MiB fr_pickle ...", file=sys.stderr, flush=True)
            results.setdefault("coordinator_fr_pickle_8_ranks", {})[name] = coordinator_fr_pickle(
                source, Path(work) / f"c8-{name}", hostile_ranks=8)
        for name, source in trees.items() if "socket" in sections else ():
            print(f"[{name}] rank socket before a hello ...", file=sys.stderr, flush=True)
            results.setdefault("rank_socket_before_hello", {})[name] = rank_socket_before_hello(
                source, Path(work) / f"rs-{name}")
        for name, source in trees.items() if "metrics" in sections else ():
            print(f"[{name}] coordinator metrics, {args.half_open} half-open requests ...", file=sys.stderr,
                  flush=True)
            results.setdefault("coordinator_half_open", {})[name] = coordinator_half_open(
                source, Path(work) / f"ho-{name}", args.half_open)


# ------------------------------------------------------------------------------------------- issue 30
def agent_dumps(source: Path, work: Path) -> dict[str, Any]:
    """Two ranks' 32 MiB inline dumps through a real agent to a live triage: the agent's VmHWM."""
    from commands import SCENARIO as FAULTY
    from commands import Agent, Coordinator, metric_value, run_cli, until, write_config
    from test_agent_dump_memory import RANKS

    env = {"PYTHONPATH": str(source / "src")}
    work.mkdir(parents=True, exist_ok=True)
    sock_dir = Path(tempfile.mkdtemp(prefix="gh-dumps-", dir="/tmp"))
    coord = Coordinator(work / "coordinator", write_config(work / "coordinator.yaml", {"coordinator": {
        "listen": "127.0.0.1:0", "metrics_listen": "off", "db_path": str(work / "c.db"),
        "evidence_dir": str(work / "evidence"), "tick_s": 0.2}}), env)
    procs: list[Any] = [coord]
    ranks = None
    try:
        address = coord.address()
        sock = sock_dir / "agent.sock"
        agent = Agent(work / "agent", write_config(work / "agent.yaml", {
            "agent": {"nvml_snapshot": str(FAULTY), "listen": "127.0.0.1:0", "node_name": "dump-node",
                      "coordinator": address, "socket_path": str(sock), "state_dir": str(work / "state"),
                      "pod_resources_socket": str(work / "no-kubelet.sock")},
            "diag": {"enabled": False}}), env)
        procs.append(agent)
        agent.wait_ready()
        until(sock.exists, 30, "the rank socket")
        ranks = subprocess.Popen([sys.executable, "-c", RANKS, str(sock)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=_env(source))
        assert ranks.stdout is not None and ranks.stdout.readline().strip() == "ready"
        until(lambda: metric_value(agent.get("/metrics"), "gpuhealth_agent_rank_step_records_total") == 10, 30,
              "the ranks' steps")
        until(lambda: "dumps" in run_cli("jobs", "--coordinator", address, "--json", env=env).stdout, 30, "the job")
        before = _status_kib(agent.proc.pid, "VmHWM")
        res = run_cli("triage", "--job", "dumps", "--coordinator", address, "--json", env=env, timeout=120)
        shipped = sum(1 for p in (work / "evidence").rglob("*") if p.is_file() and p.stat().st_size > 30 * MiB)
        return {"agent_vmhwm_before_mib": before >> 10,
                "agent_vmhwm_after_mib": _status_kib(agent.proc.pid, "VmHWM") >> 10,
                "dumps_at_coordinator": shipped, "triage_rc": res.returncode}
    finally:
        if ranks is not None:
            ranks.kill()
            ranks.wait(10)
        for p in reversed(procs):
            p.stop()
        subprocess.run(["rm", "-rf", str(sock_dir)], check=False)


def archive_of_six(trees: dict[str, Path], work: Path, cap: int) -> dict[str, Any]:
    import zipfile

    sys.path.insert(0, str(REPO / "tests" / "unit" / "flightrec"))
    from frbuild import dump, entry

    one = entry(1, sizes=[[1000 + j] for j in range(60_000)], out_sizes=[[7]])
    n = 60 * MiB // len(json.dumps(one, separators=(",", ":")))
    text = json.dumps(dump([{**one, "record_id": i, "collective_seq_id": i + 1} for i in range(n)]),
                      separators=(",", ":")).encode()
    folder = work / "zip6"
    folder.mkdir(parents=True)
    with zipfile.ZipFile(folder / "dumps.zip", "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for r in range(6):
            z.writestr(f"rank{r}.json", text)
    out: dict[str, Any] = {"zip_mib": round((folder / "dumps.zip").stat().st_size / MiB, 1),
                           "member_mib": round(len(text) / MiB, 1)}
    for name, source in trees.items():
        print(f"[{name}] triage a zip of six 60 MiB JSON dumps ...", file=sys.stderr, flush=True)
        out[name] = _peak_run(["triage", str(folder), "--json"], _env(source), cap)
    return out


_SHARE = r"""
import json, os, socket, sys, time
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord
path, uid, job, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
os.setgid(uid)
os.setuid(uid)
socks = []
for i in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    try:
        s.sendall(protocol.encode(protocol.hello(RankIdentity(job, i, max(n, 2), "h", os.getpid()))))
    except OSError:
        pass
    socks.append(s)
print("done", flush=True)
sys.stdin.read()
"""


def share_without_pids(source: Path) -> dict[str, Any]:
    sock_dir = Path(tempfile.mkdtemp(prefix="gh-share-", dir="/tmp"))
    os.chmod(sock_dir, 0o755)
    path = sock_dir / "a.sock"
    hub = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(HUB_HOST), str(path),
                            json.dumps({"hello_timeout_s": 60.0})], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True, env=_env(source))
    procs: list[subprocess.Popen[str]] = []
    try:
        assert hub.stdout is not None and hub.stdout.readline().strip() == "ready"

        def run(uid: int, job: str, n: int) -> None:
            p = subprocess.Popen([sys.executable, "-c", _SHARE, str(path), str(uid), job, str(n)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(source))
            procs.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "done"
            time.sleep(2.0)  # judged

        run(65534, "flood", 300)
        held = sum(1 for r in _hub_stats(hub)["ranks_list"] if r["job_id"] == "flood")
        run(65534, "same-user", 1)
        run(65533, "other-user", 1)
        jobs = {r["job_id"] for r in _hub_stats(hub)["ranks_list"]}
        return {"flood_hellos": 300, "flood_held": held, "same_user_rank_in": "same-user" in jobs,
                "other_user_rank_in": "other-user" in jobs}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        assert hub.stdin is not None
        with contextlib.suppress(OSError):
            hub.stdin.write("quit\n")
            hub.stdin.flush()
        try:
            hub.wait(10)
        except subprocess.TimeoutExpired:
            hub.kill()
        subprocess.run(["rm", "-rf", str(sock_dir)], check=False)


def round_30(args: argparse.Namespace, results: dict[str, Any]) -> None:
    before_rev = args.before if args.before != "d4c7f54" else "1466299"
    results["before"] = before_rev
    sections = set(args.sections.split(",")) if args.sections != "triage,coordinator,socket,metrics" else {
        "dumps", "archive", "share"}
    with tree(before_rev) as before, tree(args.after) as after, tempfile.TemporaryDirectory() as work:
        trees = {"before": before, "after": after}
        for name, source in trees.items() if "dumps" in sections else ():
            print(f"[{name}] two ranks' 32 MiB dumps through the agent ...", file=sys.stderr, flush=True)
            results.setdefault("agent_dumps", {})[name] = agent_dumps(source, Path(work) / f"d-{name}")
        if "archive" in sections:
            results["archive_of_six"] = archive_of_six(trees, Path(work), args.triage_cap)
        for name, source in trees.items() if "share" in sections else ():
            print(f"[{name}] rank socket share without pids ...", file=sys.stderr, flush=True)
            results.setdefault("share_without_pids", {})[name] = share_without_pids(source)


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="d4c7f54", help="git revision before the hardening (default d4c7f54)")
    ap.add_argument("--after", default="HEAD", help="git revision after it (default HEAD)")
    ap.add_argument("--connections", type=int, default=300, help="rank-socket connections (default 300)")
    ap.add_argument("--push-s", type=float, default=10.0, help="seconds they push (default 10)")
    ap.add_argument("--kills", type=int, default=3, help="agent SIGKILLs (default 3)")
    ap.add_argument("--sockets", type=int, default=1000, help="slowloris sockets (default 1000)")
    ap.add_argument("--attack-s", type=float, default=10.0, help="seconds of slowloris (default 10)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--round", choices=("17", "24", "30"), default="17",
                    help="which issue's attacks: 17 (default) or 24 (then --before defaults to 84accc1)")
    ap.add_argument("--triage-cap", type=int, default=3 << 30, help="address-space cap of each triage run (3 GiB)")
    ap.add_argument("--half-open", type=int, default=2000, help="half-open requests on the coordinator (2,000)")
    ap.add_argument("--sections", default="triage,coordinator,socket,metrics",
                    help="round 24's parts to run (default: all of triage,coordinator,socket,metrics)")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    results: dict[str, Any] = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "before": args.before,
                               "after": args.after}
    if args.round in ("24", "30"):
        (round_24 if args.round == "24" else round_30)(args, results)
        print(json.dumps(results, indent=1))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
        return
    with tree(args.before) as before, tree(args.after) as after, tempfile.TemporaryDirectory() as work:
        trees = {"before": before, "after": after}
        for name, source in trees.items():
            print(f"[{name}] rank socket, {args.connections} connections ...", file=sys.stderr, flush=True)
            results.setdefault("rank_socket", {})[name] = rank_socket(source, args.connections, args.push_s)
        for name, source in trees.items():
            print(f"[{name}] agent SIGKILL x{args.kills} ...", file=sys.stderr, flush=True)
            loss = measure_loss(Path(work) / f"loss-{name}", kills=args.kills, source=source)
            results.setdefault("sigkill", {})[name] = loss.to_dict()
        for name, source in trees.items():
            print(f"[{name}] slowloris, {args.sockets} sockets ...", file=sys.stderr, flush=True)
            results.setdefault("slowloris", {})[name] = slowloris(source, Path(work) / f"sl-{name}", args.sockets,
                                                                  args.attack_s)
        results["gzip"] = gzip_figures(after, Path(work) / "gzip")
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
