"""NCCL bus bandwidth through gpuhealth's probe vs nccl-tests, with the timing modes side by side.

Run on a multi-GPU machine from the repo root:
    PYTHONPATH=src python benchmarks/busbw_bench.py [--world N] [--nccl-tests FILE] [--modes auto,eager,graph]
Reference: ``--nccl-tests FILE`` (JSON {collective: {size_bytes: busbw}}, measured on the same machine,
e.g. by parse_nccl_tests below from the binaries' output), else the 2 × H200 numbers of docs/measurements.md
(nccl-tests 2.19.6 `-g 2 -w 5 -n 20`). Goals (issue 5): within 3 % at ≥ 64 MiB and ≥ 0.9 at 1 MiB.
Modes: auto = what ships (CUDA graphs up to 16 MiB, eager above), eager = no graphs, graph = graphs at
every size. All modes run in this one invocation, so their ratios share the machine's state.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuhealth.diag.busbw import RankPlan, launch_local

MiB, GiB = 1 << 20, 1 << 30
MEASUREMENTS_2GPU = {  # collective → {size: busbw GB/s}
    "all_reduce": {MiB: 70, 64 * MiB: 270, 2 * GiB: 340},
    "all_gather": {MiB: 38, 64 * MiB: 215, 2 * GiB: 278},
    "reduce_scatter": {MiB: 37, 64 * MiB: 210, 2 * GiB: 277},
    "all_to_all": {MiB: 36, 64 * MiB: 245, 2 * GiB: 336},
    "broadcast": {MiB: 73, 64 * MiB: 329, 2 * GiB: 367},
    "sendrecv": {MiB: 65, 64 * MiB: 268, 2 * GiB: 364},
}
_BINARIES = {"all_reduce": "all_reduce_perf", "all_gather": "all_gather_perf",
             "reduce_scatter": "reduce_scatter_perf", "all_to_all": "alltoall_perf",
             "broadcast": "broadcast_perf", "sendrecv": "sendrecv_perf"}


def parse_nccl_tests(text: str) -> dict[int, float]:
    """size → out-of-place busbw from one nccl-tests binary's output."""
    rows: dict[int, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 8 and re.fullmatch(r"\d+", parts[0]) and re.fullmatch(r"\d+", parts[1]):
            # size count type redop root time algbw busbw #wrong | in-place ...
            try:
                rows[int(parts[0])] = float(parts[7])
            except ValueError:
                continue
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--nccl-tests", help="JSON {collective: {size: busbw}} measured on this machine")
    ap.add_argument("--modes", default="auto,eager", help="comma list of auto, eager, graph")
    ap.add_argument("--sizes", default=f"{MiB},{64 * MiB},{2 * GiB}")
    args = ap.parse_args()
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    if args.nccl_tests:
        loaded = json.loads(Path(args.nccl_tests).read_text())
        ref = {c: {int(k): float(v) for k, v in d.items()} for c, d in loaded.items()}
        ref_name = f"nccl-tests on this machine ({args.nccl_tests})"
    else:
        ref, ref_name = MEASUREMENTS_2GPU, "docs/measurements.md 2 x H200"
    sizes = tuple(int(s) for s in args.sizes.split(","))
    plans = {"auto": RankPlan(tuple(_BINARIES), sizes),
             "eager": RankPlan(tuple(_BINARIES), sizes, use_graphs=False),
             "graph": RankPlan(tuple(_BINARIES), sizes, graph_max_bytes=1 << 62)}
    results: dict[str, dict[tuple[str, int], Any]] = {}
    walls = {}
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        pts = launch_local(args.world, plans[mode], timeout_s=500)
        walls[mode] = time.perf_counter() - t0
        results[mode] = {(p.collective, p.size_bytes): p for p in pts}
    modes = list(results)
    rows = []
    print(smi)
    print(f"world {args.world}; reference: {ref_name}")
    print(f"{'collective':15} {'size':>10} {'ref':>6} " + " ".join(f"{m + ' GB/s':>11} {'ratio':>6}" for m in modes)
          + " errors")
    for key in results[modes[0]]:
        coll, size = key
        r = ref.get(coll, {}).get(size)
        row: dict[str, Any] = {"collective": coll, "size_bytes": size, "reference_gbps": r}
        cells = []
        for m in modes:
            p = results[m][key]
            row[m] = {"busbw_gbps": p.busbw_gbps, "ratio": p.busbw_gbps / r if r else None, "graph": p.graph,
                      "errors": p.errors}
            cells.append(f"{p.busbw_gbps:11.1f} {(p.busbw_gbps / r if r else 0):6.3f}")
        rows.append(row)
        errors = sum(results[m][key].errors for m in modes)
        print(f"{coll:15} {size:>10} {r or 0:6.0f} " + " ".join(cells) + f" {errors}")
    print("wall s per mode:", {m: round(w, 1) for m, w in walls.items()})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpus": smi, "world": args.world, "reference": ref_name, "rows": rows, "wall_s": walls,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
