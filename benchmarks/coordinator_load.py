"""Coordinator ingest load on loopback: many simulated agents stream columnar step batches to a
real coordinator (gRPC + SQLite WAL + detection tick) pinned to ONE core.

Reports sustained rank-steps/s with zero loss (every record acknowledged, every record stored
exactly once), and detection latency for an injected straggler (one rank's compute doubled) and an
injected hang (every rank stops progressing).

    .venv/bin/python benchmarks/coordinator_load.py [--agents 64] [--ranks-per-agent 64]
        [--steps-per-message 4] [--seconds 10] [--clients 1]

The coordinator runs in a child process pinned to CPU 0; the simulated agents run in this process
(and ``--clients - 1`` more) on the other CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpuhealth.coordinator.query import list_jobs
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the simulated agent is a test helper
from simagent import SimAgent


def _coordinator(port: int, db: str, ready: str, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    from gpuhealth.config import CoordinatorConfig
    from gpuhealth.coordinator.run import run_coordinator

    cfg = CoordinatorConfig(listen=f"127.0.0.1:{port}", metrics_listen="off", db_path=db, hang_k=10.0,
                            hang_floor_s=2.0, tick_s=0.25, evidence_timeout_s=2.0, heartbeat_interval_s=1.0)
    asyncio.run(run_coordinator(cfg, ready_file=ready))


def _message(seq: int, job: str, ranks: list[int], first_step: int, steps: int, slow_rank: int | None) -> bytes:
    n = len(ranks)
    batch = pb.StepBatch(job_id=job)
    for st in range(first_step, first_step + steps):
        batch.rank.extend(ranks)
        batch.step.extend([st] * n)
        batch.start_time.extend([1.7e9 + st * 0.1] * n)
        batch.wall_s.extend([0.1] * n)
        batch.compute_s.extend([0.12 if r == slow_rank else 0.06 for r in ranks])
    return pb.AgentMessage(record=pb.Record(seq=seq, steps=batch)).SerializeToString()


class _Columns:
    """Per-agent constant columns, so the client spends its core on sending, not on building."""

    def __init__(self, ranks: list[int], steps: int) -> None:
        n = len(ranks)
        self.rank = ranks * steps
        self.offsets = [i // n for i in range(n * steps)]
        self.wall = [0.1] * (n * steps)
        self.normal = [0.06] * (n * steps)
        self.slow = [0.12 if r == ranks[0] else 0.06 for r in self.rank]

    def message(self, seq: int, job: str, first_step: int, slow: bool) -> bytes:
        step = [first_step + o for o in self.offsets]
        batch = pb.StepBatch(job_id=job, rank=self.rank, step=step, start_time=[1.7e9 + first_step * 0.1] * len(step),
                             wall_s=self.wall, compute_s=self.slow if slow else self.normal)
        return pb.AgentMessage(record=pb.Record(seq=seq, steps=batch)).SerializeToString()


async def _client(args: argparse.Namespace, address: str, first_agent: int, n_agents: int, stop_at: float,
                  straggle_at: float | None, hang_job_stop: float | None) -> dict[str, Any]:
    world = args.agents * args.ranks_per_agent
    agents = []
    for a in range(first_agent, first_agent + n_agents):
        agent = SimAgent(address, f"sim{a:05d}", incarnation=f"bench-{os.getpid()}-{a}")
        await agent.register()
        await agent.connect()
        agents.append(agent)
    window = args.window
    seqs = [0] * n_agents
    counts = [0] * n_agents
    columns = [_Columns(list(range(a * args.ranks_per_agent, (a + 1) * args.ranks_per_agent)), args.steps_per_message)
               for a in range(first_agent, first_agent + n_agents)]

    async def send_one(idx: int, agent: SimAgent, step: int, now: float) -> None:
        a = first_agent + idx
        if seqs[idx] - agent.acked >= window:
            await agent.wait_acked(seqs[idx] - window // 2, 30)
        seqs[idx] += 1
        slow = a == 0 and straggle_at is not None and now >= straggle_at  # rank 0 straggles
        await agent.send(columns[idx].message(seqs[idx], "bench", step, slow))
        counts[idx] += args.ranks_per_agent * args.steps_per_message
        # A second, small job on agent 0 that stops progressing at hang_job_stop.
        if a == 0 and (hang_job_stop is None or now < hang_job_stop) and seqs[idx] % 4 == 0:
            seqs[idx] += 1
            await agent.send(_message(seqs[idx], "bench-hang", [0, 1, 2, 3], step, 1, None))
            counts[idx] += 4

    # Lockstep rounds, like a synchronous job: every agent sends step s before any sends s+1's batch.
    step = 0
    while time.monotonic() < stop_at:
        now = time.monotonic()
        await asyncio.gather(*(send_one(i, ag, step, now) for i, ag in enumerate(agents)))
        step += args.steps_per_message
    await asyncio.gather(*(ag.wait_acked(seqs[i], 120) for i, ag in enumerate(agents)))
    results = counts
    sent = sum(results)
    for ag in agents:
        await ag.close()
    return {"sent": sent, "world": world}


def _client_proc(args: argparse.Namespace, address: str, first: int, n: int, stop_at_wall: float,
                 out: Any, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    stop_at = time.monotonic() + (stop_at_wall - time.time())
    out.put(asyncio.run(_client(args, address, first, n, stop_at, None, None)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--ranks-per-agent", type=int, default=64)
    p.add_argument("--steps-per-message", type=int, default=4)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=1, help="client processes (agents are split among them)")
    p.add_argument("--window", type=int, default=8, help="unacknowledged messages per agent (like max_inflight)")
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    coord_cpu, client_cpus = cpus[0], cpus[1:] or cpus
    tmp = Path(tempfile.mkdtemp(prefix="gh-bench-"))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = tmp / "ready.json"
    ctx = mp.get_context("spawn")
    coord = ctx.Process(target=_coordinator, args=(port, str(tmp / "coord.db"), str(ready), coord_cpu), daemon=True)
    coord.start()
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    address = f"127.0.0.1:{port}"
    import psutil

    cproc = psutil.Process(coord.pid)
    start_wall = time.time()
    stop_wall = start_wall + args.seconds
    queue: Any = ctx.Queue()
    per = args.agents // args.clients
    others = [ctx.Process(target=_client_proc, args=(args, address, (i + 1) * per, per, stop_wall, queue,
                                                     client_cpus[(i + 1) % len(client_cpus)]))
              for i in range(args.clients - 1)]
    for o in others:
        o.start()
    os.sched_setaffinity(0, {client_cpus[0]})
    cpu0 = cproc.cpu_times()
    t0 = time.monotonic()
    straggle_at = t0 + args.seconds * 0.4
    hang_stop = t0 + args.seconds * 0.3
    detect: dict[str, float | None] = {"straggler": None, "hang": None, "hang_stall": None}

    async def watch() -> None:
        while time.monotonic() < t0 + args.seconds + 15 and (detect["straggler"] is None or detect["hang"] is None):
            doc = await asyncio.to_thread(list_jobs, address, "", timeout_s=10)
            now = time.monotonic()
            for j in doc["jobs"]:
                if j["job_id"] == "bench" and j["stragglers"] and detect["straggler"] is None:
                    detect["straggler"] = now - straggle_at
                if j["job_id"] == "bench-hang" and j["hangs"] and detect["hang"] is None:
                    detect["hang"] = now - hang_stop
                    # What the coordinator saw: seconds between the job's last progress and this answer.
                    detect["hang_stall"] = j["seconds_since_progress"]
            await asyncio.sleep(0.1)

    async def both() -> dict[str, Any]:
        w = asyncio.create_task(watch())
        res = await _client(args, address, 0, per + args.agents - per * args.clients,
                            t0 + args.seconds, straggle_at, hang_stop)
        await w
        return res

    res = asyncio.run(both())
    elapsed = time.monotonic() - t0
    sent = res["sent"]
    for o in others:
        sent += queue.get(timeout=120)["sent"]
        o.join(30)
    cpu1 = cproc.cpu_times()
    coord_cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    doc = list_jobs(address, "bench")
    stored = doc["jobs"][0]["records"]
    import sqlite3

    with sqlite3.connect(tmp / "coord.db") as con:
        (in_db,) = con.execute("SELECT SUM(n) FROM step_batches").fetchone()
    coord.terminate()
    coord.join(10)
    result = {
        "date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpu": platform.processor() or platform.machine(),
        "python": sys.version.split()[0], "agents": args.agents, "ranks": args.agents * args.ranks_per_agent,
        "records_per_message": args.ranks_per_agent * args.steps_per_message, "seconds": round(elapsed, 2),
        "records_sent": sent, "records_stored": int(in_db or 0), "bench_job_records_in_memory": stored,
        "lost": sent - int(in_db or 0), "rank_steps_per_s": round(sent / elapsed),
        "coordinator_cpu_s": round(coord_cpu_s, 2), "coordinator_cores_used": round(coord_cpu_s / elapsed, 2),
        "straggler_detect_s": None if detect["straggler"] is None else round(detect["straggler"], 2),
        "hang_detect_s": None if detect["hang"] is None else round(detect["hang"], 2),
        "hang_stalled_when_seen_s": detect["hang_stall"],
        "hang_threshold_s": 2.0,
        "window_messages_per_agent": args.window,
    }
    print(json.dumps(result, indent=2))
    return 0 if result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
