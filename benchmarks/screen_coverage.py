"""What fleet screening costs the coordinator (issue 18) at 10,000 GPUs on 1,250 nodes: the coverage
computation (done for every /metrics refresh, once a second, on the event loop), the whole /metrics
snapshot, the fleet view's screening part, a rotation plan over every connected node, ingesting one
node's screens record, and loading it all back after a restart.

    python benchmarks/screen_coverage.py [--nodes 1250] [--gpus-per-node 8] [--reps 50]

A real ``Coordinator`` on a real SQLite file (no network: records go straight into ``handle_record``,
as the gRPC edge hands them over). The fleet: 90 % of GPUs screened within the last 24 h, 5 % two days
ago, 5 % never screened, plus an aborted attempt on every 20th GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from gpuhealth.config import CoordinatorConfig  # noqa: E402
from gpuhealth.coordinator.screening import coverage  # noqa: E402
from gpuhealth.coordinator.service import Coordinator  # noqa: E402
from gpuhealth.coordinator.store import Store  # noqa: E402
from gpuhealth.proto import gpuhealth_v1_pb2 as pb  # noqa: E402

KEY = "NVIDIA H100 80GB HBM3/132sm/cuda12.8/cublas/gemm-4096-bf16"


def timed(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    """Median and p90 wall milliseconds of ``fn`` over ``reps`` calls (after one warm-up)."""
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000.0)
    samples.sort()
    p90 = samples[int(0.9 * (len(samples) - 1))]
    return {"median_ms": round(statistics.median(samples), 3), "p90_ms": round(p90, 3)}


def build(db: Path, nodes: int, gpus: int, now: float) -> tuple[Coordinator, float]:
    coord = Coordinator(Store(db), CoordinatorConfig(), clock=lambda: now)
    rng = random.Random(18)
    for n in range(nodes):
        name = f"gpu-{n:04d}"
        coord.register(pb.RegisterRequest(node_name=name, incarnation="b", gpus=[
            pb.GpuInfo(index=i, uuid=f"GPU-{n:04d}-{i}", name="NVIDIA H100 80GB HBM3") for i in range(gpus)]))
        coord.stream_opened(coord.by_node[name])
    ingest = []
    for n in range(nodes):
        name = f"gpu-{n:04d}"
        session = coord.by_node[name]
        screens = []
        for i in range(gpus):
            k = n * gpus + i
            draw = rng.random()
            if draw < 0.05:
                continue  # never screened
            finished = now - (2 * 86_400 if draw < 0.10 else rng.uniform(60, 86_000))
            screens.append(pb.ScreenResult(
                gpu_uuid=f"GPU-{n:04d}-{i}", gpu_index=i, started_at=finished - 40, finished_at=finished,
                level="quick", result="pass", trigger="schedule",
                digests=[pb.SdcDigest(key=f"{KEY}/case{c}", digest="ab" * 16) for c in range(4)]))
            if k % 20 == 0:
                screens.append(pb.ScreenResult(gpu_uuid=f"GPU-{n:04d}-{i}", gpu_index=i, started_at=now - 30,
                                               finished_at=now - 20, level="periodic", result="aborted",
                                               reason="a compute process appeared on the GPU"))
        if not screens:
            continue
        rec = pb.Record(seq=1, screens=pb.ScreenResults(screens=screens))
        raw = pb.AgentMessage(record=rec).SerializeToString()
        t0 = time.perf_counter()
        coord.handle_record(session, raw, rec)
        ingest.append((time.perf_counter() - t0) * 1000.0)
    return coord, statistics.median(ingest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1250)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    now = 1_800_000_000.0
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "coordinator.db"
        t0 = time.perf_counter()
        coord, ingest_ms = build(db, args.nodes, args.gpus_per_node, now)
        build_s = time.perf_counter() - t0
        gpus = coord._counted_gpus(now)
        cov = coverage(gpus, coord.book, now, 86_400.0)
        out: dict[str, Any] = {
            "nodes": args.nodes, "gpus": cov.gpus, "coverage_ratio": round(cov.ratio, 4),
            "unscreened": cov.unscreened, "oldest_age_s": cov.oldest_age_s,
            "coverage_only": timed(lambda: coverage(gpus, coord.book, now, 86_400.0), args.reps),
            "coverage_with_gpu_list": timed(lambda: coverage(coord._counted_gpus(now), coord.book, now, 86_400.0),
                                            args.reps),
            "metrics_snapshot": timed(coord.metrics_snapshot, args.reps),
            "screening_doc": timed(coord.screening_doc, max(5, args.reps // 5)),
            "rotation_plan": timed(coord.rotate, args.reps),
            "turns_held": len(coord.rotation.active),
            "ingest_one_node_record_ms": round(ingest_ms, 3),
            "build_s": round(build_s, 1),
        }
        coord.store.close()
        t0 = time.perf_counter()
        again = Coordinator(Store(db), CoordinatorConfig(), clock=lambda: now)
        out["restart_load_s"] = round(time.perf_counter() - t0, 3)
        assert coverage(again._counted_gpus(now), again.book, now, 86_400.0) == cov
        again.store.close()
    out["python"] = platform.python_version()
    out["machine"] = platform.machine()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
