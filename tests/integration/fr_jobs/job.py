"""A real multi-process PyTorch job with injectable faults, for flight-recorder triage tests.

Launcher (no torch import here):

    python job.py --mode hang_skip --out DIR [--world-size 4] [--backend gloo|nccl]

starts one subprocess per rank (``--rank R``), watches their step records, and when the job stops
making progress (or finishes) creates ``DIR/dump_now``. A watchdog thread in every rank sees the
trigger and writes its flight-recorder dump — ``rank<R>.json`` (``_dump_fr_trace_json`` for Gloo,
``_dump_nccl_trace_json`` for NCCL) into ``DIR/dumps/`` and ``rank<R>.pkl`` (pickle with stack frames) — while the
main thread is still blocked in the collective, i.e. BEFORE the process-group timeout fires (after
it fires, Gloo marks the failed collective retired on most ranks and the evidence is gone). Then
the launcher kills what is left. Each rank also writes ``steps_rank<R>.jsonl``: one StepRecord per
step with compute and collective wait timed apart (wall time alone hides a straggler).

The job: a TP group per pair of ranks ({0,1}, {2,3}, …) and the world group; every step does
"compute" (sleep, so 2 CPU cores can run 4+ ranks with exact timing; a matmul loop on GPUs), a TP
all_reduce and a world all_reduce of the "gradients".

Modes (the faulty rank is ``--culprit``, default the last rank; the fault fires at ``--fault-step``):
    healthy        nothing wrong
    hang_skip      the culprit skips the world all_reduce of one step (then finishes early)
    hang_sleep     the culprit sleeps for a long time inside the step, between its TP and world
                   all_reduce (host-side stuck: everyone waits for it in the world group)
    subgroup_hang  the culprit sleeps just before its TP all_reduce: its TP peer waits in the TP group,
                   everyone else waits in the world group
    subgroup_skip  the culprit skips its TP all_reduce of one step and goes on to the world all_reduce:
                   its TP peers wait in the TP group, the rest of the world waits for those peers
    type_mismatch  the culprit calls all_gather where the others call all_reduce
    size_mismatch  the culprit broadcasts a larger tensor than the others (a leaf of the broadcast)
    dtype_mismatch the culprit all_reduces int32 where the others use float32 (same bytes: Gloo passes it silently)
    straggler      the culprit does --straggler-factor (default 2) x the compute every step from --fault-step on

TP groups are consecutive blocks of --tp-size ranks (default 2).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("healthy", "hang_skip", "hang_sleep", "subgroup_hang", "subgroup_skip", "type_mismatch", "size_mismatch",
         "dtype_mismatch", "straggler")
# Modes where the job is expected to stop making progress (the launcher triggers dumps on a stall).
HANG_MODES = ("hang_skip", "hang_sleep", "subgroup_hang", "subgroup_skip", "type_mismatch")


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

    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=args.pg_timeout))
    tp_size = args.tp_size
    tp_groups = [dist.new_group(list(range(i, min(i + tp_size, world)))) for i in range(0, world, tp_size)]
    tp = tp_groups[rank // tp_size]
    dump_done = threading.Event()

    def dump() -> None:
        c10d = torch._C._distributed_c10d
        if nccl:
            js = c10d._dump_nccl_trace_json(True, False)
            pk = c10d._dump_nccl_trace(True, True, False)
        else:
            js = c10d._dump_fr_trace_json(True, False)
            pk = c10d._dump_fr_trace(True, True, False)
        for name, data in ((f"rank{rank}.json", js), (f"rank{rank}.pkl", pk)):
            tmp = dumps_dir / (name + ".tmp")
            tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
            tmp.rename(dumps_dir / name)
        dump_done.set()

    def watchdog() -> None:
        # Dumps on demand while the main thread is blocked (Gloo and cudaSynchronize release the GIL).
        trigger = out / "dump_now"
        while not trigger.exists():
            time.sleep(0.02)
        dump()

    threading.Thread(target=watchdog, name="fr-dump", daemon=True).start()

    culprit = args.culprit if args.culprit >= 0 else world - 1
    me = rank == culprit
    grad = torch.ones(args.numel, device=device)
    small = torch.ones(16, device=device)
    if nccl:
        weights = torch.randn(1024, 1024, device=device)
    steps_file = (out / f"steps_rank{rank}.jsonl").open("a")

    def compute(seconds: float) -> None:
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

    try:
        _train(args, dist, torch, rank, world, tp, me, grad, small, device, nccl, steps_file, compute, wait_comm)
    except Exception as exc:  # a collective that timed out: keep the process alive to be dumped
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


def _train(args, dist, torch, rank, world, tp, me, grad, small, device, nccl, steps_file, compute,  # type: ignore[no-untyped-def]
           wait_comm) -> None:
    for step in range(args.steps):
        t0 = time.time()
        c0 = time.perf_counter()
        factor = args.straggler_factor if (args.mode == "straggler" and me and step >= args.fault_step) else 1.0
        compute(args.compute_s * factor)
        fault_now = me and step == args.fault_step
        c1 = time.perf_counter()
        if fault_now and args.mode == "subgroup_hang":
            time.sleep(3600)
        if not (fault_now and args.mode == "subgroup_skip"):
            dist.all_reduce(small, group=tp)
        if fault_now and args.mode == "hang_sleep":
            time.sleep(3600)
        if fault_now and args.mode == "hang_skip":
            pass  # skips the world all_reduce of this step
        elif fault_now and args.mode == "type_mismatch":
            gathered = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(gathered, grad)
        elif fault_now and args.mode == "dtype_mismatch":
            dist.all_reduce(grad.to(torch.int32))
        elif args.mode == "size_mismatch" and step == args.fault_step:
            n = args.numel * 2 if me else args.numel
            dist.broadcast(torch.ones(n, device=device), src=0)
        else:
            dist.all_reduce(grad)
            grad.fill_(1.0)
        wait_comm()
        c2 = time.perf_counter()
        rec = {"job_id": args.job_id, "rank": rank, "step": step, "start_time": t0, "wall_s": c2 - c0,
               "compute_s": c1 - c0, "comm_wait_s": c2 - c1}
        steps_file.write(json.dumps(rec) + "\n")
        steps_file.flush()


# ------------------------------------------------------------------------------------- launcher side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _progress(out: Path, world: int) -> tuple[int, int]:
    """(total step records written, ranks finished)."""
    lines = 0
    for r in range(world):
        p = out / f"steps_rank{r}.jsonl"
        if p.exists():
            lines += p.read_bytes().count(b"\n")
    return lines, sum((out / f"finished_rank{r}").exists() for r in range(world))


def launch(args: argparse.Namespace) -> int:
    out = Path(args.out)
    (out / "dumps").mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(os.environ)
    env.update({"TORCH_FR_BUFFER_SIZE": str(args.buffer), "TORCH_NCCL_ENABLE_TIMING": "1",
                "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    procs = []
    for r in range(args.world_size):
        cmd = [sys.executable, __file__, "--rank", str(r), "--port", str(port), *args.passthrough]
        log = (out / f"log_rank{r}.txt").open("w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
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
        if all((out / "dumps" / f"rank{r}.json").exists() for r in alive):
            break
        time.sleep(0.05)
    time.sleep(0.1)
    codes = {}
    for r, p in enumerate(procs):
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        codes[r] = p.wait()
    (out / "launcher.json").write_text(json.dumps({"reason": reason, "exit_codes": codes,
                                                   "mode": args.mode, "world_size": args.world_size}))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="healthy")
    p.add_argument("--out", required=True)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fault-step", type=int, default=6)
    p.add_argument("--culprit", type=int, default=-1)
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--straggler-factor", type=float, default=2.0)
    p.add_argument("--compute-s", type=float, default=0.02)
    p.add_argument("--numel", type=int, default=1024)
    p.add_argument("--buffer", type=int, default=2000)
    p.add_argument("--pg-timeout", type=float, default=30.0)
    p.add_argument("--stall-s", type=float, default=1.5)
    p.add_argument("--dump-wait", type=float, default=10.0)
    p.add_argument("--job-timeout", type=float, default=60.0)
    p.add_argument("--job-id", default="frjob")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--port", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.rank >= 0:
        return _rank_main(args)
    # Ranks get the same options (minus launcher-only ones handled above).
    args.passthrough = argv
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
