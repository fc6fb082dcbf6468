"""Cost of a full collector sweep, per GPU, fast lane and slow lane apart.

Goals (issue 2): over the fake backend, ≤ 0.5 ms of our own Python time per GPU per sweep; on a real
GPU, a sweep's wall time per GPU ≤ 2 ms (fast lane) and ≤ 10 ms (slow lane).

    python benchmarks/collector_sweep.py                 # fake backend, 8 GPUs cloned from the H200 recording
    python benchmarks/collector_sweep.py --gpus 2 --sweeps 200
    python benchmarks/collector_sweep.py --real          # live NVML on this node

Every collector goes through ``CollectorRunner`` exactly as the agent runs it (worker thread,
timeout, history); ``--inline`` runs them on the calling thread to show the runner's own share.
Prints a table, then one JSON line (``--json-out FILE`` writes it too).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuhealth.backends.base import NvmlBackend
from gpuhealth.backends.kmsg import DevKmsg, KmsgLines, KmsgSource
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.backends.sysfs import sysfs_for
from gpuhealth.collectors.base import CollectContext, Collector, History, Lane
from gpuhealth.collectors.registry import all_collectors
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.config import Config


def _fake_backend(gpus: int) -> FakeNvml:
    scenario = {"recording": "nvml_h200x2.json", "gpu_count": gpus}
    path = Path(tempfile.mkdtemp(prefix="gpuhealth-bench-")) / "scenario.json"
    path.write_text(json.dumps(scenario))
    fake = FakeNvml.from_file(path)
    fake.init()
    return fake


def _real_backend() -> NvmlBackend:
    from gpuhealth.backends.nvml_real import RealNvml

    backend = RealNvml()
    backend.init()
    return backend


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(backend: NvmlBackend, sweeps: int, warmup: int, inline: bool) -> dict[str, Any]:
    config = Config()
    collectors: list[Collector] = all_collectors(config)
    gpus = enumerate_gpus(backend)
    n = max(1, len(gpus))
    kmsg: KmsgSource = KmsgLines([]) if backend.simulated else DevKmsg()
    sysfs = sysfs_for(backend)
    runner = CollectorRunner(timeout_s=None if inline else 10.0)
    histories = {c.name: History(config.collectors.history_len) for c in collectors}
    per_lane: dict[str, list[float]] = {Lane.FAST.value: [], Lane.SLOW.value: []}
    per_collector: dict[str, list[float]] = {c.name: [] for c in collectors}
    failures: dict[str, str] = {}
    # Each lane's sweeps are stamped its interval apart, as the agent runs them: rate judgements compare a
    # reading with one at least a window older, and sweeps stamped milliseconds apart would make every
    # collector walk its whole history for one (a cost no agent pays).
    interval = {Lane.FAST.value: config.collectors.fast_interval_s, Lane.SLOW.value: config.collectors.slow_interval_s}
    start = time.time()
    for i in range(warmup + sweeps):
        ctxs = {lane: CollectContext(backend=backend, config=config, gpus=gpus, node_name="bench",
                                     now=start + i * every, sysfs=sysfs, kmsg=kmsg, extras={"one_shot": True})
                for lane, every in interval.items()}
        lane_total = {Lane.FAST.value: 0.0, Lane.SLOW.value: 0.0}
        for c in collectors:
            ctx = ctxs[c.lane.value]
            t0 = time.perf_counter()
            run = runner.run(c, ctx, histories[c.name])
            dt = time.perf_counter() - t0
            if not run.success:
                failures[c.name] = run.error or "?"
            lane_total[c.lane.value] += dt
            if i >= warmup:
                per_collector[c.name].append(dt)
        if i >= warmup:
            for lane, total in lane_total.items():
                per_lane[lane].append(total)
    runner.close()
    for c in collectors:
        close = getattr(c, "close", None)
        if callable(close):
            close()
    lanes = {}
    for lane, totals in per_lane.items():
        lanes[lane] = {
            "collectors": [c.name for c in collectors if c.lane.value == lane],
            "median_ms_per_gpu": statistics.median(totals) * 1e3 / n,
            "p90_ms_per_gpu": _pct(totals, 0.9) * 1e3 / n,
            "median_ms_sweep": statistics.median(totals) * 1e3,
        }
    return {
        "gpus": n,
        "gpu_name": gpus[0].name if gpus else "",
        "backend": backend.description,
        "sweeps": sweeps,
        "runner": "inline" if inline else "worker threads",
        "lanes": lanes,
        "per_collector_median_ms": {k: statistics.median(v) * 1e3 for k, v in per_collector.items() if v},
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help="live NVML on this node instead of the fake backend")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs in the fake backend (cloned from the H200 recording)")
    ap.add_argument("--sweeps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--inline", action="store_true", help="run collectors on this thread (no runner threads)")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        backend = _real_backend() if args.real else _fake_backend(args.gpus)
    except Exception as exc:  # a benchmark script: say why and stop
        print(f"collector_sweep: cannot open the backend: {exc}", file=sys.stderr)
        return 3
    result = measure(backend, args.sweeps, args.warmup, args.inline)
    backend.shutdown()
    goals = {"fast": 2.0, "slow": 10.0} if args.real else {"fast": 0.5, "slow": 0.5}
    result.update({
        "mode": "real" if args.real else "fake",
        "goal_ms_per_gpu": goals,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": platform.node(),
        "python": platform.python_version(),
        "command": " ".join(["python", "benchmarks/collector_sweep.py", *(argv if argv is not None else sys.argv[1:])]),
    })
    print(f"collector sweep — {result['mode']} backend: {result['gpus']} × {result['gpu_name']} "
          f"({result['backend']}), {args.sweeps} sweeps, runner: {result['runner']}")
    print(f"{'lane':<6} {'median ms/GPU':>14} {'p90 ms/GPU':>11} {'goal':>6}  collectors")
    for lane, row in result["lanes"].items():
        print(f"{lane:<6} {row['median_ms_per_gpu']:>14.3f} {row['p90_ms_per_gpu']:>11.3f} "
              f"{goals[lane]:>6.1f}  {', '.join(row['collectors'])}")
    print("per collector (median ms per sweep, all GPUs): " + ", ".join(
        f"{k} {v:.3f}" for k, v in result["per_collector_median_ms"].items()))
    if result["failures"]:
        print(f"failures: {result['failures']}")
    line = json.dumps(result)
    print(line)
    if args.json_out:
        args.json_out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
