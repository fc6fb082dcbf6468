"""A small real training job for ``gpuhealth demo --job``: 4 ranks, PyTorch Gloo on the CPU, the
``gpuhealth.instrument.Tracker`` hook in the loop, and one rank doing twice the compute of the others
(a straggler that wall step times cannot show: every rank waits at the all-reduce).

Run as ``python -m gpuhealth.demo_job`` with RANK, WORLD_SIZE, GPUHEALTH_SOCKET, GPUHEALTH_JOB_ID and
either GPUHEALTH_DEMO_INIT (a ``file://`` rendezvous: ``gpuhealth demo --job`` uses one, so no port is
chosen before it is bound) or MASTER_ADDR and MASTER_PORT set. Needs torch.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta


def train(steps: int, straggler: int, size: int = 128, gpu_time_s: float = 0.02) -> None:
    """``gpu_time_s`` stands in for the GPU kernels of a step: on a real GPU the host thread sits idle
    while they run, so a sleep keeps 4 ranks on a 2-core CI box from competing for CPUs (which would
    make every rank look slow in turn and hide the one we slowed down)."""
    import time

    import torch
    import torch.distributed as dist

    from gpuhealth.instrument import Tracker

    rank = int(os.environ["RANK"])
    init = os.environ.get("GPUHEALTH_DEMO_INIT")
    if init:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    weight = torch.randn(size, size)
    batch = torch.randn(size, size)
    repeats = 2 if rank == straggler else 1  # the straggler: twice the compute per step
    tracker = Tracker(flush_interval_s=0.2)
    for _ in range(steps):
        with tracker.step():
            grad = weight
            for _ in range(repeats):
                grad = torch.tanh(batch @ grad)
                time.sleep(gpu_time_s)
            with tracker.collective():
                dist.all_reduce(grad)
            weight = weight - 1e-3 * grad / dist.get_world_size()
    tracker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    train(int(sys.argv[1]) if len(sys.argv) > 1 else 60, int(sys.argv[2]) if len(sys.argv) > 2 else 2)
