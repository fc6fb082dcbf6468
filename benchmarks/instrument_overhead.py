"""Overhead of the instrument hook (``gpuhealth.instrument.Tracker``) per training step.

Goal (issue 4): hook overhead ≤ 1% of step time, no host sync per step on CUDA.

Three measurements, baseline and hooked side by side in one run (interleaved blocks, medians):

1. ``hook_cost``: the bare cost of ``with tracker.step(): with tracker.collective(): pass`` per step
   (µs), against the same loop without the hook.
2. ``cpu``: a CPU training-like step (a few fp32 matmuls + a real Gloo ``all_reduce`` on a
   one-process group), plain vs ``Tracker`` + ``wrap_collectives`` — overhead in % of step time.
3. ``cuda`` (when CUDA is available): bf16 matmuls + an NCCL ``all_reduce`` (one-process group),
   host loop never synchronizes per step; plain vs hooked with lazy CUDA events. Reports overhead %
   and checks that every step's record was resolved (lazily) with its compute/wait split.

Records go to a real agent socket served by a ``RankHub`` in a separate process (``--sink agent``,
default) or to a JSONL file (``--sink jsonl``).

    python benchmarks/instrument_overhead.py [--json OUT.json] [--quick]
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
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpuhealth.instrument import Tracker  # noqa: E402  (after the src path for running from a checkout)

HUB_CODE = """
import sys, time, signal
from gpuhealth.agent.ranks import RankHub
hub = RankHub(sys.argv[1]); n = [0]
hub.add_listener(on_steps=lambda i, rs: n.__setitem__(0, n[0] + len(rs)))
hub.start(); print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *a: (print(n[0], flush=True), hub.stop(), sys.exit(0)))
while True: time.sleep(1)
"""


def start_hub(sock: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", HUB_CODE, sock], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def stop_hub(proc: subprocess.Popen[str]) -> int:
    proc.terminate()
    out, _ = proc.communicate(10)
    return int(out.strip().splitlines()[-1]) if out.strip() else -1


def interleaved(run_plain: Callable[[], float], run_hooked: Callable[[], float], blocks: int) -> dict[str, Any]:
    """Alternate plain/hooked blocks (each returns seconds per step); medians and overhead."""
    plain: list[float] = []
    hooked: list[float] = []
    for i in range(blocks):
        if i % 2 == 0:
            plain.append(run_plain())
            hooked.append(run_hooked())
        else:
            hooked.append(run_hooked())
            plain.append(run_plain())
    p, h = statistics.median(plain), statistics.median(hooked)
    return {"plain_step_ms": p * 1e3, "hooked_step_ms": h * 1e3, "overhead_us_per_step": (h - p) * 1e6,
            "overhead_pct": (h - p) / p * 100.0, "blocks": blocks,
            "plain_spread_pct": (max(plain) - min(plain)) / p * 100.0,
            "hooked_spread_pct": (max(hooked) - min(hooked)) / h * 100.0}


def bench_hook_cost(tracker: Tracker, iters: int, blocks: int) -> dict[str, Any]:
    def plain() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            pass
        return (time.perf_counter() - t0) / iters

    def hooked() -> float:
        step, coll = tracker.step, tracker.collective
        t0 = time.perf_counter()
        for _ in range(iters):
            with step(), coll():
                pass
        return (time.perf_counter() - t0) / iters

    r = interleaved(plain, hooked, blocks)
    return {"hook_us_per_step": r["overhead_us_per_step"], "iters_per_block": iters, "blocks": blocks}


def bench_cpu(tracker: Tracker, steps: int, blocks: int, size: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    a = torch.randn(size, size)
    w = [torch.randn(size, size) for _ in range(3)]
    grad = torch.randn(1 << 20)  # 4 MiB gradient

    def one_step() -> None:
        x = a
        for m in w:
            x = torch.tanh(x @ m)
        dist.all_reduce(grad)

    def plain() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            one_step()
        return (time.perf_counter() - t0) / steps

    def hooked() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            with tracker.step():
                one_step()
        return (time.perf_counter() - t0) / steps

    original = dist.all_reduce
    tracker.wrap_collectives(["all_reduce"])
    wrapped = dist.all_reduce

    def plain_unwrapped() -> float:
        dist.all_reduce = original
        try:
            return plain()
        finally:
            dist.all_reduce = wrapped

    one_step()  # warm-up
    r = interleaved(plain_unwrapped, hooked, blocks)
    # The same comparison with no hook on either side: the run-to-run noise floor of this machine.
    r["noise_pct_plain_vs_plain"] = interleaved(plain_unwrapped, plain_unwrapped, blocks)["overhead_pct"]
    tracker.unwrap_collectives()
    r.update(steps_per_block=steps, matmul_size=size, torch=torch.__version__, threads=torch.get_num_threads())
    return r


def bench_cuda(steps: int, blocks: int, size: int, sink: dict[str, Any], collective: bool = True) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    w = [torch.randn(size, size, device=dev, dtype=torch.bfloat16) / size**0.5 for _ in range(8)]
    grad = torch.randn(16 << 20, device=dev)  # 64 MiB gradient

    def one_step() -> None:
        x = a
        for m in w:
            x = torch.relu(x @ m)
        if collective:
            dist.all_reduce(grad)

    nccl_timing = os.environ.get("TORCH_NCCL_ENABLE_TIMING") == "1"
    tracker = Tracker(timing="cuda", nccl_timing=nccl_timing, **sink)
    original = dist.all_reduce
    tracker.wrap_collectives(["all_reduce"])
    wrapped = dist.all_reduce

    def run(hook: bool) -> float:
        dist.all_reduce = wrapped if hook else original
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            if hook:
                with tracker.step():
                    one_step()
            else:
                one_step()
        torch.cuda.synchronize()  # once per block: the loop itself never waits for the GPU
        return (time.perf_counter() - t0) / steps

    for _ in range(3):
        one_step()
    r = interleaved(lambda: run(False), lambda: run(True), blocks)
    r["noise_pct_plain_vs_plain"] = interleaved(lambda: run(False), lambda: run(False), blocks)["overhead_pct"]
    dist.all_reduce = wrapped
    # Host-side cost of the hook alone (events recorded, nothing waited for).
    host = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            with tracker.step(), tracker.collective():
                pass
        host.append((time.perf_counter() - t0) / 200)
    torch.cuda.synchronize()
    pending_before_close = tracker.stats()["pending"]
    tracker.close()
    st = tracker.stats()
    r["split_check"] = check_cuda_split(one_step, nccl_timing, steps)
    r.update(nccl_timing=st["nccl_timing"], steps_per_block=steps, matmul_size=size,
             gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
             hook_host_us_per_step=statistics.median(host) * 1e6, records_submitted=st["submitted"],
             steps_tracked=st["steps"], unresolved_dropped=st["unresolved_dropped"],
             pending_before_close=pending_before_close, timing=st["timing"])
    return r


def check_cuda_split(one_step: Callable[[], None], nccl_timing: bool, steps: int) -> dict[str, Any]:
    """The records themselves: every step resolved, with a compute/wait split that adds up."""
    import torch

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "steps.jsonl"
        tracker = Tracker(out, socket_path="", timing="cuda", nccl_timing=nccl_timing)
        tracker.wrap_collectives(["all_reduce"])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            with tracker.step():
                one_step()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) / steps * 1e3
        tracker.close()
        recs = [json.loads(line) for line in out.read_text().splitlines()]
    split = [r for r in recs if r["compute_s"] is not None]
    return {
        "records": len(recs), "steps": steps, "with_split": len(split), "host_ms_per_step": host_ms,
        "median_wall_ms": statistics.median(r["wall_s"] for r in recs) * 1e3,
        "median_compute_ms": statistics.median(r["compute_s"] for r in split) * 1e3 if split else None,
        "median_comm_wait_ms": statistics.median(r["comm_wait_s"] for r in split) * 1e3 if split else None,
        "nccl_timing_used": tracker.nccl_timing,
    }


def hold_until_released(release: Path) -> None:
    """The stuck rank of the NCCL job: busy on the host, never reaches the collective."""
    while not release.exists():
        time.sleep(0.02)


def wait_in_allreduce(grad: Any) -> None:
    """The other rank: its all_reduce is enqueued and never completes; the host waits in sync."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(grad)
    if grad.is_cuda:
        torch.cuda.synchronize()


