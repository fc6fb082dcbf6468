"""A hung NCCL job on real GPUs, seen through the whole chain: live-NVML agent, its rank socket,
coordinator, inline flight-recorder dumps, triage, and the culprit joined with its GPU's health.

    PYTHONPATH=src python benchmarks/live_hang_e2e.py [--world 2] [--hang-floor 5] [--out FILE]
Starts `gpuhealth coordinator` (hang floor --hang-floor s) and `gpuhealth agent` (live NVML) as
processes, then a WORLD-rank NCCL job (one process per GPU) instrumented with `Tracker`; at step 30
the last rank gets stuck on the host (the others wait in the all_reduce). Reports how long after the
rank got stuck the coordinator stored a hang verdict, whom it named, and with what evidence.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STUCK_AT = 30


def worker(cfg: dict[str, Any]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gpuhealth.instrument import Tracker

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=600), device_id=dev)
    tracker = Tracker(flush_interval_s=0.1)
    a = torch.randn(4096, 4096, device=dev)
    grad = torch.ones(1 << 20, device=dev)
    for step in range(10_000):
        with tracker.step():
            for _ in range(8):
                a = torch.tanh(a @ a)
            if rank == world - 1 and step == STUCK_AT:
                Path(cfg["stuck_file"]).write_text(str(time.time()))
                stuck_on_host(Path(cfg["release"]))
            with tracker.collective():
                dist.all_reduce(grad)
                torch.cuda.synchronize()
        if Path(cfg["release"]).exists():
            break
    tracker.close()


def stuck_on_host(release: Path) -> None:
    while not release.exists():
        time.sleep(0.05)


def _wait_for(cond: Any, procs: list[subprocess.Popen[bytes]], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        dead = [p.args for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"waiting for {what}: " + (f"exited: {dead}" if dead else f"not within {timeout_s:g} s"))
        time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hang-floor", type=float, default=5.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gh-live-hang-"))
    ready = tmp / "coord.ready.json"
    base = [sys.executable, "-m", "gpuhealth.cli.main"]
    procs: list[subprocess.Popen[bytes]] = []
    logs = {n: open(tmp / f"{n}.log", "wb") for n in ("coordinator", "agent")}  # noqa: SIM115
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "world": args.world,
                           "gpus": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()}
    try:
        procs.append(subprocess.Popen([*base, "coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "off",
                                       "--db", str(tmp / "c.db"), "--evidence-dir", str(tmp / "evidence"),
                                       "--hang-floor", str(args.hang_floor), "--ready-file", str(ready)],
                                      stdout=logs["coordinator"], stderr=subprocess.STDOUT))
        _wait_for(ready.exists, procs, "the coordinator to start")
        coord = f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"
        env = {**os.environ, "GPUHEALTH_AGENT_COORDINATOR": coord, "GPUHEALTH_AGENT_STATE_DIR": str(tmp / "agent"),
               "GPUHEALTH_AGENT_SOCKET_PATH": str(tmp / "agent.sock"), "GPUHEALTH_AGENT_NODE_NAME": "gpu-node"}
        procs.append(subprocess.Popen([*base, "agent", "--listen", f"127.0.0.1:{_free_port()}"], env=env,
                                      stdout=logs["agent"], stderr=subprocess.STDOUT))
        _wait_for((tmp / "agent.sock").exists, procs, "the agent's rank socket")
        cfg = {"stuck_file": str(tmp / "stuck"), "release": str(tmp / "release")}
        port = _free_port()
        job = f"live-hang-{int(time.time())}"
        for rank in range(args.world):
            renv = {**env, "RANK": str(rank), "WORLD_SIZE": str(args.world), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GPUHEALTH_JOB_ID": job,
                    "GPUHEALTH_SOCKET": str(tmp / "agent.sock"), "TORCH_FR_BUFFER_SIZE": "2000",
                    "TORCH_NCCL_ENABLE_TIMING": "1"}
            procs.append(subprocess.Popen([sys.executable, __file__, "worker", json.dumps(cfg)], env=renv,
                                          stdout=open(tmp / f"rank{rank}.log", "wb"), stderr=subprocess.STDOUT))  # noqa: SIM115
        from gpuhealth.coordinator.store import Store

        deadline = time.monotonic() + 240
        verdict = None
        while time.monotonic() < deadline and verdict is None:
            time.sleep(0.5)
            if (tmp / "stuck").exists() and (tmp / "c.db").exists():
                store = Store(tmp / "c.db")
                try:
                    verdict = next((v for v in store.verdicts(job) if v["kind"] == "hang"), None)
                finally:
                    store.close()
        if verdict is None:
            doc["error"] = "no hang verdict within 240 s"
        else:
            stuck_at = float((tmp / "stuck").read_text())
            detail = (verdict.get("culprit_details") or [{}])[0]
            doc.update({
                "verdict_after_stuck_s": round(float(verdict.get("created_at", time.time())) - stuck_at, 2),
                "culprits": verdict.get("culprits"), "summary": verdict.get("summary"),
                "culprit_line": detail.get("line"),
                "fr_dumps": sorted((verdict.get("evidence") or {}).get("fr_dumps", {})),
                "stack_source": (detail.get("stack") or {}).get("source"),
                "stalled_s": (verdict.get("hang") or {}).get("stalled_s"),
            })
        (tmp / "release").touch()
    finally:
        (tmp / "release").touch()
        time.sleep(2)
        for p in reversed(procs):
            if p.poll() is None:
                p.kill()
        for f in logs.values():
            f.close()
    print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0 if "error" not in doc else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
