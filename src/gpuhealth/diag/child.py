"""The diagnostics child process: ``python -m gpuhealth.diag <probe|sdc|busbw|bandwidth> …``.

It is the only place that imports torch. It prints ONE JSON document on stdout (logs go to stderr):

    {"diag": NAME, "status": "ok" | "failed" | "skipped", "reason": TEXT, "findings": [Finding…],
     "gpu_seconds": {uuid: seconds}, "result": {...}, "wall_s": seconds}

A diagnostic that cannot run here (no torch, no CUDA for a CUDA device) is "skipped" with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

MiB = 1 << 20


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


def _doc(diag: str, status: str, reason: str = "", **extra: Any) -> dict[str, Any]:
    return {"diag": diag, "status": status, "reason": reason, "findings": [], "gpu_seconds": {}, "result": {},
            **extra}


def _log(msg: str) -> None:
    print(f"[gpuhealth.diag] {msg}", file=sys.stderr, flush=True)


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _cuda_indices(torch: Any, spec: str) -> list[int] | str:
    """'cuda' → every GPU, 'cuda:0,cuda:2' → those; a string is the reason none can be used."""
    if not torch.cuda.is_available():
        return "CUDA is not available in this process (no GPU, or a CPU-only torch)"
    count = torch.cuda.device_count()
    if spec == "cuda":
        return list(range(count))
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part.startswith("cuda:") or not part[5:].isdigit():
            return f"bad device {part!r} (expected cuda, cuda:N[,cuda:M] or cpu)"
        idx = int(part[5:])
        if idx >= count:
            return f"{part} does not exist ({count} CUDA devices)"
        out.append(idx)
    return out


def cmd_probe(args: argparse.Namespace) -> dict[str, Any]:
    torch = _import_torch()
    if torch is None:
        return _doc("probe", "skipped", "torch is not installed (pip install 'gpuhealth[diag]')")
    devices = []
    cuda = bool(torch.cuda.is_available())
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "uuid": f"GPU-{p.uuid}", "name": p.name, "sm_count": p.multi_processor_count})
    from gpuhealth.diag.hashing import triton_available

    return _doc("probe", "ok", result={"torch": torch.__version__, "cuda": cuda, "cuda_version": torch.version.cuda,
                                       "devices": devices, "triton": triton_available() if cuda else False})


def cmd_sdc(args: argparse.Namespace) -> dict[str, Any]:
    torch = _import_torch()
    if torch is None:
        return _doc("sdc", "skipped", "torch is not installed (pip install 'gpuhealth[diag]')")
    from gpuhealth.diag import sdc
    from gpuhealth.diag.compare import DeviceRef

    specs: list[sdc.DeviceSpec] = []
    if args.device == "cpu":
        for i in range(max(1, args.cpu_peers)):
            specs.append(sdc.DeviceSpec(DeviceRef(f"cpu:{i}", f"cpu-{i}", i, "cpu"), torch.device("cpu")))
    else:
        picked = _cuda_indices(torch, args.device)
        if isinstance(picked, str):
            return _doc("sdc", "skipped", picked)
        for i in picked:
            p = torch.cuda.get_device_properties(i)
            specs.append(sdc.DeviceSpec(DeviceRef(f"cuda:{i}", f"GPU-{p.uuid}", i, p.name), torch.device("cuda", i)))
    for item in args.corrupt_peer or []:
        # test hook "I:KIND[:RUNS]": device I returns corrupted results (for its first RUNS runs)
        parts = item.split(":")
        spec = specs[int(parts[0])]
        spec.corrupt = sdc.FaultKind(parts[1] if len(parts) > 1 else "single_bit")
        spec.corrupt_runs = int(parts[2]) if len(parts) > 2 else None
    datapaths = [sdc.Datapath(d) for d in args.datapaths.split(",")] if args.datapaths else None
    report = sdc.run_sdc(specs, seed=args.seed, golden_dir=args.golden_dir, repeats=args.repeats,
                         reruns=args.reruns, record_golden=args.record_golden, selftest=args.selftest,
                         node=args.node, datapaths=datapaths)
    gpu_seconds = {d["uuid"]: d["gpu_seconds"] for d in report.devices}
    doc = _doc("sdc", "ok", result=report.to_dict(), gpu_seconds=gpu_seconds)
    doc["findings"] = [f.to_dict() for f in report.findings]
    if report.selftest is not None and not report.selftest["passed"]:
        doc["status"] = "failed"
        doc["reason"] = (f"self-test: {report.selftest['detected']} of {report.selftest['injected']} injected "
                         f"faults detected")
    return doc


def _busbw_plan(args: argparse.Namespace) -> Any:
    from gpuhealth.diag.busbw import COLLECTIVES, RankPlan, sweep_sizes

    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes
             else sweep_sizes(args.min_bytes, args.max_bytes, args.factor))
    colls = tuple(c for c in args.collectives.split(",") if c) if args.collectives else COLLECTIVES
    unknown = [c for c in colls if c not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collective(s) {unknown}; known: {', '.join(COLLECTIVES)}")
    return RankPlan(colls, tuple(sizes), warmup=args.warmup, iters=args.iters, replays=args.replays,
                    use_graphs=not args.no_graphs, graph_max_bytes=args.graph_max_bytes)


def cmd_busbw_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    from gpuhealth.diag.busbw import run_rank_from_env

    rank, world, points, backend = run_rank_from_env(_busbw_plan(args), backend=args.backend,
                                                     init_method=args.init_method)
    if rank != 0:
        return None
    return {"points": [p.to_dict() for p in points], "world": world, "backend": backend}


def cmd_busbw(args: argparse.Namespace) -> dict[str, Any]:
    torch = _import_torch()
    if torch is None:
        return _doc("busbw", "skipped", "torch is not installed (pip install 'gpuhealth[diag]')")
    import os

    from gpuhealth.diag import busbw

    plan = _busbw_plan(args)
    cuda = torch.cuda.is_available() and args.backend != "gloo" and args.device != "cpu"
    t0 = time.monotonic()
    if args.from_env:  # multi-node: every rank runs this under torchrun; rank 0 reports
        out = cmd_busbw_rank(args)
        if out is None:
            return {}
        world, points = out["world"], [busbw.Point.from_dict(p) for p in out["points"]]
        multinode = int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world
    else:
        world = args.world or (torch.cuda.device_count() if cuda else 2)
        if cuda and world < 2:
            return _doc("busbw", "skipped", f"needs at least 2 GPUs on this node ({world} visible)")
        points = busbw.launch_local(world, plan, backend=None if cuda else "gloo", timeout_s=args.rank_timeout)
        multinode = False
    topology = args.topology or busbw.detect_topology(world, multinode, cuda)
    curves = busbw.load_curves(args.thresholds_file) if args.thresholds_file else busbw.REFERENCE_CURVES
    findings, summary = busbw.judge(points, topology=topology, node=args.node, curves=curves,
                                    min_fraction=args.min_fraction, judge_min_bytes=args.judge_min_bytes)
    wall = time.monotonic() - t0
    uuids = []
    if cuda:
        uuids = [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(min(world,
                                                                                     torch.cuda.device_count()))]
    doc = _doc("busbw", "ok", result={"world": world, "backend": "nccl" if cuda else "gloo",
                                      "points": [p.to_dict() for p in points], "judgement": summary},
               gpu_seconds={u: round(wall, 3) for u in uuids})
    doc["findings"] = [f.to_dict() for f in findings]
    return doc


def _fabric_plan(args: argparse.Namespace) -> Any:
    from gpuhealth.diag.fabric import SCHEDULES
    from gpuhealth.diag.fabric_rank import ProbePlan

    if args.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {args.schedule!r} (known: {', '.join(SCHEDULES)})")
    return ProbePlan(size_bytes=args.size_bytes, iters=args.iters, warmup=args.warmup, rtt_iters=args.rtt_iters,
                     schedule=args.schedule, retest=args.retest, slow_fraction=args.slow_fraction,
                     latency_floor_us=args.latency_floor_us)


def _fabric_rank_args(args: argparse.Namespace) -> list[str]:
    return ["--size-bytes", str(args.size_bytes), "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--rtt-iters", str(args.rtt_iters), "--schedule", args.schedule, "--node", args.node,
            "--retest", str(args.retest), "--slow-fraction", str(args.slow_fraction),
            "--latency-floor-us", str(args.latency_floor_us),
            *(["--backend", args.backend] if args.backend else [])]


def cmd_fabric_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    from gpuhealth.diag.fabric_rank import run_rank

    return run_rank(_fabric_plan(args), node=args.node, backend=args.backend, init_method=args.init_method,
                    every_rank=getattr(args, "every_rank", False))


def cmd_fabric(args: argparse.Namespace) -> dict[str, Any]:
    """Pairwise bandwidth and round trips in rounds, judged by ``fabric.judge`` on rank 0; a heatmap
    and the document written where asked (under torchrun stdout is every rank's)."""
    if _import_torch() is None:
        return _doc("fabric", "skipped", "torch is not installed (pip install 'gpuhealth[diag]')")
    from pathlib import Path

    from gpuhealth.diag import fabric, heatmap
    from gpuhealth.diag.launch import run_local_ranks

    _fabric_plan(args)  # bad arguments fail here, before any rank starts
    if args.from_env:  # under torchrun/srun: every rank runs this; rank 0 reports
        raw = cmd_fabric_rank(args)
        if raw is None:
            return {}
    else:
        if args.world < 2:
            return _doc("fabric", "skipped", "a fabric probe needs at least 2 ranks")
        out0 = run_local_ranks(args.world, "fabric-rank", _fabric_rank_args(args), what="fabric probe",
                               timeout_s=args.rank_timeout)
        raw = json.loads(out0)
    m = fabric.Measurements.from_dict(raw["measurements"])
    th = fabric.Thresholds(slow_fraction=args.slow_fraction, node_quorum=args.node_quorum,
                           latency_factor=args.latency_factor, latency_floor_us=args.latency_floor_us)
    verdict = fabric.judge(m, th)
    result = {**raw, "verdict": verdict.to_dict()}
    if args.heatmap and raw.get("rank", 0) == 0:
        ratios = ({p: v / verdict.reference_bps for p, v in m.bandwidth.items()} if verdict.reference_bps else {})
        Path(args.heatmap).write_bytes(heatmap.render(len(m.names), ratios, th.slow_fraction))
        result["heatmap"] = args.heatmap
    doc = _doc("fabric", "ok", result=result)
    doc["findings"] = [f.to_dict() for f in verdict.findings]
    if raw.get("rank", 0) != 0:  # --every-rank: the others print (to their launcher), only rank 0 writes files
        return doc
    if args.out:
        doc["wall_s"] = raw.get("probe_s")
        Path(args.out).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc


def cmd_bandwidth(args: argparse.Namespace) -> dict[str, Any]:
    torch = _import_torch()
    if torch is None:
        return _doc("bandwidth", "skipped", "torch is not installed (pip install 'gpuhealth[diag]')")
    from gpuhealth.diag import bandwidth

    if args.device == "cpu":
        gbps = bandwidth.measure_cpu(torch, args.d2d_mib * MiB, args.reps)
        return _doc("bandwidth", "ok", "CUDA not used: host memory copy only; host↔device skipped",
                    result={"cpu_copy_gbps": round(gbps, 1), "gpus": []})
    picked = _cuda_indices(torch, args.device)
    if isinstance(picked, str):
        return _doc("bandwidth", "skipped", picked)
    results, gpu_seconds = [], {}
    for i in picked:
        t0 = time.monotonic()
        g = bandwidth.measure_gpu(torch, i, d2d_bytes=args.d2d_mib * MiB, host_bytes=args.host_mib * MiB,
                                  reps=args.reps, sysfs_root=args.sysfs_root)
        results.append(g)
        gpu_seconds[g.uuid] = round(time.monotonic() - t0, 3)
    findings = bandwidth.judge(results, hbm_fraction=args.hbm_fraction, pcie_fraction=args.pcie_fraction)
    doc = _doc("bandwidth", "ok", result={"gpus": [g.to_dict() for g in results]}, gpu_seconds=gpu_seconds)
    doc["findings"] = [f.to_dict() for f in findings]
    return doc


def cmd_quick(args: argparse.Namespace) -> dict[str, Any]:
    """Quick qualification: every diagnostic in one warm process per GPU (``diag/quick.py``). The
    launcher itself imports torch only to count GPUs when ``--world`` is not given (the runner gives it)."""
    from gpuhealth.diag import quick

    plan = quick.plan_from_args(args)
    world = args.world
    if not world:
        torch = _import_torch()
        if torch is None:
            return _doc("quick", "skipped", "torch is not installed (pip install 'gpuhealth[diag]')")
        cuda = plan.device != "cpu" and torch.cuda.is_available()
        if plan.device != "cpu" and not cuda:
            return _doc("quick", "skipped", "CUDA is not available in this process (no GPU, or a CPU-only torch)")
        world = torch.cuda.device_count() if cuda else 2
    return quick.launch_quick(world, plan, timeout_s=args.rank_timeout)


def cmd_quick_rank(args: argparse.Namespace) -> dict[str, Any] | None:
    from gpuhealth.diag import quick

    return quick.run_quick_rank(quick.plan_from_args(args), args.init_method)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpuhealth.diag")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("probe")

    s = sub.add_parser("sdc")
    s.add_argument("--device", default="cuda")
    s.add_argument("--cpu-peers", type=int, default=1, help="CPU mode: how many identical 'devices' to compare")
    s.add_argument("--golden-dir")
    s.add_argument("--seed", type=int, default=20261126)
    s.add_argument("--repeats", type=int, default=1)
    s.add_argument("--reruns", type=int, default=2)
    s.add_argument("--record-golden", action="store_true")
    s.add_argument("--selftest", action="store_true")
    s.add_argument("--node", default="node")
    s.add_argument("--datapaths")
    s.add_argument("--corrupt-peer", action="append", help=argparse.SUPPRESS)

    def busbw_args(b: argparse.ArgumentParser) -> None:
        b.add_argument("--collectives")
        b.add_argument("--sizes")
        b.add_argument("--min-bytes", type=int, default=MiB)
        b.add_argument("--max-bytes", type=int, default=1 << 30)
        b.add_argument("--factor", type=int, default=4)
        b.add_argument("--warmup", type=int, default=5)
        b.add_argument("--iters", type=int, default=20)
        b.add_argument("--replays", type=int, default=3)
        b.add_argument("--no-graphs", action="store_true")
        b.add_argument("--graph-max-bytes", type=int, default=16 << 20)
        b.add_argument("--backend", choices=["nccl", "gloo"])
        b.add_argument("--init-method", default="env://")

    b = sub.add_parser("busbw")
    busbw_args(b)
    b.add_argument("--device", default="cuda")
    b.add_argument("--world", type=int)
    b.add_argument("--from-env", action="store_true", help="run as one rank under torchrun (multi-node)")
    b.add_argument("--topology")
    b.add_argument("--thresholds-file")
    b.add_argument("--min-fraction", type=float, default=0.8)
    b.add_argument("--judge-min-bytes", type=int, default=64 * MiB)
    b.add_argument("--rank-timeout", type=float, default=300.0)
    b.add_argument("--node", default="node")
    busbw_args(sub.add_parser("busbw-rank"))

    from gpuhealth.diag.quick import add_plan_arguments

    q = sub.add_parser("quick")
    add_plan_arguments(q)
    q.add_argument("--world", type=int)
    q.add_argument("--rank-timeout", type=float, default=300.0)
    qr = sub.add_parser("quick-rank")
    add_plan_arguments(qr)
    qr.add_argument("--init-method", default="env://")

    def fabric_args(f: argparse.ArgumentParser) -> None:
        f.add_argument("--size-bytes", type=int, default=4 << 20)
        f.add_argument("--iters", type=int, default=3)
        f.add_argument("--warmup", type=int, default=1)
        f.add_argument("--rtt-iters", type=int, default=5)
        f.add_argument("--schedule", default="full", help="full (every pair) | nodes (fewer rounds: which node)")
        f.add_argument("--backend", choices=["nccl", "gloo"])
        f.add_argument("--node", default=socket.gethostname(), help="this rank's node name")
        f.add_argument("--init-method", default="env://")
        f.add_argument("--retest", type=int, default=16, help="slow-looking directions measured again, alone")
        f.add_argument("--slow-fraction", type=float, default=0.6)
        f.add_argument("--latency-floor-us", type=float, default=500.0)

    f = sub.add_parser("fabric")
    fabric_args(f)
    f.add_argument("--device", default="cpu")
    f.add_argument("--world", type=int, default=4, help="local ranks (without --from-env)")
    f.add_argument("--from-env", action="store_true", help="run as one rank under torchrun/srun (multi-node)")
    f.add_argument("--node-quorum", type=float, default=0.75)
    f.add_argument("--latency-factor", type=float, default=4.0)
    f.add_argument("--heatmap", help="rank 0 writes the pair matrix here (PNG)")
    f.add_argument("--out", help="rank 0 writes the result document here (JSON)")
    f.add_argument("--rank-timeout", type=float, default=300.0)
    f.add_argument("--every-rank", action="store_true", help="with --from-env: every rank prints the document")
    fabric_args(sub.add_parser("fabric-rank"))

    w = sub.add_parser("bandwidth")
    w.add_argument("--device", default="cuda")
    w.add_argument("--d2d-mib", type=int, default=1024)
    w.add_argument("--host-mib", type=int, default=256)
    w.add_argument("--reps", type=int, default=5)
    w.add_argument("--sysfs-root", default="/")
    w.add_argument("--hbm-fraction", type=float, default=0.85)
    w.add_argument("--pcie-fraction", type=float, default=0.75)
    return p


PARENT_ENV = "GPUHEALTH_DIAG_PARENT_PID"  # the PID that started this child (runner, launcher): see below


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a killed agent (or a timed-out
    launcher) never leaves ranks spinning in NCCL kernels on the GPUs.

    The request only covers deaths after it is made: a parent killed while this interpreter was still
    starting has already gone, and this process — reparented, holding no lock — would run its whole
    diagnostic on GPUs a job may have taken by then. So a child told its parent's PID
    (``PARENT_ENV``) that finds another parent exits at once; its own children are told its PID."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the runner's process-group kill still applies
    expected = os.environ.get(PARENT_ENV, "")
    if expected.isdigit() and not _descends_from(int(expected)):
        _log(f"the process that started this diagnostic (pid {expected}) is gone: not running it")
        os._exit(3)
    os.environ[PARENT_ENV] = str(os.getpid())  # ranks this process starts check against it


def _descends_from(pid: int, depth: int = 8) -> bool:
    """Is ``pid`` this process's parent, or a near ancestor (a ``diag.python`` wrapper script that does
    not ``exec`` sits between)? True when it cannot be told (no ``/proc``): never refuse on a guess."""
    current = os.getppid()
    for _ in range(depth):
        if current == pid:
            return True
        if current <= 1:
            return False
        try:
            with open(f"/proc/{current}/stat", "rb") as fh:
                current = int(fh.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _die_with_parent()
    t0 = time.monotonic()
    handlers = {"probe": cmd_probe, "sdc": cmd_sdc, "busbw": cmd_busbw, "busbw-rank": cmd_busbw_rank,
                "bandwidth": cmd_bandwidth, "quick": cmd_quick, "fabric": cmd_fabric}
    rank_cmds = {"busbw-rank": cmd_busbw_rank, "quick-rank": cmd_quick_rank, "fabric-rank": cmd_fabric_rank}
    if args.cmd in rank_cmds:  # a rank that fails must exit non-zero: the launcher watches
        out = rank_cmds[args.cmd](args)
        if out:
            _emit(out)
        return 0
    try:
        doc = handlers[args.cmd](args)
    except Exception as exc:  # the parent must always get a document, never a bare traceback
        _log(traceback.format_exc())
        doc = _doc(args.cmd, "failed", f"{type(exc).__name__}: {exc}")
    if doc:  # busbw-rank / multi-node ranks other than 0 print nothing
        doc.setdefault("wall_s", round(time.monotonic() - t0, 3))
        _emit(doc)
    return 0
