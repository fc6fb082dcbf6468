"""Screen abort latency on the CPU path: from a job starting to the screen's processes being gone.

A real screen runs — ``python -m gpuhealth.diag quick --device cpu`` through ``DiagRunner`` with a
``ScreenWatch``, i.e. a launcher and one Gloo rank per "GPU" doing the quick qualification's SDC, copies
and collectives — and at a random moment a job "starts" in one of two ways the agent watches:

- ``block``: the Slurm prolog writes its file into the block directory;
- ``nvml``: a compute process appears on a screened GPU in the NVML backend the agent reads (the
  recording's scenario clock is stepped, as a real process would appear in NVML's list).

Measured per trial: job start → the last process of the screen's group is gone (the GPUs free: on a
GPU node, the driver frees a context when its process exits; that part is not measured here) and →
the runner has returned ``aborted``. The poll is ``screen.POLL_S`` (100 ms) and the SIGTERM→SIGKILL
grace ``runner.TERM_GRACE_S`` (300 ms), so the design bound is ~0.4 s plus process exit.

    PYTHONPATH=src python benchmarks/screen_abort.py                    # 10 trials of each trigger
    PYTHONPATH=src python benchmarks/screen_abort.py --trials 20 --world 4 --out results/screen_abort.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import DiagConfig
from gpuhealth.diag.runner import DiagOutcome, DiagRunner
from gpuhealth.diag.screen import ScreenBlock, ScreenWatch

QUICK_CPU = ["--device", "cpu", "--node", "bench", "--sizes", f"{64 << 10},{1 << 20},{16 << 20}", "--iters", "20",
             "--d2d-mib", "64", "--reps", "3"]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _group_members(pgid: int) -> int:
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            n += 1
    return n


def trial(trigger: str, world: int, tmp: Path, delay_s: float) -> dict[str, Any] | None:
    blocks = tmp / "block"
    blocks.mkdir(exist_ok=True)
    for f in blocks.iterdir():
        f.unlink()
    clock = Clock()
    job_pid = os.getppid()  # any live process outside the screen's group stands for the job
    backend = FakeNvml.from_scenario({"recording": "nvml_h200x2.json", "events": [
        {"at": 10, "type": "set", "gpu": 0, "key": "ComputeRunningProcesses", "value": [{"pid": job_pid}]}]},
        clock=clock)
    backend.init()
    watched = [GpuIdentity(0, "GPU-0", "stand-in", "")]
    watch = ScreenWatch(ScreenBlock(blocks), backend, also=watched)
    runner = DiagRunner(DiagConfig(), state_dir=tmp / "state")
    box: list[DiagOutcome] = []
    returned: list[float] = []

    def run() -> None:
        box.append(runner.run("quick", [*QUICK_CPU, "--world", str(world), "--golden-dir", str(tmp / "gold")],
                              gpus=None, timeout_s=300, watch=watch))
        returned.append(time.perf_counter())

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(delay_s)
    if box:  # it finished before the job came: no abort to measure
        thread.join()
        return None
    pgid = _child_pgid()
    members = _group_members(pgid) if pgid else 0
    t0 = time.perf_counter()
    if trigger == "block":
        (blocks / "job-1").write_text(json.dumps({"holder": "prolog of job 1", "at": time.time()}))
    else:
        clock.t = 100.0
    while pgid and _group_members(pgid):
        time.sleep(0.001)
    freed = time.perf_counter()
    thread.join()
    out = box[0]
    if out.status != "aborted":
        return None
    return {"trigger": trigger, "delay_s": round(delay_s, 3), "processes": members,
            "free_s": round(freed - t0, 4), "returned_s": round(returned[0] - t0, 4), "reason": out.reason}


def _child_pgid() -> int | None:
    """The screen child's process group: the newest session leader running ``gpuhealth.diag quick``."""
    best: tuple[float, int] | None = None
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{name}/stat").read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if b"gpuhealth.diag" in cmd and b"quick" in cmd and int(stat[2]) == int(name):
            start = float(stat[19])
            if best is None or start > best[0]:
                best = (start, int(name))
    return best[1] if best else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--world", type=int, default=2, help="ranks (stand-ins for GPUs)")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--out")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpuhealth-screen-abort-") as tmp:
        for trigger in ("block", "nvml"):
            done = 0
            while done < args.trials:
                row = trial(trigger, args.world, Path(tmp), rng.uniform(0.5, 3.0))
                if row is None:
                    continue
                rows.append(row)
                done += 1
                print(json.dumps(row), file=sys.stderr)
    summary: dict[str, Any] = {"world": args.world, "trials": args.trials, "cpus": os.cpu_count(),
                               "load": os.getloadavg()[0]}
    for trigger in ("block", "nvml"):
        free = [r["free_s"] for r in rows if r["trigger"] == trigger]
        ret = [r["returned_s"] for r in rows if r["trigger"] == trigger]
        summary[trigger] = {"free_median_s": round(statistics.median(free), 3), "free_max_s": round(max(free), 3),
                            "returned_median_s": round(statistics.median(ret), 3),
                            "returned_max_s": round(max(ret), 3)}
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "trials": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
