"""Quick qualification in one warm process per GPU: SDC, memory bandwidth and NCCL bus bandwidth
with torch imported, the CUDA context created and the process group formed once.

Run as separate children (``qualify`` before), each diagnostic paid its own Python start, torch
import and CUDA contexts on every GPU: on 4 × H200 the three took 22.6 s for ~6 s of GPU work. Here
``launch_quick`` starts one rank per GPU (``python -m gpuhealth.diag quick-rank``, a file
rendezvous, as ``busbw.launch_local``) and each rank runs the phases on its own GPU:

1. ``sdc``: every SDC case on this GPU — all GPUs at once (compute only; no GPU disturbs another);
2. ``device_copy``: device-memory copy bandwidth — all GPUs at once (each its own HBM);
3. ``host_copy``: pinned host↔device bandwidth — one GPU at a time (they share the host's memory
   and PCIe switches: measured together they would read each other's traffic as a slow link);
4. ``busbw``: the collectives, every rank together (the process group already formed);
5. ``judge``: rank 0 gathers every GPU's SDC digests and judges them as one run would (golden →
   peers → re-runs, the re-runs asked of the rank that owns the suspect GPU), and the bandwidths.

Coverage is the three diagnostics' own: same SDC cases and judgement, same probe sizes and
thresholds. Rank 0 prints one document whose ``result`` holds each diagnostic's document as its
own child would have printed it (``split_quick`` turns them back into outcomes), and ``phases``:
the wall seconds of each phase, for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.diag.launch import LaunchError, run_local_ranks

PHASES = ("start", "sdc", "device_copy", "host_copy", "busbw", "judge")
MiB = 1 << 20


@dataclass(slots=True)
class QuickPlan:
    device: str = "cuda"  # "cuda" or "cpu" (gloo; the CPU path the tests run)
    node: str = "node"
    # SDC
    seed: int = 20261126
    repeats: int = 1
    reruns: int = 2
    golden_dir: str | None = None
    datapaths: str | None = None
    corrupt_rank: dict[int, str] = field(default_factory=dict)  # test hook: rank → fault kind
    # busbw (the RankPlan's fields) and its judgement
    collectives: str = "all_reduce,all_gather"
    sizes: str = f"{MiB},{64 * MiB},{1024 * MiB}"
    warmup: int = 5
    iters: int = 10
    replays: int = 3
    topology: str | None = None
    thresholds_file: str | None = None
    min_fraction: float = 0.8
    judge_min_bytes: int = 64 * MiB
    # bandwidth
    d2d_mib: int = 512
    host_mib: int = 128
    reps: int = 3
    sysfs_root: str = "/"
    hbm_fraction: float = 0.85
    pcie_fraction: float = 0.75

    def to_args(self) -> list[str]:
        out: list[str] = []
        for name in _plan_fields():
            value = getattr(self, name)
            if value is None or name == "corrupt_rank":
                continue
            out += [f"--{name.replace('_', '-')}", str(value)]
        for rank, kind in sorted(self.corrupt_rank.items()):
            out += ["--corrupt-rank", f"{rank}:{kind}"]
        return out


def _plan_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(QuickPlan)]


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The plan's fields as command-line options (``quick`` and ``quick-rank`` take the same)."""
    defaults = QuickPlan()
    for name in _plan_fields():
        if name == "corrupt_rank":  # test hook "RANK:KIND": that rank's GPU corrupts every result
            p.add_argument("--corrupt-rank", action="append", default=[], help=argparse.SUPPRESS)
            continue
        value = getattr(defaults, name)
        kind = type(value) if value is not None else str
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=value)


def plan_from_args(args: Any) -> QuickPlan:
    values = {name: getattr(args, name) for name in _plan_fields() if name != "corrupt_rank"}
    corrupt = {}
    for item in args.corrupt_rank or []:
        rank, _, kind = str(item).partition(":")
        corrupt[int(rank)] = kind or "single_bit"
    return QuickPlan(**values, corrupt_rank=corrupt)


# ------------------------------------------------------------------------------------------ a rank

