"""A real multi-process PyTorch job with injectable faults, for flight-recorder triage tests.

Launcher (no torch import here):

    python job.py --mode hang_skip --out DIR [--world-size 4] [--backend gloo|nccl] [--jitter 0.15]

starts one subprocess per rank (``--rank R``), watches their step records, and when the job stops
making progress (or finishes) creates ``DIR/dump_now``. A watchdog thread in every rank sees the
trigger and writes its flight-recorder dump — ``rank<R>.json`` (``_dump_fr_trace_json`` for Gloo,
``_dump_nccl_trace_json`` for NCCL) into ``DIR/dumps/`` and ``rank<R>.pkl`` (pickle with stack frames) — while the
main thread is still blocked in the collective, i.e. BEFORE the process-group timeout fires (after
it fires, Gloo marks the failed collective retired on most ranks and the evidence is gone). Then
the launcher kills what is left. Each rank also writes ``steps_rank<R>.jsonl``: one StepRecord per
step with compute and collective wait timed apart (wall time alone hides a straggler).

The job: a TP group per block of --tp-size ranks ({0,1}, {2,3}, …) and the world group; every step does
"compute" (sleep, so 2 CPU cores can run 4+ ranks with exact timing; a matmul loop on GPUs; ``--jitter J``
scales each step's compute by a random factor in [1-J, 1+J] per rank), then the mode's communication.
The modes, their faults and their root causes are in faults.py (``python job.py --list`` prints them);
``faults.expected()`` gives the answer triage must give for a run. The faulty rank is ``--culprit`` (default:
the mode's, mostly the last rank); the fault fires at ``--fault-step``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults  # a sibling module: found when this file is imported as well as when it runs as a script

MODES = tuple(faults.MODES)
# Modes where the job is expected to stop making progress (the launcher triggers dumps on a stall).
HANG_MODES = faults.HANG_MODES


# --------------------------------------------------------------------------------------- rank side


def _rank_main(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    out = Path(args.out)
    dumps_dir = out / "dumps"
    rank, world = args.rank, args.world_size
    nccl = args.backend == "nccl"
    if nccl:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    from datetime import timedelta

    # A file rendezvous: no TCP port to pick, so jobs started side by side cannot take each other's port.
    dist.init_process_group(args.backend, init_method=f"file://{out.resolve() / 'rendezvous'}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    groups = _make_groups(dist, args, rank, world)
    dump_done = threading.Event()

    def dump() -> None:
        c10d = torch._C._distributed_c10d
        # JSON first (instant); the pickle with stack frames can take seconds the first time (symbolizer).
        as_json = c10d._dump_nccl_trace_json if nccl else c10d._dump_fr_trace_json
        as_pickle = c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace
        for name, make in ((f"rank{rank}.json", lambda: as_json(True, False)),
                           (f"rank{rank}.pkl", lambda: as_pickle(True, True, False))):
            data = make()
            tmp = dumps_dir / (name + ".tmp")
            tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
            tmp.rename(dumps_dir / name)
        dump_done.set()

    def watchdog() -> None:
        # Dumps on demand while the main thread is blocked (Gloo and cudaSynchronize release the GIL).
        # The first dump with stack traces warms a symbolizer up (seconds on a loaded CPU): do it now, not
        # while the launcher waits for the dumps of a stuck job.
        c10d = torch._C._distributed_c10d
        (c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace)(True, True, False)
        trigger = out / "dump_now"
        while not trigger.exists():
            time.sleep(0.02)
        dump()

    threading.Thread(target=watchdog, name="fr-dump", daemon=True).start()

    if nccl:
        weights = torch.randn(1024, 1024, device=device)

    def busy(seconds: float) -> None:
        if nccl:
            # A fixed amount of GPU work: seconds is scaled into matmul repetitions.
            x = weights
            for _ in range(max(1, int(seconds * 2000))):
                x = torch.matmul(x, weights).tanh_()
            torch.cuda.synchronize()
        else:
            time.sleep(seconds)

    def wait_comm() -> None:
        if nccl:
            torch.cuda.synchronize()

    ctx = faults.Ctx(args=args, dist=dist, torch=torch, rank=rank, world=world, device=device, nccl=nccl,
                     culprit=faults.culprit_of(args.mode, world, args.culprit), groups=groups,
                     wait_comm=wait_comm, busy=busy, rng=random.Random(args.seed * 100_003 + rank))
    ctx.tensors.update(grad=torch.ones(args.numel, device=device), small=torch.ones(16, device=device),
                       act=torch.ones(64, device=device), act_in=torch.ones(64, device=device))
    steps_file = (out / f"steps_rank{rank}.jsonl").open("a")
    try:
        _train(args, ctx, steps_file)
    except Exception as exc:  # a collective that timed out or failed: keep the process alive to be dumped
        (out / f"error_rank{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
    steps_file.close()
    (out / f"finished_rank{rank}").touch()
    # Stay alive until the launcher asks for the dump, so a healthy job is dumped too.
    dump_done.wait(timeout=args.pg_timeout + args.dump_wait)
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group cannot always be torn down; the dump is what matters
        pass
    return 0


def _make_groups(dist, args: argparse.Namespace, rank: int, world: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Every rank creates every group in the same order (group names are creation order: "0" is the world)."""
    tp_size = args.tp_size
    tp_groups = [dist.new_group(list(range(i, min(i + tp_size, world)))) for i in range(0, world, tp_size)]
    groups: dict[str, object] = {"tp": tp_groups[rank // tp_size]}
    if args.mode == "tp_pp_dp_skip":
        lay = faults.layout(world, tp_size, args.pp_size)
        pp_groups = [dist.new_group(g) for g in lay["pp"]]
        dp_groups = [dist.new_group(g) for g in lay["dp"]]
        i = next(k for k, g in enumerate(lay["pp"]) if rank in g)
        stage = lay["pp"][i].index(rank)
        members = lay["pp"][i]
        groups.update(pp=pp_groups[i], dp=dp_groups[next(k for k, g in enumerate(lay["dp"]) if rank in g)],
                      pp_prev=members[stage - 1] if stage > 0 else None,
                      pp_next=members[stage + 1] if stage < len(members) - 1 else None)
    return groups


def _train(args: argparse.Namespace, ctx: faults.Ctx, steps_file) -> None:  # type: ignore[no-untyped-def]
    step_fn = faults.STEP_FUNCTIONS[args.mode]
    for step in range(args.steps):
        t0 = time.time()
        c0 = time.perf_counter()
        ctx.compute_time = 0.0
        step_fn(ctx, step)
        ctx.wait_comm()
        c2 = time.perf_counter()
        rec = {"job_id": args.job_id, "rank": ctx.rank, "step": step, "start_time": t0, "wall_s": c2 - c0,
               "compute_s": ctx.compute_time, "comm_wait_s": (c2 - c0) - ctx.compute_time}
        steps_file.write(json.dumps(rec) + "\n")
        steps_file.flush()


# ------------------------------------------------------------------------------------- launcher side


def _progress(out: Path, world: int) -> tuple[int, int]:
    """(total step records written, ranks finished)."""
    lines = 0
    for r in range(world):
        p = out / f"steps_rank{r}.jsonl"
        if p.exists():
            lines += p.read_bytes().count(b"\n")
    return lines, sum((out / f"finished_rank{r}").exists() for r in range(world))


def _start(args: argparse.Namespace, out: Path) -> list[subprocess.Popen[bytes]]:
    env = dict(os.environ)
    env.update({"TORCH_FR_BUFFER_SIZE": str(args.buffer), "TORCH_NCCL_ENABLE_TIMING": "1",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    procs = []
    for r in range(args.world_size):
        cmd = [sys.executable, __file__, "--rank", str(r), *args.passthrough]
        log = (out / f"log_rank{r}.txt").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def _kill(procs: list[subprocess.Popen[bytes]]) -> dict[int, int]:
    codes = {}
    for r, p in enumerate(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        codes[r] = p.wait()
    return codes


def launch(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "dumps").mkdir(parents=True, exist_ok=True)
    procs = _start(args, out)
    deadline = time.monotonic() + args.job_timeout
    last, last_change = (-1, 0), time.monotonic()
    reason = "timeout"
    while time.monotonic() < deadline:
        time.sleep(0.05)
        prog = _progress(out, args.world_size)
        if prog != last:
            last, last_change = prog, time.monotonic()
        if prog[1] == args.world_size:
            reason = "finished"
            break
        if prog[0] > 0 and time.monotonic() - last_change > args.stall_s:
            reason = "stalled"
            break
        if all(p.poll() is not None for p in procs):
            reason = "exited"
            break
    (out / "dump_now").touch()
    dump_deadline = time.monotonic() + args.dump_wait
    while time.monotonic() < dump_deadline:
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
        if all((out / "dumps" / f"rank{r}.pkl").exists() for r in alive):  # the pickle is written last
            break
        time.sleep(0.05)
    time.sleep(0.1)
    codes = _kill(procs)
    (out / "launcher.json").write_text(json.dumps({
        "reason": reason, "exit_codes": codes, "mode": args.mode, "world_size": args.world_size,
        "culprit": faults.culprit_of(args.mode, args.world_size, args.culprit), "backend": args.backend,
        "options": [a for a in args.passthrough if a != args.out and a != "--out"]}))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="healthy")
    p.add_argument("--list", action="store_true", help="print the modes (fault and root cause) and exit")
    p.add_argument("--out")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fault-step", type=int, default=6)
    p.add_argument("--culprit", type=int, default=-1, help="the faulty rank (default: the mode's)")
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--pp-size", type=int, default=2, help="pipeline stages (tp_pp_dp_skip)")
    p.add_argument("--straggler-factor", type=float, default=2.0)
    p.add_argument("--compute-s", type=float, default=0.02)
    p.add_argument("--jitter", type=float, default=0.0, help="per-step random compute scale in [1-J, 1+J]")
    p.add_argument("--seed", type=int, default=0, help="seeds the jitter (per rank)")
    p.add_argument("--numel", type=int, default=1024)
    p.add_argument("--buffer", type=int, default=2000)
    p.add_argument("--pg-timeout", type=float, default=30.0)
    p.add_argument("--stall-s", type=float, default=1.5)
    p.add_argument("--dump-wait", type=float, default=30.0, help="the longest wait for the dumps")
    p.add_argument("--job-timeout", type=float, default=60.0)
    p.add_argument("--job-id", default="frjob")
    p.add_argument("--rank", type=int, default=-1)
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse runs a mode cannot do, with one line, before any process starts."""
    spec = faults.MODES[args.mode]
    if args.out is None:
        p.error("--out is required")
    if args.backend not in spec.backends:
        p.error(f"mode {args.mode} runs on {', '.join(spec.backends)} only")
    if args.world_size < spec.min_world:
        p.error(f"mode {args.mode} needs --world-size >= {spec.min_world}")
    culprit = faults.culprit_of(args.mode, args.world_size, args.culprit)
    if not 0 <= culprit < args.world_size:
        p.error(f"--culprit {culprit} is not a rank of a {args.world_size}-rank job")
    if args.world_size % args.tp_size:
        p.error("--world-size must be a multiple of --tp-size")
    if args.mode == "tp_pp_dp_skip" and (args.world_size % (args.tp_size * args.pp_size)
                                         or args.world_size < 2 * args.tp_size * args.pp_size):
        p.error("tp_pp_dp_skip needs --world-size = DP x --tp-size x --pp-size with DP >= 2")
    if args.mode in ("pipeline_hang", "pipeline_batch_hang") and culprit == args.world_size - 1:
        p.error(f"{args.mode}: the culprit must have a successor to starve (not the last rank)")
    if args.mode == "send_recv_size_mismatch" and culprit != 1:
        p.error("send_recv_size_mismatch: the receiver, rank 1, is the culprit")
    if args.mode == "recv_any_source" and culprit != 0:
        p.error("recv_any_source: the producer, rank 0, is the culprit")
    if not 0 <= args.jitter < 1:
        p.error("--jitter must be in [0, 1)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    args = p.parse_args(argv)
    if args.list:
        for name, spec in faults.MODES.items():
            print(f"{name:30s} {'/'.join(spec.backends):10s} {spec.doc}")
        return 0
    if args.rank >= 0:
        return _rank_main(args)
    _check(p, args)
    # Ranks get the same options (minus launcher-only ones handled above).
    args.passthrough = argv
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
