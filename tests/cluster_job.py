"""One rank of a multi-node job on the cluster in one box (``tests/cluster.py`` starts it inside its node's
network namespace, like torchrun would: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment).

A training loop in miniature: ``compute`` seconds of "forward/backward" (a sleep: it holds whatever the
network does), then an all-reduce of ``numel`` floats over Gloo, each step timed by gpuhealth's ``Tracker``
and sent to the node's agent over its rank socket (``GPUHEALTH_SOCKET``). It runs until the stop file
exists (or ``max_s`` passed); every rank leaves after the same step.

Usage: python cluster_job.py STOP_FILE COMPUTE_S NUMEL MAX_S
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path


def main() -> int:
    stop, compute_s, numel, max_s = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    import torch
    import torch.distributed as dist

    from gpuhealth.instrument import Tracker

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=float(
        os.environ.get("CLUSTER_JOB_TIMEOUT_S", "300"))))
    tracker = Tracker(flush_interval_s=0.2, timing="cpu")
    tracker.wrap_collectives()
    grad = torch.ones(numel)
    deadline = time.monotonic() + max_s
    steps = 0
    while True:
        # The last element carries "stop" through the all-reduce itself: every rank leaves after the same step.
        grad.fill_(1.0)
        grad[-1] = 1.0 if stop.exists() or time.monotonic() > deadline else 0.0
        with tracker.step():
            time.sleep(compute_s)
            dist.all_reduce(grad)
        steps += 1
        if grad[-1].item() > 0:
            break
    tracker.close()
    print(f"rank {rank}: {steps} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
