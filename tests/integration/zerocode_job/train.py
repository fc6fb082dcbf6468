"""An unmodified PyTorch training script (it imports nothing of gpuhealth), for zero-code tests.

Run it under torchrun, on CPU (Gloo) or GPUs (NCCL)::

    torchrun --nproc-per-node=2 train.py --backend gloo --steps 0 --hang-rank 1 --hang-step 20

Each step "computes" (a sleep on CPU, a matmul loop sized to ``--compute-s`` on a GPU), then all-reduces
in the world group and, with ``--subgroup``, in a second group of all ranks (a second NCCL communicator).

Faults: ``--hang-rank R --hang-step S``: rank R stops entering collectives at step S and sleeps (a
host-stuck rank). ``--mismatch-rank R --mismatch-step S``: rank R broadcasts where the others
all-reduce (a collective mismatch). ``--slow-rank R --slow-factor F``: rank R computes F× longer.
``--steps-out FILE``: rank 0 appends one JSON line per step ({"step", "t", "dt"}).

``--pattern fsdp``: each step all-gathers three shards (``all_gather_into_tensor``), computes, and reduce-scatters
three (``reduce_scatter_tensor``), as FSDP does. ``--skip-rank R --skip-step S`` (fsdp): rank R skips one
reduce_scatter at step S and runs one collective out of phase from then on: NCCL pairs its all_gathers with
the other ranks' reduce_scatters (the same bytes move), every result is wrong, the step time is unchanged.
``--checkpoint-rank R --checkpoint-step S --checkpoint-s T``: rank R spends T s on the host at step S (writing
a checkpoint alone) while the others wait in the next collective. ``--host-slow-rank R --host-slow-s T``: rank
R waits T s on the host before each step's compute (a slow data loader: its GPU idles). ``--jitter J``: each
step's compute varies by up to ±J (fraction), drawn per rank.

``--emulate-pipe`` (CPU only) stands in for NCCL's dump pipe, which Gloo does not have: like
``ProcessGroupNCCL``'s watchdog it creates the FIFO ``$TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe``
(mkfifo 0666, opened O_RDONLY|O_NONBLOCK), reads it once a second, and on any byte writes its
flight-recorder dump (Gloo's, as a pickle) to ``$TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>`` in place.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time


def _pipe_watchdog(rank: int, torch_c10d: object) -> None:
    """NCCL's DumpPipe + dumpDebuggingInfo, for a Gloo job (see the module docstring)."""
    prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "")
    out = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "")
    if not prefix or not out or int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        return
    path = f"{prefix}{rank}.pipe"
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.mkfifo(path, 0o666)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    while True:
        time.sleep(1.0)
        try:
            data = os.read(fd, 128)
        except BlockingIOError:
            continue
        if data:
            trace = torch_c10d._dump_fr_trace(True, True, False)  # type: ignore[attr-defined]
            with open(f"{out}{rank}", "wb") as fh:  # in place, as torch's DebugInfoWriter does
                fh.write(trace)


