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

    .venv/bin/python benchmarks/hardening.py [--before d4c7f54] [--after HEAD] [--json OUT]
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
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    results: dict[str, Any] = {"machine": machine, "date": time.strftime("%Y-%m-%d"), "before": args.before,
                               "after": args.after}
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
