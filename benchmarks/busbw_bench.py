"""NCCL bus bandwidth through gpuhealth's probe vs the nccl-tests numbers in MEASUREMENTS.md.

Run on a multi-GPU machine from the repo root:  PYTHONPATH=src python benchmarks/busbw_bench.py [--out FILE]
Reference: 2 × H200 (NVSwitch), nccl-tests 2.19.6 `-g 2 -w 5 -n 20`, GB/s busbw. Goals (issue 5):
within 3% at ≥ 64 MiB and ≥ 0.9 at 1 MiB (where a plain torch loop reached only 0.25–0.63).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from gpuhealth.diag.busbw import RankPlan, launch_local

MiB, GiB = 1 << 20, 1 << 30
NCCL_TESTS = {  # collective → {size: busbw GB/s}
    "all_reduce": {MiB: 70, 64 * MiB: 270, 2 * GiB: 340},
    "all_gather": {MiB: 38, 64 * MiB: 215, 2 * GiB: 278},
    "reduce_scatter": {MiB: 37, 64 * MiB: 210, 2 * GiB: 277},
    "all_to_all": {MiB: 36, 64 * MiB: 245, 2 * GiB: 336},
    "broadcast": {MiB: 73, 64 * MiB: 329, 2 * GiB: 367},
    "sendrecv": {MiB: 65, 64 * MiB: 268, 2 * GiB: 364},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="also time without CUDA graphs (1 MiB only)")
    args = ap.parse_args()
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    plan = RankPlan(tuple(NCCL_TESTS), (MiB, 64 * MiB, 2 * GiB), warmup=5, iters=20, replays=3)
    t0 = time.perf_counter()
    points = launch_local(args.world, plan, timeout_s=500)
    wall = time.perf_counter() - t0
    eager = []
    if args.eager:
        eager = launch_local(args.world, RankPlan(tuple(NCCL_TESTS), (MiB,), use_graphs=False), timeout_s=200)
    rows = []
    for p in points:
        ref = NCCL_TESTS[p.collective].get(p.size_bytes)
        e = next((q for q in eager if q.collective == p.collective and q.size_bytes == p.size_bytes), None)
        rows.append({**p.to_dict(), "nccl_tests_gbps": ref, "ratio": p.busbw_gbps / ref if ref else None,
                     "eager_busbw_gbps": e.busbw_gbps if e else None})
    print(smi)
    print(f"{'collective':15} {'size':>10} {'busbw':>7} {'nccl-tests':>10} {'ratio':>6} {'graph':>5} {'errors':>6}"
          f" {'eager':>6}")
    for r in rows:
        print(f"{r['collective']:15} {r['size_bytes']:>10} {r['busbw_gbps']:7.1f} {r['nccl_tests_gbps'] or 0:10.0f} "
              f"{r['ratio'] or 0:6.3f} {r['graph']!s:>5} {r['errors']:>6} {r['eager_busbw_gbps'] or 0:6.1f}")
    print(f"wall {wall:.1f} s for {len(points)} points")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpus": smi, "rows": rows, "wall_s": wall,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
