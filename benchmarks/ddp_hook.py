"""DDP on real GPUs with ``Tracker.ddp_comm_hook``: does the step record show a straggler, and what
does the hook cost?

    PYTHONPATH=src python benchmarks/ddp_hook.py [--world 2] [--steps 40] [--out FILE]
Runs, one process per GPU (NCCL, TORCH_NCCL_ENABLE_TIMING=1, CUDA timing):
  straggler/default   rank 1 does 1.5x the compute; DDP's built-in all_reduce (the hook cannot see it)
  straggler/hook      the same with tracker.ddp_comm_hook()
  healthy: DDP's built-in hook, ours, PyTorch's Python allreduce_hook (twice each, alternated):
           median step time, for the hook's overhead
and prints per-rank median compute / collective wait and the straggler detector's verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SLOW_RANK = 1


def worker(cfg: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpuhealth.instrument import Tracker

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=dev)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    width, layers = 4096, 8

    def mlp(n: int) -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                     for _ in range(n)]).to(dev)

    ddp = DDP(mlp(layers), device_ids=[rank])
    extra = mlp(layers // 2) if cfg["straggler"] and rank == SLOW_RANK else None  # +50 % compute
    tracker = Tracker(cfg["out"].replace("{rank}", str(rank)), socket_path="", timing="cuda")
    if cfg["hook"] == "ours":
        ddp.register_comm_hook(ddp.process_group, tracker.ddp_comm_hook())
    elif cfg["hook"] == "torch":  # PyTorch's own Python all_reduce hook: the cost of any Python hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    x = torch.randn(4096, width, device=dev)
    for _ in range(cfg["steps"]):
        with tracker.step():
            if extra is not None:
                extra(x).mean().backward()
            loss = ddp(x).float().pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    torch.cuda.synchronize()
    tracker.close()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, steps: int, *, hook: str, straggler: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"out": f"{tmp}/steps{{rank}}.jsonl", "hook": hook, "straggler": straggler, "steps": steps}
        port = _free_port()
        procs = []
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GPUHEALTH_JOB_ID": "ddp-bench",
                   "TORCH_NCCL_ENABLE_TIMING": "1"}
            procs.append(subprocess.Popen([sys.executable, __file__, "worker", json.dumps(cfg)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        for p in procs:
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(out.decode()[-3000:])
        return [json.loads(line) for r in range(world)
                for line in Path(tmp, f"steps{r}.jsonl").read_text().splitlines()]


def summary(records: list[dict[str, Any]], warm: int = 5) -> dict[str, Any]:
    from gpuhealth.model import StepRecord
    from gpuhealth.stragglers import detect_stragglers

    late = [r for r in records if r["step"] >= warm]
    ranks = sorted({r["rank"] for r in late})

    def med(rank: int, key: str) -> float | None:
        vals = [r[key] for r in late if r["rank"] == rank and r.get(key) is not None]
        return round(statistics.median(vals) * 1e3, 2) if vals else None

    found = detect_stragglers([StepRecord.from_dict(r) for r in records])
    return {"per_rank_ms": {r: {"wall": med(r, "wall_s"), "compute": med(r, "compute_s"),
                                "comm_wait": med(r, "comm_wait_s")} for r in ranks},
            "stragglers": [(f.evidence["rank"], round(float(f.evidence.get("ratio_to_median", 0)), 2)) for f in found],
            "step_ms_median": round(statistics.median(r["wall_s"] for r in late) * 1e3, 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "gpus": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()}
    for name, hook in (("straggler/default", "none"), ("straggler/hook", "ours")):
        doc[name] = summary(run(args.world, args.steps, hook=hook, straggler=True))
        print(name, json.dumps(doc[name]))
    steps: dict[str, list[float]] = {"none": [], "ours": [], "torch": []}
    for hook in ("none", "ours", "torch", "torch", "ours", "none"):
        s = summary(run(args.world, args.steps, hook=hook, straggler=False))
        steps[hook].append(s["step_ms_median"])
        doc.setdefault("healthy", []).append({"hook": hook, **s})
    base = statistics.mean(steps["none"])
    doc["hook_overhead"] = {k: {"step_ms": v, "vs_builtin": round(statistics.mean(v) / base, 4)}
                            for k, v in steps.items()}
    for k, v in steps.items():
        print(f"healthy step ms, {k:5}: {v}  {100 * (statistics.mean(v) / base - 1):+.2f} % vs DDP's built-in")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