def _nccl_rank(rank: int, world: int, port: int, sock: str, release: str, steps: int, size: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GPUHEALTH_SOCKET=sock, GPUHEALTH_JOB_ID="nccl-straggler")
    if torch.cuda.is_available():
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=timedelta(seconds=300))
    else:  # a dry run of the same job on CPU/Gloo
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=300))
        size = 256
    tracker = Tracker(flush_interval_s=0.2)
    tracker.wrap_collectives()
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    w = torch.randn(size, size, device=dev, dtype=torch.bfloat16) / size**0.5
    grad = torch.randn(16 << 20, device=dev)
    n_mm = 8 if rank == world - 1 else 4  # the last rank does 2x the compute
    for _ in range(steps):
        with tracker.step():
            x = a
            for _ in range(n_mm):
                x = torch.relu(x @ w)
            dist.all_reduce(grad)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    if rank == world - 1:
        hold_until_released(Path(release))
        dist.all_reduce(grad)
    else:
        wait_in_allreduce(grad)
    sync()
    dist.barrier()
    tracker.close()
    print(json.dumps({"rank": rank, "tracker_stats": tracker.stats()}), flush=True)
    dist.destroy_process_group()


def nccl_job(world: int, steps: int, size: int, out: Path | None) -> dict[str, Any]:
    """A real NCCL job (one process per GPU) with a 2x-compute straggler, then a hang: the hook's
    per-rank split, an NCCL flight-recorder dump and Python stacks taken while a rank is blocked."""
    import multiprocessing as mp
    import socket as socketlib

    from gpuhealth.agent.ranks import RankHub

    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    tmp = Path(tempfile.mkdtemp(prefix="gh-nccl-"))
    sock, release = tmp / "agent.sock", tmp / "release"
    hub = RankHub(sock)
    records: dict[int, list[Any]] = {r: [] for r in range(world)}
    hub.add_listener(on_steps=lambda i, rs: [records[r.rank].append(r) for r in rs])
    hub.start()
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_nccl_rank, args=(r, world, port, str(sock), str(release), steps, size))
             for r in range(world)]
    for p in procs:
        p.start()
    res: dict[str, Any] = {"world": world, "steps": steps, "matmul_size": size,
                           "nccl_timing_env": os.environ.get("TORCH_NCCL_ENABLE_TIMING", "")}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(len(v) < steps for v in records.values()):
            time.sleep(0.1)
        per_rank = {}
        for r, recs in records.items():
            recs = sorted(recs, key=lambda x: x.step)[3:]
            split = [x for x in recs if x.compute_s is not None]
            per_rank[r] = {
                "records": len(recs) + 3, "with_split": len(split),
                "median_wall_ms": statistics.median(x.wall_s for x in recs) * 1e3 if recs else None,
                "median_compute_ms": statistics.median(x.compute_s for x in split) * 1e3 if split else None,
                "median_comm_wait_ms": statistics.median(x.comm_wait_s for x in split) * 1e3 if split else None,
            }
        res["per_rank"] = per_rank
        blocked = False
        while time.monotonic() < deadline and not blocked:
            st = hub.request_stacks("nccl-straggler", 0, timeout_s=5).get(0)
            blocked = isinstance(st, dict) and "wait_in_allreduce" in st["text"]
            time.sleep(0.2)
        time.sleep(1.0)
        t0 = time.perf_counter()
        dumps = hub.request_dump("nccl-straggler", None, str(out or tmp / "fr"), timeout_s=60)
        res["dump_seconds"] = time.perf_counter() - t0
        res["dumps"] = {}
        for r, path in dumps.items():
            if isinstance(path, Exception):
                res["dumps"][r] = repr(path)
                continue
            d = json.loads(Path(path).read_text())
            entries = d.get("entries", [])
            last = entries[-1] if entries else {}
            res["dumps"][r] = {
                "path": path, "version": d.get("version"), "comm_lib_version": d.get("comm_lib_version"),
                "entries": len(entries), "pg_status": d.get("pg_status"),
                "last": {k: last.get(k) for k in ("collective_seq_id", "profiling_name", "state", "duration_ms")},
                "with_duration_ms": sum(1 for e in entries if e.get("duration_ms")),
            }
        stacks = hub.request_stacks("nccl-straggler", None, timeout_s=10)
        res["stack_innermost_user_function"] = {
            r: (v if isinstance(v, Exception) else
                [f["function"] for t in v["threads"] if t["main"] for f in t["frames"]
                 if f["function"] in ("wait_in_allreduce", "hold_until_released")])
            for r, v in stacks.items()}
    finally:
        release.touch()
        for p in procs:
            p.join(120)
        res["exit_codes"] = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        hub.stop()
    return json.loads(json.dumps(res, default=repr))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write results here as JSON")
    ap.add_argument("--sink", choices=("agent", "jsonl"), default="agent")
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    ap.add_argument("--no-cuda", action="store_true")
    ap.add_argument("--nccl-job", type=int, metavar="WORLD", help="instead: a real NCCL straggler+hang job on "
                    "WORLD GPUs (hook split, FR dump and stacks while blocked)")
    ap.add_argument("--dump-dir", type=Path, help="--nccl-job: keep the flight-recorder dumps here")
    ap.add_argument("--cpu-size", type=int, default=768, help="matmul size of the CPU step (768: ~10 ms on 2 cores)")
    args = ap.parse_args()
    if args.nccl_job:
        res = nccl_job(args.nccl_job, 40, 8192, args.dump_dir)
        print(json.dumps(res, indent=2))
        if args.json:
            args.json.write_text(json.dumps(res, indent=2))
        return 0

    import torch
    import torch.distributed as dist

    tmp = Path(tempfile.mkdtemp(prefix="gh-bench-"))
    hub = None
    sink: dict[str, Any]
    if args.sink == "agent":
        hub = start_hub(str(tmp / "agent.sock"))
        sink = {"socket_path": str(tmp / "agent.sock")}
    else:
        sink = {"path": str(tmp / "steps.jsonl"), "socket_path": ""}
    os.environ.setdefault("GPUHEALTH_JOB_ID", "bench")
    blocks = 6 if args.quick else 16
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "sink": args.sink, "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    tracker = Tracker(timing="cpu", **sink)
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    store = tmp / "store"
    # Gloo for CPU tensors, NCCL for CUDA tensors when there is a GPU.
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", init_method=f"file://{store}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        results["cpu_step"] = bench_cpu(tracker, 10 if args.quick else 20, blocks, args.cpu_size)
        if use_cuda:
            # A short step (host launch cost matters most) and a typical one (~10 ms of matmuls).
            for size, n_steps in ((4096, 50), (8192, 20)):
                results[f"cuda_step_{size}"] = bench_cuda(n_steps // 2 if args.quick else n_steps, blocks, size, sink)
            # The same 8192 step without the all_reduce: the NCCL call adds block-to-block spread of
            # a few % on its own, which hides a sub-1% difference; compute alone is steady.
            results["cuda_compute_only_8192"] = bench_cuda(10 if args.quick else 20, blocks, 8192, sink,
                                                           collective=False)
        # Last: it floods the sink with ~10^5 records/s, which would disturb the others.
        results["hook_cost"] = bench_hook_cost(tracker, 5_000 if args.quick else 20_000, blocks)
        tracker.close()
    finally:
        dist.destroy_process_group()
        if hub is not None:
            results["agent_records_received"] = stop_hub(hub)
    results["cpu_tracker_stats"] = tracker.stats()

    print(json.dumps(results, indent=2))
    print()
    hc = results["hook_cost"]
    print(f"hook cost (empty step + collective): {hc['hook_us_per_step']:.2f} µs/step")
    for key in ("cpu_step", "cuda_step_4096", "cuda_step_8192", "cuda_compute_only_8192"):
        if key in results:
            r = results[key]
            print(f"{key}: plain {r['plain_step_ms']:.3f} ms, hooked {r['hooked_step_ms']:.3f} ms, "
                  f"overhead {r['overhead_us_per_step']:.1f} µs = {r['overhead_pct']:.2f} % "
                  f"(plain vs plain: {r['noise_pct_plain_vs_plain']:.2f} %; block spread "
                  f"{r['plain_spread_pct']:.1f} % / {r['hooked_spread_pct']:.1f} %)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
