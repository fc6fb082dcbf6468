"""Collective bus bandwidth across the node's GPUs, measured like nccl-tests, data checked.

One process per GPU (NCCL) or per CPU rank (Gloo, for CI). Sizes follow nccl-tests' convention
(``size`` is the all-gather's total output, the reduce-scatter's total input, …), float32, sum.
On CUDA each small (collective, size) — up to ``graph_max_bytes`` — is captured in a CUDA graph of
``iters`` calls and replayed, so a 1 MiB collective is not dominated by host launch cost; larger
sizes are timed as an eager loop, as nccl-tests does (launch cost is noise there). If capture
fails the eager loop is timed and the point says so. Before the clock starts, the ranks' streams
are aligned by a one-element all_reduce and a short device-side sleep (host launch skew between
the processes would otherwise count as collective time). After timing, the collective runs once
more on fresh, rank-dependent inputs and every element of the output is checked on the device
(only a mismatch count leaves it).

    algbw = size / time;  busbw = algbw × factor
    factor: all_reduce 2(n−1)/n; all_gather, reduce_scatter, all_to_all (n−1)/n; broadcast, sendrecv 1

Judging is pure (``judge``): at sizes ≥ ``judge_min_bytes`` each point is compared with a reference
curve for the topology (``REFERENCE_CURVES``; a YAML file in config may replace them).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpuhealth.diag.launch import LaunchError, run_local_ranks
from gpuhealth.model import Action, Entity, Finding, Severity

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv")
MiB = 1 << 20
GiB = 1 << 30
SOURCE = "diag.busbw"

# busbw in GB/s by size in bytes, keyed "<topology>@<ranks>" (a curve for one world size) or "<topology>"
# (any world size; user files may use it). nccl-tests 2.19.6, `-w 5 -n 20`, out-of-place, NVLink
# through NVSwitch, multicast off:
#   nvlink@2: 2 × H200 (docs/measurements.md);
#   nvlink@4: 4 × H200 (benchmarks/results/nccl_tests_4xh200_2026-11-26.json).
# busbw is NOT independent of the rank count below ~1 GiB: at 64 MiB sendrecv reads 268 GB/s on 2 ranks
# and 156 on 4 (a ring: every GPU sends and receives at once), all_reduce 268 vs 310. At 2 GiB the
# curves meet (339–363 GB/s), and the published 8 × H100/H200 all_reduce without SHARP (≈ 360–370)
# sits on the same plateau. So a world size without its own curve is judged against the nearest
# measured one at ≥ PLATEAU_BYTES only.
REFERENCE_CURVES: dict[str, dict[str, dict[int, float]]] = {
    "nvlink@2": {
        "all_reduce": {MiB: 70, 64 * MiB: 270, 2 * GiB: 340},
        "all_gather": {MiB: 38, 64 * MiB: 215, 2 * GiB: 278},
        "reduce_scatter": {MiB: 37, 64 * MiB: 210, 2 * GiB: 277},
        "all_to_all": {MiB: 36, 64 * MiB: 245, 2 * GiB: 336},
        "broadcast": {MiB: 73, 64 * MiB: 329, 2 * GiB: 367},
        "sendrecv": {MiB: 65, 64 * MiB: 268, 2 * GiB: 364},
    },
    "nvlink@4": {
        "all_reduce": {MiB: 39, 64 * MiB: 310, 2 * GiB: 359},
        "all_gather": {MiB: 19, 64 * MiB: 264, 2 * GiB: 333},
        "reduce_scatter": {MiB: 19, 64 * MiB: 267, 2 * GiB: 336},
        "all_to_all": {MiB: 21, 64 * MiB: 267, 2 * GiB: 348},
        "broadcast": {MiB: 24, 64 * MiB: 316, 2 * GiB: 362},
        "sendrecv": {MiB: 26, 64 * MiB: 156, 2 * GiB: 363},
    },
}
PLATEAU_BYTES = GiB


def reference_curve(curves: Mapping[str, Mapping[str, Mapping[int, float]]], topology: str, world: int,
                    collective: str) -> tuple[Mapping[int, float], str, int] | None:
    """(curve, which curve, smallest size it may judge) for this topology, rank count and collective:
    the curve for exactly this many ranks, else a rank-count-free one, else the nearest measured rank
    count's curve from PLATEAU_BYTES up; None when the topology has no curve for the collective."""
    exact = curves.get(f"{topology}@{world}", {}).get(collective)
    if exact:
        return exact, f"{topology}@{world}", 0
    generic = curves.get(topology, {}).get(collective)
    if generic:
        return generic, topology, 0
    measured = []
    for key, colls in curves.items():
        name, _, n = key.partition("@")
        if name == topology and n.isdigit() and collective in colls:
            measured.append((abs(int(n) - world), -int(n), key))
    if not measured:
        return None
    key = min(measured)[2]
    return curves[key][collective], f"{key} (nearest rank count; plateau only)", PLATEAU_BYTES


