"""One rank of the fabric probe (imports torch: runs only in the diagnostics child).

Every rank runs the same schedule (``fabric.schedule``); in each round it meets its partner, if it has
one, and the pair measures: a round trip of a small message, bandwidth lower→higher, then
higher→lower. A barrier ends each round so rounds never overlap. Rank 0 gathers everything.

Transport: ``gloo`` on CPU tensors (tests, and any cluster's TCP path), ``nccl`` on one GPU per rank —
one rank per GPU/NIC rail, so ``NCCL_IB_HCA`` / the GPU↔NIC affinity pins each rank to its rail.
The two differ only in where the buffers live and that CUDA work must be synchronised before the
clock stops (``_Transport``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any

from gpuhealth.diag.fabric import Measurements, Thresholds, rtt_suspects, schedule, suspects_of


@dataclass(frozen=True)
class ProbePlan:
    size_bytes: int = 4 << 20
    iters: int = 3
    warmup: int = 1
    rtt_iters: int = 5
    schedule: str = "full"
    retest: int = 16  # directions first measured slow that are measured again, alone (0: none)
    slow_fraction: float = 0.6
    latency_floor_us: float = 500.0


class _Transport:
    """Point-to-point on the chosen backend: buffers on the rank's device, a clock that waits for it."""

    def __init__(self, torch: Any, dist: Any, device: Any) -> None:
        self.torch, self.dist, self.device = torch, dist, device
        self.cuda = device.type == "cuda"

    def buffer(self, nbytes: int) -> Any:
        return self.torch.empty(max(1, nbytes), dtype=self.torch.uint8, device=self.device)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def send(self, t: Any, dst: int) -> None:
        self.dist.send(t, dst)

    def recv(self, t: Any, src: int) -> None:
        self.dist.recv(t, src)


def _direction(tp: _Transport, me: int, src: int, dst: int, big: Any, token: Any, plan: ProbePlan) -> float | None:
    """Bandwidth src→dst in bytes/s on the sender (None on the receiver): each message timed from its
    send to the receiver's acknowledgement, the best of ``plan.iters`` kept — CPU scheduling only ever
    slows one message down, while a slow link slows every one (warm-up messages drain a shaper's burst)."""
    if me == dst:
        for _ in range(plan.warmup + plan.iters):
            tp.recv(big, src)
            tp.sync()
            tp.send(token, src)  # ack: this message arrived whole
        return None
    best = 0.0
    for i in range(plan.warmup + plan.iters):
        t0 = time.perf_counter()
        tp.send(big, dst)
        tp.recv(token, dst)
        tp.sync()
        if i >= plan.warmup:
            best = max(best, big.numel() / max(time.perf_counter() - t0, 1e-9))
    return best


def _rtt_us(tp: _Transport, me: int, peer: int, token: Any, plan: ProbePlan) -> float | None:
    samples = []
    for _ in range(plan.rtt_iters + 1):
        if me < peer:
            t0 = time.perf_counter()
            tp.send(token, peer)
            tp.recv(token, peer)
            tp.sync()
            samples.append((time.perf_counter() - t0) * 1e6)
        else:
            tp.recv(token, peer)
            tp.send(token, peer)
    return min(samples[1:]) if len(samples) > 1 else None  # noise only ever adds: the fastest is the link's


def measure(torch: Any, dist: Any, device: Any, rank: int, world: int, plan: ProbePlan
            ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float], list[float]]:
    """This rank's part: bandwidth of its own sends, round trips it timed, and each round's wall time."""
    tp = _Transport(torch, dist, device)
    big, token = tp.buffer(plan.size_bytes), tp.buffer(8)
    bw: dict[tuple[int, int], float] = {}
    rtt: dict[tuple[int, int], float] = {}
    round_s: list[float] = []
    for pairs in schedule(world, plan.schedule):
        t0 = time.perf_counter()
        partner = next((b if a == rank else a for a, b in pairs if rank in (a, b)), None)
        if partner is not None:
            lo, hi = min(rank, partner), max(rank, partner)
            r = _rtt_us(tp, rank, partner, token, plan)
            if r is not None:
                rtt[(lo, hi)] = r
            for src, dst in ((lo, hi), (hi, lo)):
                v = _direction(tp, rank, src, dst, big, token, plan)
                if v is not None:
                    bw[(src, dst)] = v
        dist.barrier()
        round_s.append(time.perf_counter() - t0)
    return bw, rtt, round_s


