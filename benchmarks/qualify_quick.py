"""Quick qualification: three separate diagnostic children (before) vs one warm process per GPU
(``diag/quick.py``, after), side by side on this machine, with the after path's split per phase.

    PYTHONPATH=src python benchmarks/qualify_quick.py                     # CPU box: ranks stand in for GPUs
    PYTHONPATH=src python benchmarks/qualify_quick.py --device cuda       # a GPU node: every GPU
    PYTHONPATH=src python benchmarks/qualify_quick.py --world 4 --runs 3 --out results/qualify_quick.json

Both paths run the same probes as ``qualify --level quick`` (SDC on every datapath once, all_reduce +
all_gather at 1 MiB / 64 MiB / 1 GiB, 512 MiB device copies, 128 MiB host copies); on the CPU path the
collective sizes are cut (``--cpu-sizes``) so two cores finish in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def _child(args: list[str], timeout: float = 900.0) -> tuple[float, dict]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "gpuhealth.diag", *args], capture_output=True, text=True,
                         timeout=timeout)
    wall = time.perf_counter() - t0
    lines = [line for line in res.stdout.strip().splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{args[0]} printed no result (exit {res.returncode}): {res.stderr[-800:]}")
    return wall, json.loads(lines[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world", type=int, default=2, help="ranks (CPU) or GPUs (default CUDA: every GPU)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpu-sizes", default=f"{64 << 10},{MiB},{4 * MiB}")
    ap.add_argument("--out")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    sizes = args.cpu_sizes if cpu else f"{MiB},{64 * MiB},{1024 * MiB}"
    busbw = ["--collectives", "all_reduce,all_gather", "--sizes", sizes, "--iters", "10"]
    bw = ["--d2d-mib", "64" if cpu else "512", "--host-mib", "128", "--reps", "3"]
    world = ["--world", str(args.world)]
    rows = []
    with tempfile.TemporaryDirectory() as gold:
        for run in range(args.runs):
            before: dict[str, float] = {}
            sdc_args = ["sdc", "--device", "cpu", "--cpu-peers", str(args.world)] if cpu else ["sdc"]
            before["sdc"], _ = _child([*sdc_args, "--repeats", "1", "--golden-dir", gold])
            before["busbw"], _ = _child(["busbw", "--device", args.device, *world, *busbw])
            before["bandwidth"], _ = _child(["bandwidth", "--device", args.device, *bw])
            wall, doc = _child(["quick", "--device", args.device, *world, *busbw, *bw, "--golden-dir", gold])
            statuses = {k: doc["result"][k]["status"] for k in ("sdc", "busbw", "bandwidth")}
            rows.append({"run": run, "before_s": {k: round(v, 2) for k, v in before.items()},
                         "before_total_s": round(sum(before.values()), 2), "after_s": round(wall, 2),
                         "phases": doc["result"]["phases"], "statuses": statuses})
            print(json.dumps(rows[-1]))
    b = statistics.median(r["before_total_s"] for r in rows)
    a = statistics.median(r["after_s"] for r in rows)
    summary = {"device": args.device, "world": args.world, "runs": args.runs, "before_median_s": b,
               "after_median_s": a, "speedup": round(b / a, 2),
               "phases_median_s": {k: round(statistics.median(r["phases"][k] for r in rows), 3)
                                   for k in rows[0]["phases"]}}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