def run_quick_rank(plan: QuickPlan, init_method: str) -> dict[str, Any] | None:
    """One rank (RANK, WORLD_SIZE, LOCAL_RANK in the environment). Rank 0 returns the document."""
    t_start = time.monotonic()
    import torch
    import torch.distributed as dist

    from gpuhealth.diag import bandwidth, busbw, sdc
    from gpuhealth.diag.compare import DeviceRef

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = plan.device != "cpu" and torch.cuda.is_available()
    if plan.device != "cpu" and not cuda:  # every rank sees the same: rank 0 says so, nobody waits
        return None if rank else {"diag": "quick", "status": "skipped", "findings": [], "gpu_seconds": {},
                                  "reason": "CUDA is not available in this process (no GPU, or a CPU-only torch)",
                                  "result": {}}
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        props = torch.cuda.get_device_properties(local)
        ref = DeviceRef(f"cuda:{local}", f"GPU-{props.uuid}", local, props.name)
    else:
        device = torch.device("cpu")
        ref = DeviceRef(f"cpu:{rank}", f"cpu-{rank}", rank, "cpu")
    kwargs: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "init_method": init_method, "rank": rank,
                              "world_size": world}
    if cuda:
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    phases: dict[str, float] = {}
    t = time.monotonic()
    phases["start"] = t - t_start

    def phase(name: str) -> None:
        nonlocal t
        dist.barrier()  # a phase ends when every GPU is done with it
        now = time.monotonic()
        phases[name] = now - t
        t = now

    try:
        # 1. SDC on every GPU at once
        spec = sdc.DeviceSpec(ref, device)
        if rank in plan.corrupt_rank:
            spec.corrupt = sdc.FaultKind(plan.corrupt_rank[rank])
        datapaths = [sdc.Datapath(d) for d in plan.datapaths.split(",")] if plan.datapaths else None
        cases = sdc.plan_cases(device, datapaths)
        one = sdc.case_runner(plan.seed, [])
        sdc_run = sdc.measure_device(spec, cases, one, seed=plan.seed, repeats=plan.repeats, selftest=False,
                                     faults=[])
        phase("sdc")
        # 2. device copy on every GPU at once; 3. host copies one GPU at a time
        bw: dict[str, Any]
        if cuda:
            g = bandwidth.measure_gpu(torch, local, d2d_bytes=plan.d2d_mib * MiB, host_bytes=plan.host_mib * MiB,
                                      reps=plan.reps, sysfs_root=plan.sysfs_root, host_copy=False)
            phase("device_copy")
            for turn in range(world):
                if turn == rank:
                    h = bandwidth.measure_gpu(torch, local, d2d_bytes=0, host_bytes=plan.host_mib * MiB,
                                              reps=plan.reps, sysfs_root=plan.sysfs_root, device_copy=False)
                    h.d2d_gbps = g.d2d_gbps
                    g = h
                dist.barrier()
            phases["host_copy"] = time.monotonic() - t
            t = time.monotonic()
            bw = {"gpu": g.to_dict(), "gpu_seconds": 0.0}
        else:
            bw = {"cpu_copy_gbps": round(bandwidth.measure_cpu(torch, plan.d2d_mib * MiB, plan.reps), 1)}
            phase("device_copy")
            phases["host_copy"] = 0.0
        # 4. the collectives, everyone together
        points: list[Any] = []
        if world >= 2 and _collectives(plan):
            rank_plan = busbw.RankPlan(_collectives(plan),
                                       tuple(int(s) for s in plan.sizes.split(",")), warmup=plan.warmup,
                                       iters=plan.iters, replays=plan.replays)
            points = busbw.measure_rank(torch, dist, rank_plan, rank, world, device)
        phase("busbw")
        # 5. gather on rank 0; SDC re-runs asked of the GPU's own rank
        mine = {"sdc": sdc_run.to_wire(), "bandwidth": bw}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        runs = [sdc.DeviceRun.from_wire(g["sdc"]) for g in gathered]
        report = None
        case_by_id = {c.case_id: c for c in cases}
        if rank == 0:
            asked = [False]

            def rerun(suspects: Sequence[Any]) -> dict[tuple[str, str], list[str]]:
                asked[0] = True
                return _collective_rerun(dist, [(s.device, s.case_id) for s in suspects], spec, case_by_id, one,
                                         plan.reruns, world)

            report = sdc.judge_sdc(runs, cases, device, seed=plan.seed, golden_dir=plan.golden_dir, rerun=rerun,
                                   reruns=plan.reruns, node=plan.node, datapaths=datapaths)
            if not asked[0]:
                _collective_rerun(dist, [], spec, case_by_id, one, plan.reruns, world)
        else:
            _collective_rerun(dist, None, spec, case_by_id, one, plan.reruns, world)
        if rank != 0:
            return None
        assert report is not None
        doc = _document(report, gathered, points, world, cuda, plan)
        phases["judge"] = time.monotonic() - t
        doc["result"]["phases"] = {k: round(v, 3) for k, v in phases.items()}
        return doc
    finally:
        dist.destroy_process_group()


def _collectives(plan: QuickPlan) -> tuple[str, ...]:
    """The plan's collectives; none (``--collectives ''``): a screen on a node some of whose GPUs run a
    job measures no bus bandwidth (its traffic would cross the job's links and switches)."""
    return tuple(c for c in plan.collectives.split(",") if c)


