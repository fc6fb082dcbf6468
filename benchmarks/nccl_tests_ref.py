"""Run the nccl-tests binaries (built elsewhere) and write {collective: {size: busbw}} for busbw_bench.py.

    python benchmarks/nccl_tests_ref.py --build DIR --gpus N --out FILE [--sizes 1048576,67108864,2147483648]
Each (collective, size) runs as `<binary> -b S -e S -g N -w 5 -n 20` (the flags docs/measurements.md used);
out-of-place busbw is kept.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from busbw_bench import _BINARIES, parse_nccl_tests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sizes", default=f"{1 << 20},{64 << 20},{2 << 30}")
    args = ap.parse_args()
    doc: dict[str, dict[int, float]] = {}
    for coll, binary in _BINARIES.items():
        for size in (int(s) for s in args.sizes.split(",")):
            cmd = [str(Path(args.build) / binary), "-b", str(size), "-e", str(size), "-g", str(args.gpus),
                   "-w", "5", "-n", "20"]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            got = parse_nccl_tests(res.stdout)
            if size in got:
                doc.setdefault(coll, {})[size] = got[size]
            print(coll, size, got.get(size), "rc", res.returncode, res.stderr[-300:] if res.returncode else "")
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
