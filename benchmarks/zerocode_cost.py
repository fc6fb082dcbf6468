"""What zero-code watching costs the agent per poll: discovery from /proc, one RAS query (client, parse,
judge) and, where NVML gives no PIDs, the /dev/nvidia holder scan.

    python benchmarks/zerocode_cost.py [--ranks 16] [--polls 200]

RAS is a local server replaying NCCL's real reply (tests/fixtures/zerocode/h200x2_nccl2.28.9/ras/A_hung_0.json)
over loopback, so the number is our side's cost; what a query costs NCCL and the job was measured on GPUs
(scripts/device/zero_code_runs.sh: 26,294 back-to-back queries in 8 s, the job's step time unchanged).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from gpuhealth.agent.view import GpuProcess  # noqa: E402
from gpuhealth.agent.zerocode import ras  # noqa: E402
from gpuhealth.agent.zerocode.discovery import discover  # noqa: E402
from gpuhealth.agent.zerocode.gpuprocs import device_holders  # noqa: E402
from gpuhealth.agent.zerocode.hang import HangJudge  # noqa: E402
from gpuhealth.collectors.base import GpuIdentity  # noqa: E402

REPLY = REPO / "tests" / "fixtures" / "zerocode" / "h200x2_nccl2.28.9" / "ras" / "A_hung_0.json"


def serve(reply: bytes) -> int:
    """A minimal RAS server (protocol 2) answering every connection with ``reply``."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def run() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                f = conn.makefile("rb")
                for line in f:
                    cmd = line.strip().lower()
                    if cmd.startswith(b"client protocol"):
                        conn.sendall(b"SERVER PROTOCOL 2\n")
                    elif cmd.startswith((b"set format", b"timeout")):
                        conn.sendall(b"OK\n")
                    elif cmd.endswith(b"status"):
                        conn.sendall(reply)
                        conn.shutdown(socket.SHUT_RDWR)  # RAS closes after its report
                        break
                f.close()

    threading.Thread(target=run, daemon=True).start()
    return int(srv.getsockname()[1])


def ms(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=10)
    return f"{statistics.median(samples) * 1e3:.3f} ms (p90 {q[-1] * 1e3:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=16, help="sleeping processes with a rank's environment")
    ap.add_argument("--polls", type=int, default=200)
    args = ap.parse_args()
    env = {"TORCHELASTIC_RUN_ID": "bench", "WORLD_SIZE": str(args.ranks), "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "PATH": os.environ.get("PATH", "")}
    children = [subprocess.Popen(["sleep", "600"], env={**env, "RANK": str(r), "LOCAL_RANK": str(r % 8)})
                for r in range(args.ranks)]
    try:
        gpus = [GpuProcess(r % 8, f"GPU-{r % 8}", p.pid) for r, p in enumerate(children)]
        disc = []
        for _ in range(args.polls):
            t = time.perf_counter()
            d = discover(gpus)
            disc.append(time.perf_counter() - t)
        assert len(d.jobs()[0].ranks) == args.ranks
        port = serve(REPLY.read_bytes())
        judge = HangJudge(30)
        query, parse = [], []
        for i in range(args.polls):
            t = time.perf_counter()
            reply = ras.query("127.0.0.1", port)
            t1 = time.perf_counter()
            judge.observe(ras.parse(reply), now=float(i))
            parse.append(time.perf_counter() - t1)
            query.append(t1 - t)
        scan = []
        for _ in range(max(5, args.polls // 20)):
            t = time.perf_counter()
            device_holders({0: GpuIdentity(0, "GPU-0", "x", "", 0)})
            scan.append(time.perf_counter() - t)
        nproc = sum(1 for e in os.scandir("/proc") if e.name.isdigit())
        print(json.dumps({
            "discovery_per_poll": ms(disc), "ranks": args.ranks,
            "ras_query_loopback": ms(query), "ras_parse_and_judge": ms(parse), "reply_bytes": REPLY.stat().st_size,
            "dev_nvidia_holder_scan": ms(scan), "processes_on_box": nproc,
        }, indent=1))
    finally:
        for c in children:
            c.kill()
            c.wait()


if __name__ == "__main__":
    main()