def _checkpoint(seconds: float, rank: int) -> None:
    """What a rank writing a checkpoint does for ``seconds``: serialize tensors and write them to disk (CPU and
    I/O), as torch.save of a model's state does."""
    import tempfile

    import torch

    state = {f"layer{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB of float32
    end = time.monotonic() + seconds
    with tempfile.TemporaryDirectory(prefix=f"ckpt{rank}-") as folder:
        while time.monotonic() < end:
            torch.save(state, os.path.join(folder, "state.pt"))
            os.sync()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--steps", type=int, default=100, help="0: run until killed")
    ap.add_argument("--compute-s", type=float, default=0.02)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-step", type=int, default=-1)
    ap.add_argument("--mismatch-rank", type=int, default=-1)
    ap.add_argument("--mismatch-step", type=int, default=-1)
    ap.add_argument("--slow-rank", type=int, default=-1)
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--subgroup", action="store_true")
    ap.add_argument("--steps-out", default="")
    ap.add_argument("--emulate-pipe", action="store_true")
    ap.add_argument("--pattern", choices=("allreduce", "fsdp"), default="allreduce")
    ap.add_argument("--skip-rank", type=int, default=-1)
    ap.add_argument("--skip-step", type=int, default=-1)
    ap.add_argument("--checkpoint-rank", type=int, default=-1)
    ap.add_argument("--checkpoint-step", type=int, default=-1)
    ap.add_argument("--checkpoint-s", type=float, default=20.0)
    ap.add_argument("--host-slow-rank", type=int, default=-1)
    ap.add_argument("--host-slow-s", type=float, default=0.0)
    ap.add_argument("--jitter", type=float, default=0.0)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = args.backend == "nccl"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if args.emulate_pipe:
        threading.Thread(target=_pipe_watchdog, args=(rank, torch._C._distributed_c10d), daemon=True).start()
    sub = dist.new_group(list(range(world))) if args.subgroup else None
    grad = torch.ones(args.size, device=device)
    a = torch.randn(2048, 2048, device=device) if gpu else None
    iters = 1
    if gpu and a is not None:  # matmuls per step sized to --compute-s
        for _ in range(3):  # cuBLAS's first call (handle, workspace, kernel choice) is not a step's cost
            a @ a
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
        iters = max(1, round(args.compute_s / ((time.perf_counter() - t) / 20)))
        # One loop size for all ranks (rank 0's): sized per rank, a first-call cuBLAS warm-up made rank 0's
        # loop ~6x rank 1's in a recorded run, and the planted 1.3x rank was not the slow one.
        sized = torch.tensor([iters], device=device)
        dist.broadcast(sized, src=0)
        iters = int(sized.item())
    factor = args.slow_factor if rank == args.slow_rank else 1.0
    rng = random.Random(rank * 7919 + 17)
    shard = torch.ones(args.size, device=device)
    gathered = torch.empty(args.size * world, device=device)
    step = 0
    last = time.time()
    steps_out = open(args.steps_out, "a", buffering=1 << 16) if rank == 0 and args.steps_out else None  # noqa: SIM115
    print(f"rank {rank}/{world} pid {os.getpid()} ready iters {iters}", flush=True)
    while args.steps == 0 or step < args.steps:
        if rank == args.hang_rank and step == args.hang_step:
            print(f"rank {rank} hangs at step {step} t={time.time():.3f}", flush=True)
            while True:
                time.sleep(3600)  # the host is stuck: no more collectives from this rank
        if rank == args.host_slow_rank and args.host_slow_s > 0:
            time.sleep(args.host_slow_s)  # the data loader: the host is late, the GPU idles
        if args.pattern == "fsdp":
            for _ in range(3):
                dist.all_gather_into_tensor(gathered, shard)
        jitter = 1.0 + (rng.uniform(-args.jitter, args.jitter) if args.jitter else 0.0)
        if gpu and a is not None:
            for _ in range(max(1, round(iters * factor * jitter))):
                a @ a
        else:
            time.sleep(args.compute_s * factor * jitter)
        if args.pattern == "fsdp":
            for k in range(3):
                if rank == args.skip_rank and step == args.skip_step and k == 1:
                    print(f"rank {rank} skips a reduce_scatter at step {step} t={time.time():.3f}", flush=True)
                    continue
                dist.reduce_scatter_tensor(shard, gathered)
            if gpu:
                torch.cuda.synchronize()
            shard.fill_(1.0)  # keep values bounded: wrong results are the fault under test, not overflow
        elif rank == args.mismatch_rank and step == args.mismatch_step:
            print(f"rank {rank} broadcasts instead at step {step} t={time.time():.3f}", flush=True)
            dist.broadcast(grad, src=rank)
        else:
            dist.all_reduce(grad)
        if sub is not None:
            dist.all_reduce(grad, group=sub)
        if gpu:
            torch.cuda.synchronize()
        if rank == args.checkpoint_rank and step == args.checkpoint_step:
            print(f"rank {rank} checkpoints for {args.checkpoint_s:g} s at step {step} t={time.time():.3f}", flush=True)
            _checkpoint(args.checkpoint_s, rank)  # alone; the others already wait in the next collective
        now = time.time()
        if steps_out is not None:
            # one open file, flushed now and then: an open/close per step cost rank 0 ~2.8 ms a step on a
            # 2 x H200 VM and made it the job's straggler
            steps_out.write(json.dumps({"step": step, "t": now, "dt": now - last}) + "\n")
            if step % 100 == 0:
                steps_out.flush()
        last = now
        step += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
