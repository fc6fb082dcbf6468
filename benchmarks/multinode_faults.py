"""Random network faults on the cluster in one box (``tests/cluster.py``), judged passively by the coordinator.

One long Gloo job runs across every node (``--ranks-per-node`` ranks each, the Tracker on every rank, a real
``gpuhealth agent`` per node and one ``gpuhealth coordinator``). Each fault shapes one node's link with ``tc``:

- ``node``: all of the node's traffic, both directions;
- ``direction``: one direction of the node's link (``out`` or ``in``);
- ``pair``: one direction between the node and one peer;

at a severity of 1/2 to 1/20 of the link rate (drawn log-uniform). The script waits up to ``--deadline`` s for a
new ``comm_slow`` verdict (``gpuhealth jobs --json``), removes the fault, waits for the episode to close and then
watches a healthy gap for false alarms. It reports, per fault and in total:

- detection recall: faults that got a verdict in time;
- localisation: the verdict names exactly the faulty node (for a pair: one of its two ends), names a candidate
  set that holds it (not separated: a probe is advised), or names a wrong node;
- precision of named nodes: verdicts naming nodes that name a faulty one;
- time to name (fault applied -> verdict seen by ``gpuhealth jobs``), and false alarms in the healthy gaps.

    sudo .venv/bin/python benchmarks/multinode_faults.py --nodes 8 --faults 20 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the cluster is a test helper

from cluster import Cluster, available


def _rate_mbit(rate: str) -> float:
    units = {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: use kbit, mbit or gbit")


def _new_verdicts(c: Cluster, job_id: str, seen: set[int], kind: str = "comm_slow") -> list[dict[str, Any]]:
    out = []
    for v in c.verdicts(job_id):
        if v["id"] not in seen:
            seen.add(v["id"])
            if v["kind"] == kind:
                out.append(v)
    return out


def _steps_per_s(c: Cluster, job_id: str, seconds: float) -> float:
    a = (c.job_doc(job_id) or {}).get("last_step") or 0
    time.sleep(seconds)
    b = (c.job_doc(job_id) or {}).get("last_step") or 0
    return (b - a) / seconds


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    base = _rate_mbit(args.rate)
    faults: list[dict[str, Any]] = []
    false_alarms: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="multinode-faults-"))
    started = time.time()
    with Cluster(work, nodes=args.nodes, link_rate=args.rate) as c:
        job = c.start_job("bench", ranks_per_node=args.ranks_per_node, compute_s=args.compute_s, numel=args.numel,
                          max_s=86_400, timeout_s=600)
        seen: set[int] = set()
        deadline = time.monotonic() + 180
        while ((c.job_doc("bench") or {}).get("last_step") or 0) < 40:
            if time.monotonic() > deadline:
                raise SystemExit(f"the job did not start:\n{job.logs()}")
            time.sleep(1)
        healthy_rate = _steps_per_s(c, "bench", 10)
        print(f"{args.nodes} nodes x {args.ranks_per_node} ranks: {healthy_rate:.2f} steps/s healthy", flush=True)
        false_alarms += [{"phase": "warm-up", "summary": v["summary"]} for v in _new_verdicts(c, "bench", seen)]
        for i in range(args.faults):
            kind = rng.choice(["node", "direction", "pair"])
            node = rng.randrange(args.nodes)
            direction = "both" if kind == "node" else rng.choice(["out", "in"])
            peer = rng.choice([p for p in range(args.nodes) if p != node]) if kind == "pair" else None
            factor = math.exp(rng.uniform(math.log(2), math.log(20)))
            rate = f"{base / factor:.3f}mbit"
            c.shape(node, rate=rate, direction=direction, peer=peer)
            t0 = time.monotonic()
            got: dict[str, Any] | None = None
            while time.monotonic() - t0 < args.deadline and got is None:
                found = _new_verdicts(c, "bench", seen)
                got = found[0] if found else None
                if got is None:
                    time.sleep(1.0)
            took = time.monotonic() - t0 if got is not None else None
            slow_rate = _steps_per_s(c, "bench", 5) if got is None else None
            c.unshape(node)
            truth = {f"node{node}"} | ({f"node{peer}"} if peer is not None else set())
            named = set(got["nodes"]) if got else set()
            cands = set(got["candidates"]) if got else set()
            if got is None:
                outcome = "missed"
            elif named and named <= truth:
                outcome = "named"
            elif named:
                outcome = "wrong"
            elif truth & cands:
                outcome = "candidates"
            else:
                outcome = "wrong"
            row = {"fault": i, "kind": kind, "node": f"node{node}", "direction": direction,
                   "peer": f"node{peer}" if peer is not None else None, "severity": round(1 / factor, 4),
                   "rate": rate, "outcome": outcome, "time_to_name_s": round(took, 1) if took else None,
                   "named": sorted(named), "candidates": len(cands), "basis": got["basis"] if got else None,
                   "ratio": got["ratio"] if got else None, "steps_per_s_while_faulty": slow_rate}
            faults.append(row)
            print(json.dumps(row), flush=True)
            # Recovery: the episode closes once the wait is back near its pace; then a healthy gap.
            t1 = time.monotonic()
            while time.monotonic() - t1 < 60 and (c.job_doc("bench") or {}).get("comm_slow") is not None:
                time.sleep(1.0)
            _new_verdicts(c, "bench", seen)  # verdicts of this fault that came late are not false alarms
            time.sleep(args.gap)
            false_alarms += [{"phase": f"after fault {i}", "summary": v["summary"]}
                             for v in _new_verdicts(c, "bench", seen)]
        job.kill()
    detected = [f for f in faults if f["outcome"] != "missed"]
    naming = [f for f in detected if f["named"]]
    times = [f["time_to_name_s"] for f in detected]
    by_sev: dict[str, list[int]] = {}
    for f in faults:
        band = "1/2-1/5" if f["severity"] > 0.2 else ("1/5-1/10" if f["severity"] > 0.1 else "1/10-1/20")
        by_sev.setdefault(band, []).append(f["outcome"] != "missed")
    return {
        "machine": args.machine, "date": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "command": " ".join(["benchmarks/multinode_faults.py", *sys.argv[1:]]), "python": platform.python_version(),
        "cpus": os.cpu_count(), "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "link_rate": args.rate,
        "healthy_steps_per_s": round(healthy_rate, 2), "faults": faults,
        "detection_recall": round(len(detected) / len(faults), 3) if faults else None,
        "detection_recall_by_severity": {k: f"{sum(v)}/{len(v)}" for k, v in sorted(by_sev.items())},
        "named_exactly": sum(f["outcome"] == "named" for f in faults),
        "candidates_only": sum(f["outcome"] == "candidates" for f in faults),
        "named_wrong": sum(f["outcome"] == "wrong" for f in faults),
        "naming_precision": round(sum(f["outcome"] == "named" for f in naming) / len(naming), 3) if naming else None,
        "time_to_verdict_s": {"median": statistics.median(times), "max": max(times)} if times else None,
        "false_alarms": false_alarms, "healthy_gap_s_total": args.gap * len(faults),
        "wall_s": round(time.time() - started, 1),
    }


def capacity(args: argparse.Namespace) -> dict[str, Any]:
    """How many nodes x ranks this machine sustains: per shape, the time to start the cluster and the job, and the
    healthy job's steps per second (a cluster too big for the machine does not start in time, or crawls)."""
    rows = []
    for shape in args.capacity.split(","):
        nodes, rpn = (int(x) for x in shape.split("x"))
        work = Path(tempfile.mkdtemp(prefix="multinode-capacity-"))
        t0 = time.monotonic()
        row: dict[str, Any] = {"nodes": nodes, "ranks_per_node": rpn}
        try:
            with Cluster(work, nodes=nodes, link_rate=args.rate) as c:
                row["cluster_up_s"] = round(time.monotonic() - t0, 1)
                job = c.start_job("cap", ranks_per_node=rpn, compute_s=args.compute_s, numel=args.numel,
                                  max_s=600, timeout_s=300)
                deadline = time.monotonic() + 240
                while ((c.job_doc("cap") or {}).get("last_step") or 0) < 40 and time.monotonic() < deadline:
                    time.sleep(1)
                row["job_first_40_steps_s"] = round(time.monotonic() - t0 - row["cluster_up_s"], 1)
                row["steps_per_s"] = round(_steps_per_s(c, "cap", 15), 2)
                job.kill()
        except (AssertionError, RuntimeError) as exc:
            row["error"] = str(exc)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"machine": args.machine, "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpus": os.cpu_count(),
            "command": " ".join(["benchmarks/multinode_faults.py", *sys.argv[1:]]), "capacity": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--seed", type=int, default=31)
    ap.add_argument("--rate", default="400mbit", help="every link's rate (tc HTB)")
    ap.add_argument("--compute-s", type=float, default=0.05)
    ap.add_argument("--numel", type=int, default=256 * 1024, help="floats all-reduced per step")
    ap.add_argument("--deadline", type=float, default=60.0, help="seconds a fault has to be named")
    ap.add_argument("--gap", type=float, default=10.0, help="healthy seconds watched after each fault")
    ap.add_argument("--machine", default="2-core CPU box, no GPU")
    ap.add_argument("--capacity", help="instead of faults: NODESxRANKS shapes to start and time, e.g. 8x1,16x1,8x2")
    ap.add_argument("--json", help="write the report here too")
    args = ap.parse_args()
    why = available()
    if why is not None:
        print(f"multinode_faults: the cluster in one box {why}", file=sys.stderr)
        return 3
    report = capacity(args) if args.capacity else run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