def bus_factor(collective: str, world: int) -> float:
    if collective == "all_reduce":
        return 2.0 * (world - 1) / world
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) / world
    if collective in ("broadcast", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError("need 0 < min_bytes <= max_bytes and factor >= 2")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


@dataclass(frozen=True, slots=True)
class Point:
    collective: str
    size_bytes: int
    world: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    errors: int  # elements that differed from the expected result
    graph: bool  # timed through CUDA-graph replay

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Point:
        return cls(str(d["collective"]), int(d["size_bytes"]), int(d["world"]), float(d["time_us"]),
                   float(d["algbw_gbps"]), float(d["busbw_gbps"]), int(d["errors"]), bool(d["graph"]))


def make_point(collective: str, size_bytes: int, world: int, seconds: float, errors: int, graph: bool) -> Point:
    algbw = size_bytes / seconds / 1e9
    return Point(collective, size_bytes, world, seconds * 1e6, algbw, algbw * bus_factor(collective, world),
                 errors, graph)


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def reference_at(curve: Mapping[int, float], size: int) -> float:
    """Interpolate a reference curve linearly in log(size); flat beyond its ends."""
    pts = sorted(curve.items())
    if size <= pts[0][0]:
        return pts[0][1]
    if size >= pts[-1][0]:
        return pts[-1][1]
    for (s0, v0), (s1, v1) in itertools.pairwise(pts):
        if s0 <= size <= s1:
            w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return v0 + w * (v1 - v0)
    return pts[-1][1]


def judge(
    points: Sequence[Point],
    *,
    topology: str,
    node: str,
    curves: Mapping[str, Mapping[str, Mapping[int, float]]] = REFERENCE_CURVES,
    min_fraction: float = 0.8,
    judge_min_bytes: int = 64 * MiB,
) -> tuple[list[Finding], dict[str, Any]]:
    """Findings for wrong data (any size) and for busbw under ``min_fraction`` of the reference at
    large sizes; the summary says what was judged against what."""
    findings: list[Finding] = []
    summary: dict[str, Any] = {"topology": topology, "min_fraction": min_fraction, "judged": [], "unjudged": []}
    for p in points:
        if p.errors:
            findings.append(Finding(
                code="busbw.data_corrupt", severity=Severity.CRITICAL, entity=Entity.node(node),
                message=f"{p.collective} of {p.size_bytes} bytes across {p.world} ranks returned "
                        f"{p.errors} wrong elements",
                action=Action.DRAIN, evidence=p.to_dict(), source=SOURCE))
    large = [p for p in points if p.size_bytes >= judge_min_bytes]
    for coll, world in sorted({(p.collective, p.world) for p in large}):
        found = reference_curve(curves, topology, world, coll)
        judged_here = [q for q in large if q.collective == coll and q.world == world
                       and found is not None and q.size_bytes >= found[2]]
        if found is None or not judged_here:
            summary["unjudged"].append(coll)
            why = (f"no {topology} reference curve for {coll}" if found is None else
                   f"{coll} across {world} ranks has no reference curve of its own; the nearest ({found[1]}) "
                   f"only holds from {human_bytes(found[2])}, and no size that large was measured")
            findings.append(Finding(
                code="busbw.unjudged", severity=Severity.INFO, entity=Entity.node(node),
                message=f"{coll} bandwidth not judged: {why}", action=Action.NONE,
                evidence={"collective": coll, "world": world, "topology": topology}, source=SOURCE))
            continue
        curve, curve_name, _ = found
        for p in judged_here:
            ref = reference_at(curve, p.size_bytes)
            ratio = p.busbw_gbps / ref
            summary["judged"].append({"collective": coll, "size_bytes": p.size_bytes, "busbw_gbps": round(
                p.busbw_gbps, 1), "reference_gbps": round(ref, 1), "ratio": round(ratio, 3),
                "reference": curve_name})
            if ratio >= min_fraction:
                continue
            critical = ratio < min_fraction / 2
            findings.append(Finding(
                code="busbw.low", severity=Severity.CRITICAL if critical else Severity.WARNING,
                entity=Entity.node(node),
                message=f"{coll} busbw {p.busbw_gbps:.1f} GB/s at {human_bytes(p.size_bytes)} across {p.world} "
                        f"ranks is {ratio:.0%} of the {curve_name} reference {ref:.0f} GB/s",
                action=Action.DRAIN if critical else Action.MONITOR,
                evidence={**p.to_dict(), "reference_gbps": ref, "ratio": ratio, "topology": topology,
                          "reference": curve_name},
                source=SOURCE))
    return findings, summary


def load_curves(path: str | Path) -> dict[str, dict[str, dict[int, float]]]:
    """A YAML file ``{topology: {collective: {size_bytes: busbw_GBps}}}`` (replaces the defaults); a
    topology key may name a rank count, ``nvlink@8``, for a curve measured at exactly that many ranks."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"{p}: cannot read busbw thresholds: {exc}") from exc
    try:
        return {str(t): {str(c): {int(s): float(v) for s, v in curve.items()} for c, curve in colls.items()}
                for t, colls in data.items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"{p}: expected {{topology: {{collective: {{size_bytes: GB/s}}}}}}: {exc}") from exc


# ---------------------------------------------------------------- the measuring side (torch, per rank)


def _pattern(torch: Any, rank: int, count: int, offset: int, device: Any) -> Any:
    """Small integers (exact in float32 sums) that differ by rank and position."""
    idx = torch.arange(offset, offset + count, device=device, dtype=torch.int64)
    return ((idx * 7 + rank * 13) % 251 + 1).to(torch.float32)


class _Bench:
    """Buffers, the op, and its expected result for one (collective, size) on one rank."""

    def __init__(self, torch: Any, dist: Any, collective: str, size: int, rank: int, world: int,
                 device: Any) -> None:
        self.torch, self.dist, self.collective = torch, dist, collective
        self.rank, self.world, self.device = rank, world, device
        unit = 4 * world
        self.size = max(unit, size // unit * unit)
        self.count = self.size // 4  # elements in the nccl-tests "size"
        c, n = self.count, world
        if collective == "all_reduce" or collective == "broadcast":
            self.inp, self.out = self._fill(c, 0), None
        elif collective == "all_gather":
            self.inp, self.out = self._fill(c // n, 0), torch.empty(c, device=device)
        elif collective == "reduce_scatter":
            self.inp, self.out = self._fill(c, 0), torch.empty(c // n, device=device)
        elif collective in ("all_to_all", "sendrecv"):
            self.inp, self.out = self._fill(c, 0), torch.empty(c, device=device)
        else:
            raise ValueError(f"unknown collective {collective!r}")

    def _fill(self, count: int, offset: int, rank: int | None = None) -> Any:
        return _pattern(self.torch, self.rank if rank is None else rank, count, offset, self.device)

    def op(self) -> None:
        """One blocking-form collective (the current stream waits for NCCL's). Measured on 2 × H200:
        queuing async_op=True calls inside a CUDA graph instead ran 2–15× slower."""
        d, t = self.dist, self.collective
        if t == "all_reduce":
            d.all_reduce(self.inp)
        elif t == "broadcast":
            d.broadcast(self.inp, src=0)
        elif t == "all_gather":
            d.all_gather_into_tensor(self.out, self.inp)
        elif t == "reduce_scatter":
            d.reduce_scatter_tensor(self.out, self.inp)
        elif t == "all_to_all":
            d.all_to_all_single(self.out, self.inp)
        else:
            nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
            ops = [d.P2POp(d.isend, self.inp, nxt), d.P2POp(d.irecv, self.out, prv)]
            for req in d.batch_isend_irecv(ops):
                req.wait()

    def run(self, iters: int) -> None:
        for _ in range(iters):
            self.op()

    def reset(self) -> None:
        self.inp.copy_(self._fill(self.inp.numel(), 0))

    def errors(self) -> int:
        """Elements of the output that differ from what the collective must produce."""
        torch, n, c = self.torch, self.world, self.count
        t = self.collective
        if t == "all_reduce":
            expected = sum(self._fill(c, 0, r) for r in range(n))
            got = self.inp
        elif t == "broadcast":
            expected, got = self._fill(c, 0, 0), self.inp
        elif t == "all_gather":
            expected = torch.cat([self._fill(c // n, 0, r) for r in range(n)])
            got = self.out
        elif t == "reduce_scatter":
            per = c // n
            expected = sum(self._fill(per, self.rank * per, r) for r in range(n))
            got = self.out
        elif t == "all_to_all":
            per = c // n
            expected = torch.cat([self._fill(per, self.rank * per, r) for r in range(n)])
            got = self.out
        else:
            expected, got = self._fill(c, 0, (self.rank - 1) % n), self.out
        return int((got != expected).sum().item())


# Device-side pause after the aligning all_reduce, so every rank's host has queued the timed work
# before its GPU reaches the start event (~200 µs at H100/H200 clocks).
_ALIGN_SLEEP_CYCLES = 400_000


def _align_streams(torch: Any, dist: Any, device: Any) -> None:
    """Make the ranks' GPUs leave this point together: a tiny all_reduce completes on every rank at
    about the same moment, then each GPU idles briefly while its host queues the timed work."""
    dist.all_reduce(torch.zeros(1, device=device))
    torch.cuda._sleep(_ALIGN_SLEEP_CYCLES)


def _time_eager(torch: Any, dist: Any, bench: _Bench, iters: int, cuda: bool) -> float:
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _align_streams(torch, dist, bench.device)
        start.record()
        bench.run(iters)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3 / iters
    dist.barrier()
    t0 = time.perf_counter()
    bench.run(iters)
    return (time.perf_counter() - t0) / iters


def _time_graph(torch: Any, dist: Any, bench: _Bench, iters: int, replays: int) -> float:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bench.run(1)  # warm the communicator on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        bench.run(iters)
    graph.replay()  # warm-up replay
    torch.cuda.synchronize()
    # The replay count must be the same on every rank (a rank-local choice deadlocks the group).
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _align_streams(torch, dist, bench.device)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / (iters * replays)


@dataclass(frozen=True, slots=True)
class RankPlan:
    collectives: tuple[str, ...]
    sizes: tuple[int, ...]
    warmup: int = 5
    iters: int = 20
    replays: int = 3
    use_graphs: bool = True
    graph_max_bytes: int = 16 << 20  # larger sizes are timed eagerly (see the module docstring)


def measure_rank(torch: Any, dist: Any, plan: RankPlan, rank: int, world: int, device: Any,
                 progress: Callable[[str], None] | None = None) -> list[Point]:
    """Run the plan on this rank (process group already initialised). Every rank gets the same
    points: times are averaged across ranks and error counts summed, as nccl-tests reports them."""
    cuda = device.type == "cuda"
    points: list[Point] = []
    for coll in plan.collectives:
        for size in plan.sizes:
            bench = _Bench(torch, dist, coll, size, rank, world, device)
            bench.run(plan.warmup)
            graph = False
            seconds = None
            if cuda and plan.use_graphs and bench.size <= plan.graph_max_bytes:
                try:
                    seconds = _time_graph(torch, dist, bench, plan.iters, plan.replays)
                    graph = True
                except Exception as exc:  # capture unsupported for this op/build: fall back, say so
                    if progress:
                        progress(f"graph capture failed for {coll}: {exc}; timing eagerly")
                    torch.cuda.synchronize()
            if seconds is None:
                seconds = _time_eager(torch, dist, bench, plan.iters, cuda)
            bench.reset()
            bench.run(1)
            errors = bench.errors()
            stats = torch.tensor([seconds, float(errors)], dtype=torch.float64, device=device)
            dist.all_reduce(stats)
            mean_s, total_errors = stats[0].item() / world, int(stats[1].item())
            points.append(make_point(coll, bench.size, world, mean_s, total_errors, graph))
            del bench
            if progress:
                progress(f"{coll} {size} B: {points[-1].busbw_gbps:.1f} GB/s")
    return points


def run_rank_from_env(plan: RankPlan, *, backend: str | None = None, init_method: str = "env://"
                      ) -> tuple[int, int, list[Point], str]:
    """Entry point of one rank (under torchrun, or launched by ``launch_local``): RANK, WORLD_SIZE,
    LOCAL_RANK from the environment. Returns (rank, world, points, backend)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    kwargs: dict[str, Any] = {"backend": backend, "init_method": init_method, "rank": rank, "world_size": world}
    if cuda:
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    try:
        points = measure_rank(torch, dist, plan, rank, world, device)
    finally:
        dist.destroy_process_group()
    return rank, world, points, backend


def detect_topology(world: int, multinode: bool, cuda: bool) -> str:
    """cpu for Gloo, multinode across hosts, else what NVML says of the GPUs' NVLinks
    (``diag.topology``: ``nvlink`` only for NVLink 4.0 through NVSwitches, the built-in curves' wiring)."""
    if not cuda:
        return "cpu"
    if multinode:
        return "multinode"
    from gpuhealth.backends.nvml_real import RealNvml
    from gpuhealth.diag.topology import detect

    backend = RealNvml()
    try:
        backend.init()
    except Exception:  # no NVML here (the ranks ran on CUDA all the same): nothing to judge by
        return "unknown"
    try:
        return detect(backend, world, os.environ.get("CUDA_VISIBLE_DEVICES")).name
    finally:
        backend.shutdown()


def plan_to_args(plan: RankPlan) -> list[str]:
    return ["--collectives", ",".join(plan.collectives), "--sizes", ",".join(map(str, plan.sizes)),
            "--warmup", str(plan.warmup), "--iters", str(plan.iters), "--replays", str(plan.replays),
            "--graph-max-bytes", str(plan.graph_max_bytes), *([] if plan.use_graphs else ["--no-graphs"])]


def launch_local(world: int, plan: RankPlan, *, backend: str | None = None, timeout_s: float = 300.0,
                 python: str | None = None, env: Mapping[str, str] | None = None) -> list[Point]:
    """Start ``world`` rank processes on this host (one per GPU), rendezvous through a file in a
    private temporary directory, and return rank 0's points."""
    import json

    out0 = run_local_ranks(world, "busbw-rank", [*plan_to_args(plan), *(["--backend", backend] if backend else [])],
                           what="busbw", timeout_s=timeout_s, python=python, env=env)
    try:
        doc = json.loads(out0)
    except json.JSONDecodeError as exc:
        raise LaunchError(f"busbw rank 0 printed no result: {out0[-500:]!r}") from exc
    return [Point.from_dict(d) for d in doc["points"]]