def run_rank(plan: ProbePlan, *, node: str, backend: str | None = None, init_method: str = "env://",
             every_rank: bool = False) -> dict[str, Any] | None:
    """One rank (under torchrun/srun with RANK, WORLD_SIZE, LOCAL_RANK set, or launched locally).
    Returns the document (names, measurements, round times, this rank's name) on rank 0 — on every rank
    with ``every_rank``: all of them hold the same measurements — else None."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
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
        name = node if local_world == 1 else f"{node}/{local}"  # one rank per GPU/NIC rail
        t0 = time.perf_counter()
        bw, rtt, round_s = measure(torch, dist, device, rank, world, plan)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (name, bw, rtt))
        m = Measurements([g[0] for g in gathered])
        for _, b, r in gathered:
            m.bandwidth.update(b)
            m.rtt_us.update(r)
        t1 = time.perf_counter()
        retested = retest(torch, dist, device, rank, m, plan)
        retest_s = time.perf_counter() - t1
        wall = time.perf_counter() - t0
    finally:
        dist.destroy_process_group()
    if rank != 0 and not every_rank:
        return None
    if len(set(m.names)) != len(m.names):  # several ranks claim one name (no --node in namespaces): tell them apart
        m.names = [f"{n}#{i}" for i, n in enumerate(m.names)]
    return {"measurements": m.to_dict(), "round_s": [round(s, 4) for s in round_s], "probe_s": round(wall, 3),
            "rank": rank, "rank_name": m.names[rank],
            "retested": [list(p) for p in retested], "retest_s": round(retest_s, 3),
            "backend": backend, "world": world, "plan": plan.__dict__}


def retest(torch: Any, dist: Any, device: Any, rank: int, m: Measurements, plan: ProbePlan,
           passes: int = 2) -> list[tuple[int, int]]:
    """Measure again, one at a time, the directions that look slow (at most ``plan.retest`` a pass) and keep
    the better reading: a busy host can stall one transfer in a round, a slow link stalls every one. A
    second pass looks at what still looks slow. Every rank holds the same measurements, so every rank picks
    the same list without a message."""
    th = Thresholds(latency_floor_us=plan.latency_floor_us)
    longer = replace(plan, iters=3 * plan.iters, rtt_iters=3 * plan.rtt_iters)  # alone, and longer
    tp = _Transport(torch, dist, device)
    big, token = tp.buffer(plan.size_bytes), tp.buffer(8)
    seen: list[tuple[int, int]] = []
    for _ in range(passes):
        suspects = suspects_of(m, plan.slow_fraction)[:plan.retest]
        slow_rtts = rtt_suspects(m, th)[:plan.retest]
        if not suspects and not slow_rtts:
            break
        for src, dst in suspects:
            if rank in (src, dst):
                v = _direction(tp, rank, src, dst, big, token, longer)
                if v is not None:
                    m.bandwidth[(src, dst)] = max(m.bandwidth[(src, dst)], v)
            dist.barrier()
        for lo, hi in slow_rtts:
            if rank in (lo, hi):
                r = _rtt_us(tp, rank, hi if rank == lo else lo, token, longer)
                if r is not None:
                    m.rtt_us[(lo, hi)] = min(m.rtt_us[(lo, hi)], r)
            dist.barrier()
        # the senders (the lower rank for a round trip) updated their own readings: share them with everyone
        updates: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(updates, ({p: m.bandwidth[p] for p in suspects if p[0] == rank},
                                         {p: m.rtt_us[p] for p in slow_rtts if p[0] == rank}))
        for bw, rtt in updates:
            m.bandwidth.update(bw)
            m.rtt_us.update(rtt)
        seen += [p for p in (*suspects, *slow_rtts) if p not in seen]
    return seen


__all__ = ["ProbePlan", "measure", "run_rank"]
