"""Wall time of ``gpuhealth qualify --level quick`` on this node (goal: ≤ 60 s on 8 GPUs).

Run on a GPU node from the repo root:  PYTHONPATH=src python benchmarks/qualify_bench.py [--runs 2] [--out F]
The first run pays cold costs (Triton compile, cuBLAS/NCCL init); later ones show the steady state.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--level", default="quick")
    ap.add_argument("--out")
    ap.add_argument("--save-reports", help="folder for each run's full `qualify --json` report")
    args = ap.parse_args()
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    rows = []
    for i in range(args.runs):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "qualify", "--level", args.level, "--json"],
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        try:
            doc = json.loads(res.stdout)
        except json.JSONDecodeError:
            print(f"run {i}: exit {res.returncode}, no JSON: {res.stderr[-800:]}")
            return 1
        if args.save_reports:
            with open(f"{args.save_reports}/qualify_{args.level}_run{i}.json", "w") as fh:
                fh.write(res.stdout)
        steps = {d["diag"]: (d["status"], round(d["wall_s"], 1)) for d in doc["diagnostics"]}
        rows.append({"run": i, "wall_s": round(wall, 1), "exit": res.returncode, "health": doc["node"]["health"],
                     "steps": steps})
        print(f"run {i}: {wall:.1f} s, exit {res.returncode}, {doc['node']['health']}, {steps}")
    print(smi)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpus": smi, "level": args.level, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
