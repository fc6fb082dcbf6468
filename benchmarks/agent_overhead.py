"""Agent overhead: CPU and memory of a real ``gpuhealth agent`` process, and /metrics render time.

1. Starts ``gpuhealth agent`` on a scenario of 8 simulated GPUs (cloned from the real H200
   recording) at the default intervals (fast lane 5 s, slow lane 60 s), lets it warm up, then for
   ``--seconds`` (default 120) scrapes ``/metrics`` every 15 s as Prometheus would, and reports CPU
   seconds per minute (user + system, from /proc via psutil) and resident memory (RSS, max seen).
   Goals: ≤ 1% of one core (0.6 CPU-s/min) and ≤ 80 MiB RSS.
2. In this process: time to render ``/metrics`` for the same 8 GPUs from a warm cache, text format
   and OpenMetrics, with and without ``--dcgm-compat`` (goal ≤ 5 ms): wall time (median, p95) and
   the rendering thread's CPU time (what a render costs, independent of other load on the host),
   for a new snapshot (the cold path, after every collector run) and for the same one again.

Note: the simulated backend polls for XID events every 50 ms where real NVML blocks in the driver,
so the simulated CPU figure is, if anything, an over-estimate of the agent's own cost.

    .venv/bin/python benchmarks/agent_overhead.py [--seconds 120] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
from eight_gpu_agent import SCENARIO, warm_snapshot


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, accept: str | None = None) -> bytes:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read()  # type: ignore[no-any-return]


def measure_process(seconds: float, warmup: float, dcgm_compat: bool, live: bool = False,
                    in_process_ranks: bool = False) -> dict[str, Any]:
    """``live``: the agent reads this machine's GPUs through NVML instead of 8 simulated ones.
    ``in_process_ranks``: ``agent.rank_process: false`` (the rank socket in the agent's own process, as before
    issue 30). ``rss_tree_*`` sums VmRSS over the agent and all its processes (the rank process, children)."""
    work = Path(tempfile.mkdtemp(prefix="gpuhealth-bench-"))
    scenario = work / "eight.yaml"
    scenario.write_text(SCENARIO)
    cfg = work / "agent.yaml"
    cfg.write_text(f"agent:\n  pod_resources_socket: {work / 'none.sock'}\n  socket_path: {work / 'agent.sock'}\n"
                   + ("  rank_process: false\n" if in_process_ranks else ""))
    port = _free_port()
    source = [] if live else ["--scenario", str(scenario)]
    args = [sys.executable, "-m", "gpuhealth.cli.main", "agent", "--config", str(cfg), *source,
            "--listen", f"127.0.0.1:{port}"]
    if dcgm_compat:
        args.append("--dcgm-compat")
    log = (work / "agent.log").open("wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("agent did not become ready: " + (work / "agent.log").read_text()[-2000:])
            time.sleep(0.2)
        ps = psutil.Process(proc.pid)
        time.sleep(warmup)
        cpu0 = ps.cpu_times()
        t0 = time.monotonic()
        rss: list[int] = []
        tree: list[int] = []
        procs = 1
        scrape_ms: list[float] = []
        sizes: list[int] = []
        next_scrape = t0
        while time.monotonic() - t0 < seconds:
            now = time.monotonic()
            if now >= next_scrape:
                s0 = time.perf_counter()
                body = _get(url + "/metrics")
                scrape_ms.append((time.perf_counter() - s0) * 1e3)
                sizes.append(len(body))
                next_scrape += 15.0
            rss.append(ps.memory_info().rss)
            kids = ps.children(recursive=True)
            procs = 1 + len(kids)
            tree.append(rss[-1] + sum(_rss(k) for k in kids))
            time.sleep(1.0)
        cpu1 = ps.cpu_times()
        elapsed = time.monotonic() - t0
        cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        health = json.loads(_get(url + "/health"))
        return {
            "live": live,
            "gpus": len(health.get("gpus", [])),
            "collectors_ok": sum(1 for c in health["node"].get("collectors", []) if c.get("success")),
            "dcgm_compat": dcgm_compat,
            "seconds": round(elapsed, 1),
            "cpu_seconds_per_minute": round(cpu_s / elapsed * 60, 3),
            "cpu_percent_of_one_core": round(cpu_s / elapsed * 100, 2),
            "rss_mib_max": round(max(rss) / 2**20, 1),
            "rss_mib_last": round(rss[-1] / 2**20, 1),
            "rss_tree_mib_max": round(max(tree) / 2**20, 1),
            "rss_tree_mib_last": round(tree[-1] / 2**20, 1),
            "processes": procs,
            "threads": ps.num_threads(),
            "scrapes": len(scrape_ms),
            "scrape_ms_median": round(statistics.median(scrape_ms), 2),
            "metrics_bytes": sizes[-1],
        }
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


def _rss(p: psutil.Process) -> int:
    try:
        return int(p.memory_info().rss)
    except psutil.Error:  # it ended between the listing and the reading
        return 0


def measure_render(repeat: int = 200) -> list[dict[str, Any]]:
    from gpuhealth.exporters.prometheus import MetricsEndpoint

    snap = warm_snapshot()
    rows = []
    for compat in (False, True):
        for fmt, accept in (("text 0.0.4", None), ("OpenMetrics", "application/openmetrics-text;version=1.0.0")):
            fresh = {"snap": snap}
            # a new snapshot object per render: the cold path, as after every collector run
            endpoint = MetricsEndpoint(lambda fresh=fresh: fresh["snap"], dcgm_compat=compat, process_metrics=True)
            times, cpu, cached = [], [], []
            for i in range(repeat + 10):
                fresh["snap"] = replace(snap)
                c0, t0 = time.thread_time(), time.perf_counter()
                body, _ = endpoint.render(accept)
                c1, t1 = time.thread_time(), time.perf_counter()
                endpoint.render(accept)  # same snapshot again: the cached path (a second scraper)
                t2 = time.perf_counter()
                if i >= 10:
                    times.append((t1 - t0) * 1e3)
                    cpu.append((c1 - c0) * 1e3)
                    cached.append((t2 - t1) * 1e3)
            rows.append({"dcgm_compat": compat, "format": fmt, "ms_median": round(statistics.median(times), 2),
                         "ms_p95": round(sorted(times)[int(0.95 * len(times))], 2),
                         "cpu_ms_median": round(statistics.median(cpu), 2),
                         "cached_ms_median": round(statistics.median(cached), 3),
                         "series": body.count(b"\n") - body.count(b"\n#"), "bytes": len(body)})
    return rows


def wakeup_cost_us(seconds: float = 5.0, period: float = 0.01) -> float:
    """CPU cost of one idle thread wake-up on this host (context for the process figure: every
    thread that waits with a timeout pays it; on small VMs it can be a millisecond)."""
    import threading

    done = threading.Event()
    box: dict[str, float] = {}

    def loop() -> None:
        t0, n = time.thread_time(), 0
        while not done.wait(period):
            n += 1
        box["cost"] = (time.thread_time() - t0) / max(n, 1) * 1e6

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(seconds)
    done.set()
    t.join()
    return round(box["cost"], 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=120.0, help="measurement window per run (default 120)")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--skip-process", action="store_true", help="only the render-time measurement")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--live", action="store_true",
                    help="the agent process reads this machine's GPUs through NVML (not 8 simulated ones)")
    ap.add_argument("--in-process-ranks", action="store_true",
                    help="agent.rank_process: false (the rank socket in the agent's own process, as before issue 30)")
    args = ap.parse_args()
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "load_avg_1m": round(os.getloadavg()[0], 2), "thread_wakeup_cpu_us": wakeup_cost_us()}
    render = measure_render()
    process = [] if args.skip_process else [measure_process(args.seconds, args.warmup, dcgm_compat=False,
                                                            live=args.live, in_process_ranks=args.in_process_ranks)]
    if args.json:
        print(json.dumps({"env": env, "render": render, "process": process}, indent=1))
        return
    print(f"# agent overhead, 8 simulated GPUs — {env}")
    for r in render:
        print(f"render /metrics  dcgm_compat={r['dcgm_compat']!s:5}  {r['format']:11}  median {r['ms_median']:.2f} ms"
              f"  p95 {r['ms_p95']:.2f} ms  CPU {r['cpu_ms_median']:.2f} ms"
              f"  (same snapshot again: {r['cached_ms_median']:.3f} ms; "
              f"{r['series']} series, {r['bytes']} bytes)   goal ≤ 5 ms")
    for p in process:
        print(f"agent process ({'LIVE' if p['live'] else 'simulated'}, {p['gpus']} GPUs, {p['seconds']} s, "
              f"scraped every 15 s): {p['cpu_seconds_per_minute']} CPU-s/min = "
              f"{p['cpu_percent_of_one_core']}% of one core (goal ≤ 1%), RSS max {p['rss_mib_max']} MiB "
              f"(goal ≤ 80 MiB), all {p['processes']} processes {p['rss_tree_mib_max']} MiB max, "
              f"{p['threads']} threads, scrape {p['scrape_ms_median']} ms median over HTTP, "
              f"{p['metrics_bytes']} bytes")


if __name__ == "__main__":
    main()
