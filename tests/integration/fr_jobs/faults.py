"""The fault modes of the flight-recorder job (job.py): what each one injects, who is to blame, and what
one step of the job does. No torch import at module level: the launcher and the fixture maker read the
table without starting torch.

Every mode has one line of doc saying the fault and the root cause, and :func:`expected` turns a run's
options into the answer triage must give. That answer comes from the fault injected here, never from what
gpuhealth prints.

Facts about torch 2.13's Gloo recorder that shape the answers (seen in the runs under tests/fixtures/flightrec/gloo_*):
- send/recv/isend/irecv/batch_isend_irecv leave NO flight-recorder entry on Gloo (they only advance
  ``op_id``), so on Gloo a p2p fault is seen only through the collectives around it; NCCL records them.
- ``_coalescing_manager`` coalesces all_reduce and all_gather_into_tensor on Gloo (one entry, several
  input sizes) but not broadcast (each broadcast is its own entry with its own sequence id); Gloo has no
  startCoalescing, so the manager is entered without a device there.
- Gloo lets an all_to_all_single whose split totals disagree, and a recv into a larger buffer than was sent,
  complete silently; a coalesced all_reduce of mismatched sizes aborts a rank (SIGABRT, "Received data size
  doesn't match expected size"), usually not the culprit, and that rank's dump is lost.
And of torch 2.11's NCCL recorder (tests/fixtures/flightrec/nccl_*gpu): p2p entries are named with group-local
ranks ("send 0->1" in group [2, 3]); the send/recv entries of a batch_isend_irecv and the ops of a coalesced
broadcast stay "scheduled" for good and only the block's "nccl:coalesced" end marker completes; non-root ranks
of gather/scatter record output [[0]] of dtype UNKNOWN_SCALAR; mismatched sizes hang instead of completing.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FOREVER_S = 3600.0  # a host-side hang: the launcher kills the process long before this ends


@dataclass(frozen=True)
class Mode:
    doc: str  # the injected fault and the root cause, in one line
    hangs: bool  # the job stops making progress (the launcher dumps on the stall)
    backends: tuple[str, ...] = ("gloo", "nccl")
    default_culprit: Callable[[int], int] = lambda world: world - 1
    min_world: int = 2


MODES: dict[str, Mode] = {
    "healthy": Mode("nothing wrong. Root: none.", hangs=False),
    "hang_skip": Mode("the culprit skips the world all_reduce of one step (and finishes early). Root: the culprit.",
                      hangs=True),
    "hang_sleep": Mode("the culprit sleeps (host stuck) between its TP and world all_reduce. Root: the culprit.",
                       hangs=True),
    "subgroup_hang": Mode("the culprit sleeps before its TP all_reduce: its TP peer waits in the TP group, the "
                          "others in the world group. Root: the culprit.", hangs=True),
    "subgroup_skip": Mode("the culprit skips its TP all_reduce and goes on to the world all_reduce. "
                          "Root: the culprit.", hangs=True),
    "type_mismatch": Mode("the culprit calls all_gather where the others call all_reduce. Root: the culprit.",
                          hangs=True),
    "size_mismatch": Mode("the culprit (a broadcast leaf) broadcasts twice the size of the others' tensor; Gloo "
                          "lets it pass. Root: the culprit.", hangs=False),
    "dtype_mismatch": Mode("the culprit all_reduces int32 where the others use float32 (same bytes, passes "
                           "silently). Root: the culprit.", hangs=False),
    "straggler": Mode("the culprit does --straggler-factor x the compute of the others from --fault-step on. "
                      "Root: the culprit.", hangs=False),
    "pipeline_healthy": Mode("a healthy pipeline chain 0->1->...->W-1 of send/recv plus a world all_reduce per step. "
                             "Root: none.", hangs=False),
    "pipeline_hang": Mode("pipeline chain of send/recv; at the fault step the culprit (default rank 1) receives from "
                          "its predecessor but never sends to its successor (host stuck). Root: the culprit.",
                          hangs=True, default_culprit=lambda world: 1, min_world=3),
    "pipeline_batch_hang": Mode("the chain with batch_isend_irecv (one P2POp list per step, as 1F1B pipelines); at "
                                "the fault step the culprit (default rank 1) posts only its irecv, never its isend, "
                                "and goes on to the world all_reduce. Root: the culprit.", hangs=True,
                                default_culprit=lambda world: 1, min_world=3),
    "pipeline_batch_healthy": Mode("a healthy chain with batch_isend_irecv (NCCL leaves the batch's send/recv entries "
                                   "'scheduled' for good; only the batch's end marker completes). Root: none.",
                                   hangs=False, min_world=3),
    "coalesced_mismatch": Mode("two broadcasts inside _coalescing_manager; at the fault step the culprit's first "
                               "one is [5,5] where the others use [4,4] (3-to-1 majority at 4 ranks). Gloo does "
                               "not coalesce broadcasts (two entries, two seq ids). Root: the culprit.", hangs=False),
    "coalesced_allreduce_mismatch": Mode("two all_reduces inside _coalescing_manager (Gloo and NCCL coalesce them "
                                         "into one op); at the fault step the culprit's first tensor is [5,5] where "
                                         "the others use [4,4]. Root: the culprit.", hangs=True),
    "coalesced_hang": Mode("the culprit stops (host stuck) inside a _coalescing_manager all_reduce group after its "
                           "first op, before the group is flushed. Root: the culprit.", hangs=True),
    "fsdp_healthy": Mode("healthy FSDP-like step: coalesced all_gather_into_tensor of two shards, "
                         "reduce_scatter_tensor, all_reduce (Gloo records the coalesced all_gather with only the "
                         "first output). Root: none.", hangs=False),
    "gather_healthy": Mode("healthy: dist.gather to rank 0 every step (non-root ranks record output_sizes []). "
                           "Root: none.", hangs=False),
    "scatter_healthy": Mode("healthy: dist.scatter from rank 0 every step (non-root ranks record input_sizes []). "
                            "Root: none.", hangs=False),
    "alltoall_uneven_healthy": Mode("healthy: all_to_all_single with uneven input/output splits that agree across "
                                    "ranks. Root: none.", hangs=False),
    "alltoall_split_mismatch": Mode("all_to_all_single with 4 elements to each peer; at the fault step the culprit's "
                                    "output_split_sizes expect 2 more from one peer (16 in, 18 out for 4 ranks). "
                                    "Gloo completes it silently (NCCL may hang). Root: the culprit.", hangs=False),
    "broadcast_then_stall": Mode("at the fault step the culprit (a broadcast leaf) passes a larger broadcast tensor "
                                 "(completes silently on Gloo); 3 steps later it sleeps (the job stalls). Root to "
                                 "report first: the mismatch, on the culprit.", hangs=True),
    "send_recv_size_mismatch": Mode("rank 0 sends a [4] tensor to rank 1 every step; at the fault step the culprit "
                                    "(rank 1, the receiver) posts its recv with an [8] buffer. Root: the receiver "
                                    "(it changed; the pair exchanged [4] on both sides every step before).",
                                    hangs=True, default_culprit=lambda world: 1),
    "recv_any_source": Mode("every step rank 1 collects one message with dist.recv(t) (no src) and rank 0 (the "
                            "producer) sends it; at the fault step rank 0 skips its send and goes on. Root: rank 0 "
                            "(the rank that should have sent). Gloo only (NCCL has no any-source recv).",
                            hangs=True, backends=("gloo",), default_culprit=lambda world: 0),
    "rank_exit": Mode("the culprit's process exits (os._exit) at the fault step before its world all_reduce: it "
                      "leaves no dump. Root: the culprit.", hangs=True),
    "tp_pp_dp_skip": Mode("TP x PP x DP layout (TP=--tp-size, PP=--pp-size, DP the rest); the culprit skips its DP "
                          "all_reduce of one step and goes on to the world all_reduce. Root: the culprit.",
                          hangs=True, min_world=4),
}
# Modes whose step logic is the original TP + world all_reduce step (see base_step).
BASE_MODES = ("healthy", "hang_skip", "hang_sleep", "subgroup_hang", "subgroup_skip", "type_mismatch",
              "size_mismatch", "dtype_mismatch", "straggler", "broadcast_then_stall", "rank_exit")
HANG_MODES = tuple(m for m, spec in MODES.items() if spec.hangs)


def culprit_of(mode: str, world: int, culprit: int) -> int:
    return culprit if culprit >= 0 else MODES[mode].default_culprit(world)


# ------------------------------------------------------------------------------------------ the answers


def tp_group_name(rank: int, tp_size: int) -> str:
    # Groups are named by creation order: "0" is the world, TP blocks are created first ("1", "2", …).
    return str(rank // tp_size + 1)


def layout(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """TP x PP x DP: rank = dp * (pp * tp) + stage * tp + t. Returns the groups of each kind."""
    dp = world // (tp * pp)
    tp_groups = [list(range(i, i + tp)) for i in range(0, world, tp)]
    pp_groups = [[d * pp * tp + s * tp + t for s in range(pp)] for d in range(dp) for t in range(tp)]
    dp_groups = [[d * pp * tp + s * tp + t for d in range(dp)] for s in range(pp) for t in range(tp)]
    return {"tp": tp_groups, "pp": pp_groups, "dp": dp_groups}


def expected(mode: str, *, world: int, culprit: int, backend: str, tp_size: int = 2, pp_size: int = 2,
             straggler_factor: float = 2.0) -> dict[str, Any]:
    """The answer triage must give for one run, from the fault injected (see each mode's doc).

    Keys: verdict, root_ranks, root_code, group, why; ``also_acceptable`` (ranks a correct analyser may name
    instead of or beside the root when the dumps cannot tell them apart, with ``acceptable_why``) and
    ``allowed_consequences`` (ranks that may be named at warning or above as consequences) when needed."""
    c = culprit_of(mode, world, culprit)
    spec = MODES[mode]
    out: dict[str, Any] = {"verdict": "hang", "root_ranks": [c], "root_code": "collective.missing_rank",
                           "group": "0", "why": f"rank {c}: {spec.doc}"}
    if mode == "healthy" or mode.endswith("_healthy"):
        out.update(verdict="healthy", root_ranks=[], root_code=None, group=None, why=spec.doc)
    elif mode in ("subgroup_hang", "subgroup_skip"):
        out["group"] = tp_group_name(c, tp_size)
    elif mode == "type_mismatch":
        out.update(verdict="mismatch", root_code="collective.type_mismatch")
    elif mode in ("size_mismatch", "coalesced_mismatch", "coalesced_allreduce_mismatch", "broadcast_then_stall",
                  "alltoall_split_mismatch"):
        out.update(verdict="mismatch", root_code="collective.size_mismatch")
    elif mode == "dtype_mismatch":
        out.update(verdict="mismatch", root_code="collective.dtype_mismatch")
    elif mode == "straggler":
        out.update(verdict="straggler", root_code="rank.straggler", group=None,
                   why=f"rank {c} does {straggler_factor:g}x the compute of the others from the fault step on")
    elif mode == "rank_exit":
        out.update(verdict="incomplete", root_code="flightrec.dump_missing")
    elif mode in ("pipeline_hang", "pipeline_batch_hang"):
        out["root_code"] = "collective.p2p_unmatched"
    elif mode == "send_recv_size_mismatch":
        out.update(verdict="mismatch", root_code="p2p.size_mismatch")
    elif mode == "recv_any_source":
        out["root_code"] = "collective.p2p_unmatched"
    elif mode == "tp_pp_dp_skip":
        groups = layout(world, tp_size, pp_size)
        n_tp = len(groups["tp"])
        n_pp = len(groups["pp"])
        dp_index = next(i for i, g in enumerate(groups["dp"]) if c in g)
        out["group"] = str(1 + n_tp + n_pp + dp_index)
    if mode in ("size_mismatch", "broadcast_then_stall") and world == 2:
        # One broadcast, two ranks: no majority, no earlier broadcast to compare with, and the recorder does
        # not say which rank was the source. Either side may be named (as long as the verdict is a mismatch).
        out["also_acceptable"] = [r for r in range(2) if r != c]
        out["acceptable_why"] = "a 2-rank broadcast seen once: no majority, no history, no recorded source"
    if backend == "gloo":
        _gloo_limits(mode, out, world, c)
    return out


def _gloo_limits(mode: str, out: dict[str, Any], world: int, c: int) -> None:
    """Where Gloo's dumps cannot show the root (no p2p entries), say which ranks the evidence allows."""
    if mode == "pipeline_hang":
        # Ranks c..W-1 all stopped before the world all_reduce; only the missing p2p entries would tell
        # the stuck rank from those waiting in recv behind it. Rank 0..c-1 went on: never a culprit.
        out["also_acceptable"] = list(range(c + 1, world))
    elif mode == "pipeline_batch_hang":
        # The culprit went on to the world all_reduce; the rank after it waits in an unrecorded irecv and
        # looks as if it never reached the all_reduce (its own isend was posted, so later ranks go on).
        out["also_acceptable"] = [c + 1]
    elif mode == "recv_any_source":
        # The receiver waits in an unrecorded recv and looks as if it never reached the all_reduce.
        out["also_acceptable"] = [1]
    elif mode == "send_recv_size_mismatch":
        # Gloo raises on the receiver ("Received data size doesn't match") or hangs; with no p2p entries the
        # receiver is the rank missing from the next world all_reduce.
        out.update(verdict="hang", root_code="collective.missing_rank")
    else:
        return
    out["acceptable_why"] = ("torch 2.13's Gloo records no send/recv in the flight recorder: the dumps cannot "
                             "separate the root from the ranks blocked in p2p behind it")


# ------------------------------------------------------------------------------------------- the steps


@dataclass
class Ctx:
    """What one rank's step function needs (torch objects are typed Any: this module never imports torch)."""

    args: Any
    dist: Any
    torch: Any
    rank: int
    world: int
    device: Any
    nccl: bool
    culprit: int
    groups: dict[str, Any]  # "tp", and for tp_pp_dp_skip "pp_peer_ranks", "dp"
    wait_comm: Callable[[], None]
    busy: Callable[[float], None]  # the backend's way of spending compute time
    compute_time: float = 0.0  # seconds of compute in the current step (for the step record)
    rng: random.Random = field(default_factory=random.Random)
    tensors: dict[str, Any] = field(default_factory=dict)

    @property
    def me(self) -> bool:
        return self.rank == self.culprit

    def fault(self, step: int) -> bool:
        return self.me and step == self.args.fault_step

    def ones(self, *shape: int, dtype: Any = None) -> Any:
        return self.torch.ones(*shape, device=self.device, dtype=dtype)

    def compute(self, step: int, scale: float = 1.0) -> None:
        seconds = self.args.compute_s * scale
        if self.args.jitter:
            seconds *= 1.0 + self.rng.uniform(-self.args.jitter, self.args.jitter)
        if self.args.mode == "straggler" and self.me and step >= self.args.fault_step:
            seconds *= self.args.straggler_factor
        t0 = time.perf_counter()
        self.busy(seconds)
        self.compute_time += time.perf_counter() - t0


def hang_forever() -> None:
    time.sleep(FOREVER_S)


def base_step(ctx: Ctx, step: int) -> None:
    """Compute, TP all_reduce, world all_reduce: the step of the original modes."""
    dist, torch, mode = ctx.dist, ctx.torch, ctx.args.mode
    grad, small = ctx.tensors["grad"], ctx.tensors["small"]
    ctx.compute(step)
    fault = ctx.fault(step)
    if fault and mode == "subgroup_hang":
        hang_forever()
    if not (fault and mode == "subgroup_skip"):
        dist.all_reduce(small, group=ctx.groups["tp"])
    if fault and mode == "hang_sleep":
        hang_forever()
    if ctx.me and mode == "broadcast_then_stall" and step == ctx.args.fault_step + 3:
        hang_forever()
    if fault and mode == "rank_exit":
        os._exit(17)
    if fault and mode == "hang_skip":
        return  # skips the world all_reduce of this step
    if fault and mode == "type_mismatch":
        dist.all_gather([torch.empty_like(grad) for _ in range(ctx.world)], grad)
    elif fault and mode == "dtype_mismatch":
        dist.all_reduce(grad.to(torch.int32))
    elif mode in ("size_mismatch", "broadcast_then_stall") and step == ctx.args.fault_step:
        n = ctx.args.numel * 2 if ctx.me else ctx.args.numel
        dist.broadcast(ctx.ones(n), src=0)
    else:
        dist.all_reduce(grad)
        grad.fill_(1.0)


def pipeline_step(ctx: Ctx, step: int) -> None:
    """Forward micro-batch along 0->1->...->W-1 with blocking send/recv, then a world all_reduce."""
    dist, rank, world = ctx.dist, ctx.rank, ctx.world
    act = ctx.tensors["act"]
    if rank > 0:
        dist.recv(act, src=rank - 1)
        ctx.wait_comm()  # NCCL's recv returns at once: wait here, or the wait is timed as compute
    ctx.compute(step)
    if ctx.fault(step) and ctx.args.mode == "pipeline_hang":
        hang_forever()
    if rank < world - 1:
        dist.send(act, dst=rank + 1)
    _world_all_reduce(ctx)


def pipeline_batch_step(ctx: Ctx, step: int) -> None:
    """The chain with one batch_isend_irecv per step (irecv from the previous stage, isend to the next)."""
    dist, rank, world = ctx.dist, ctx.rank, ctx.world
    ops = []
    if rank > 0:
        ops.append(dist.P2POp(dist.irecv, ctx.tensors["act_in"], rank - 1))
    if rank < world - 1 and not (ctx.fault(step) and ctx.args.mode == "pipeline_batch_hang"):
        ops.append(dist.P2POp(dist.isend, ctx.tensors["act"], rank + 1))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ctx.wait_comm()
    ctx.compute(step)
    _world_all_reduce(ctx)


def _world_all_reduce(ctx: Ctx) -> None:
    grad = ctx.tensors["grad"]
    ctx.dist.all_reduce(grad)
    grad.fill_(1.0)


def _coalescing_manager(ctx: Ctx) -> Any:
    from torch.distributed.distributed_c10d import _coalescing_manager as manager

    # Gloo has no startCoalescing: without a device the manager batches the ops it can (all_reduce,
    # all_gather_into_tensor, reduce_scatter_tensor) and runs the others one by one.
    return manager(device=ctx.device if ctx.nccl else None, async_ops=True)


def coalesced_step(ctx: Ctx, step: int) -> None:
    """Two ops inside one _coalescing_manager block (broadcasts or all_reduces by mode), then a world all_reduce."""
    dist, mode = ctx.dist, ctx.args.mode
    ctx.compute(step)
    first = ctx.ones(5, 5) if ctx.fault(step) and mode != "coalesced_hang" else ctx.ones(4, 4)
    with _coalescing_manager(ctx) as cm:
        if mode == "coalesced_mismatch":
            dist.broadcast(first, src=0)
            dist.broadcast(ctx.ones(7), src=0)
        else:
            dist.all_reduce(first)
            if ctx.fault(step) and mode == "coalesced_hang":
                hang_forever()
            dist.all_reduce(ctx.ones(7))
    cm.wait()
    ctx.wait_comm()
    _world_all_reduce(ctx)


def fsdp_step(ctx: Ctx, step: int) -> None:
    """All-gather two parameter shards (coalesced), compute, reduce-scatter the gradient, all_reduce a scalar."""
    dist, torch, world = ctx.dist, ctx.torch, ctx.world
    full_a = torch.empty(world * 3, device=ctx.device)
    full_b = torch.empty(world * 5, device=ctx.device)
    with _coalescing_manager(ctx) as cm:
        dist.all_gather_into_tensor(full_a, ctx.ones(3))
        dist.all_gather_into_tensor(full_b, ctx.ones(5))
    cm.wait()
    ctx.wait_comm()
    ctx.compute(step)
    shard = torch.empty(3, device=ctx.device)
    dist.reduce_scatter_tensor(shard, ctx.ones(world * 3))
    dist.all_reduce(ctx.tensors["small"])


def gather_step(ctx: Ctx, step: int) -> None:
    dist, torch = ctx.dist, ctx.torch
    ctx.compute(step)
    if ctx.args.mode == "gather_healthy":
        bucket = [torch.empty(4, device=ctx.device) for _ in range(ctx.world)] if ctx.rank == 0 else None
        dist.gather(ctx.ones(4), bucket, dst=0)
    else:
        pieces = [ctx.ones(4) for _ in range(ctx.world)] if ctx.rank == 0 else None
        dist.scatter(torch.empty(4, device=ctx.device), pieces, src=0)
    _world_all_reduce(ctx)


def alltoall_splits(rank: int, world: int, mode: str) -> tuple[list[int], list[int]]:
    """(input_split_sizes, output_split_sizes) of ``rank`` in a healthy step."""
    if mode == "alltoall_uneven_healthy":
        # rank r sends 1 + (r + 2j) % W elements to rank j; so it receives 1 + (j + 2r) % W from rank j.
        return [1 + (rank + 2 * j) % world for j in range(world)], [1 + (j + 2 * rank) % world for j in range(world)]
    return [4] * world, [4] * world


def alltoall_step(ctx: Ctx, step: int) -> None:
    torch = ctx.torch
    ctx.compute(step)
    ins, outs = alltoall_splits(ctx.rank, ctx.world, ctx.args.mode)
    if ctx.fault(step) and ctx.args.mode == "alltoall_split_mismatch":
        outs = list(outs)
        outs[(ctx.rank + 1) % ctx.world] += 2  # expects 2 more elements than its peer sends
    out = torch.empty(sum(outs), device=ctx.device)
    ctx.dist.all_to_all_single(out, ctx.ones(sum(ins)), output_split_sizes=outs, input_split_sizes=ins)
    ctx.wait_comm()
    _world_all_reduce(ctx)


def send_recv_step(ctx: Ctx, step: int) -> None:
    """Rank 0 sends a [4] tensor to rank 1 each step (recv_any_source: rank 1 receives from any source)."""
    dist, mode = ctx.dist, ctx.args.mode
    ctx.compute(step)
    if ctx.rank == 0 and not (mode == "recv_any_source" and ctx.fault(step)):
        dist.send(ctx.ones(4), dst=1)
    elif ctx.rank == 1:
        buf = ctx.ones(8) if mode == "send_recv_size_mismatch" and ctx.fault(step) else ctx.ones(4)
        if mode == "recv_any_source":
            dist.recv(buf)
        else:
            dist.recv(buf, src=0)
    ctx.wait_comm()
    _world_all_reduce(ctx)


def tp_pp_dp_step(ctx: Ctx, step: int) -> None:
    """Stage s receives activations from stage s-1 of its pipeline, computes, sends to stage s+1; a TP
    all_reduce in the stage, a DP all_reduce of the gradient, a world all_reduce of the loss."""
    dist = ctx.dist
    prev_rank, next_rank = ctx.groups["pp_prev"], ctx.groups["pp_next"]
    act = ctx.tensors["act"]
    if prev_rank is not None:
        dist.recv(act, src=prev_rank, group=ctx.groups["pp"])
        ctx.wait_comm()
    ctx.compute(step)
    dist.all_reduce(ctx.tensors["small"], group=ctx.groups["tp"])
    if next_rank is not None:
        dist.send(act, dst=next_rank, group=ctx.groups["pp"])
    if not ctx.fault(step):
        dist.all_reduce(ctx.tensors["grad"], group=ctx.groups["dp"])
    dist.all_reduce(ctx.ones(1))
    ctx.wait_comm()


STEP_FUNCTIONS: dict[str, Callable[[Ctx, int], None]] = {
    **{m: base_step for m in BASE_MODES},
    "pipeline_healthy": pipeline_step, "pipeline_hang": pipeline_step,
    "pipeline_batch_hang": pipeline_batch_step, "pipeline_batch_healthy": pipeline_batch_step,
    "coalesced_mismatch": coalesced_step, "coalesced_allreduce_mismatch": coalesced_step,
    "coalesced_hang": coalesced_step,
    "fsdp_healthy": fsdp_step,
    "gather_healthy": gather_step, "scatter_healthy": gather_step,
    "alltoall_uneven_healthy": alltoall_step, "alltoall_split_mismatch": alltoall_step,
    "send_recv_size_mismatch": send_recv_step, "recv_any_source": send_recv_step,
    "tp_pp_dp_skip": tp_pp_dp_step,
}
assert set(STEP_FUNCTIONS) == set(MODES)