def _collective_rerun(dist: Any, asked: list[tuple[str, str]] | None, spec: Any, case_by_id: Mapping[str, Any],
                      one: Any, reruns: int, world: int) -> dict[tuple[str, str], list[str]]:
    """Rank 0 passes the suspects (device key, case id), the others None: every rank re-runs the
    suspects on its own device ``reruns`` times and rank 0 gets every answer."""
    box = [asked]
    dist.broadcast_object_list(box, src=0)
    suspects: list[tuple[str, str]] = box[0] or []
    if not suspects:
        return {}
    mine = {f"{dev}|{case}": [one(spec, case_by_id[case], False).digest for _ in range(reruns)]
            for dev, case in suspects if dev == spec.ref.key}
    answers: list[Any] = [None] * world
    dist.all_gather_object(answers, mine)
    out: dict[tuple[str, str], list[str]] = {}
    for answer in answers:
        for key, digests in answer.items():
            dev, _, case = key.partition("|")
            out[(dev, case)] = digests
    return out


def _document(report: Any, gathered: Sequence[Mapping[str, Any]], points: Sequence[Any], world: int, cuda: bool,
              plan: QuickPlan) -> dict[str, Any]:
    """Rank 0's document: each diagnostic's document as its own child prints it."""
    from gpuhealth.diag import bandwidth, busbw

    sdc_doc: dict[str, Any] = {"diag": "sdc", "status": "ok", "reason": "", "result": report.to_dict(),
               "findings": [f.to_dict() for f in report.findings],
               "gpu_seconds": {d["uuid"]: d["gpu_seconds"] for d in report.devices}}
    bw_doc: dict[str, Any]
    bb_doc: dict[str, Any]
    if cuda:
        gpus = [bandwidth.GpuBandwidth.from_dict(g["bandwidth"]["gpu"]) for g in gathered]
        bw_findings = bandwidth.judge(gpus, hbm_fraction=plan.hbm_fraction, pcie_fraction=plan.pcie_fraction)
        bw_doc = {"diag": "bandwidth", "status": "ok", "reason": "", "result": {"gpus": [g.to_dict() for g in gpus]},
                  "findings": [f.to_dict() for f in bw_findings], "gpu_seconds": {}}
    else:
        bw_doc = {"diag": "bandwidth", "status": "ok", "reason": "CUDA not used: host memory copy only",
                  "result": {"cpu_copy_gbps": gathered[0]["bandwidth"]["cpu_copy_gbps"], "gpus": []},
                  "findings": [], "gpu_seconds": {}}
    if world < 2 or not _collectives(plan):
        why = "needs at least 2 GPUs" if world < 2 else "no collectives asked for (--collectives '')"
        bb_doc = {"diag": "busbw", "status": "skipped", "reason": why, "result": {}, "findings": [],
                  "gpu_seconds": {}}
    else:
        topology = plan.topology or busbw.detect_topology(world, False, cuda)
        curves = busbw.load_curves(plan.thresholds_file) if plan.thresholds_file else busbw.REFERENCE_CURVES
        findings, summary = busbw.judge(list(points), topology=topology, node=plan.node, curves=curves,
                                        min_fraction=plan.min_fraction, judge_min_bytes=plan.judge_min_bytes)
        bb_doc = {"diag": "busbw", "status": "ok", "reason": "",
                  "result": {"world": world, "backend": "nccl" if cuda else "gloo",
                             "points": [p.to_dict() for p in points], "judgement": summary},
                  "findings": [f.to_dict() for f in findings], "gpu_seconds": {}}
    gpu_seconds: dict[str, float] = {}
    for sub in (sdc_doc, bw_doc, bb_doc):
        for uuid, s in sub["gpu_seconds"].items():
            gpu_seconds[uuid] = gpu_seconds.get(uuid, 0.0) + float(s)
    return {"diag": "quick", "status": "ok", "reason": "", "findings": [], "gpu_seconds": gpu_seconds,
            "result": {"sdc": sdc_doc, "bandwidth": bw_doc, "busbw": bb_doc, "world": world}}


# ------------------------------------------------------------------------------------------ launcher

QuickLaunchError = LaunchError  # the name callers knew


def launch_quick(world: int, plan: QuickPlan, *, timeout_s: float = 300.0, python: str | None = None,
                 env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Start ``world`` ranks on this host (one per GPU), wait, and return rank 0's document."""
    out0 = run_local_ranks(world, "quick-rank", plan.to_args(), what="quick qualification", timeout_s=timeout_s,
                           python=python, env=env)
    try:
        doc: dict[str, Any] = json.loads(out0.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as exc:
        raise LaunchError(f"quick qualification rank 0 printed no result: {out0[-500:]!r}") from exc
    return doc


__all__ = ["PHASES", "QuickLaunchError", "QuickPlan", "add_plan_arguments", "launch_quick", "plan_from_args",
           "run_quick_rank"]
