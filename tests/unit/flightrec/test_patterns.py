"""Triage on the collective patterns PyTorch emits (issue 12): p2p chains and batches, coalesced groups,
gather/scatter, all_to_all splits, groups sharing a name, unreadable dumps, a silent mismatch followed
by a stall, and self-inconsistent records. Dumps are built in the real format (frbuild), one shape per
test; real jobs of the same shapes are in test_fixture_corpus.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from frbuild import dump, entry, write_json

from gpuhealth.flightrec.report import RootKind
from gpuhealth.flightrec.verdict import triage

T0 = 1_700_000_000_000_000_000


class Rank:
    """Builds one rank's entries in record order with per-group sequence counters, NCCL style: a p2p op
    carries the group's current collective sequence id (not a new one) and its own p2p sequence id."""

    def __init__(self, rank: int, backend: str = "nccl") -> None:
        self.rank = rank
        self.backend = backend
        self.entries: list[dict[str, Any]] = []
        self.coll: dict[str, int] = {}
        self.p2p: dict[str, int] = {}

    def _rid(self) -> int:
        return len(self.entries)

    def coll_op(self, op: str = "all_reduce", *, group: str = "0", sizes: Any = ((1024,),), out: Any = None,
                dtype: str = "Float", state: str = "completed", same_seq: bool = False, pg_id: int | None = None,
                out_dtype: str | None = None) -> None:
        if not same_seq:
            self.coll[group] = self.coll.get(group, 0) + 1
        seq = self.coll.get(group, 0)
        e = entry(seq, record_id=self._rid(), group=group, desc="default_pg" if group == "0" else "undefined",
                  pg_id=int(group) if pg_id is None and group.isdigit() else (pg_id or 0), op=op,
                  backend=self.backend, sizes=sizes, out_sizes=out, dtype=dtype, state=state,
                  created_ns=T0 + self._rid() * 1_000_000)
        if out_dtype is not None:
            e["output_dtypes"] = [out_dtype] * len(e["output_sizes"])
        self.entries.append(e)

    def p2p_op(self, kind: str, peer: int | str, *, group: str = "0", sizes: Any = ((4,),), state: str = "completed",
               batch: bool = False) -> None:
        if not batch:
            self.p2p[group] = self.p2p.get(group, 0) + 1
        arrow = f"{self.rank}->{peer}" if kind == "send" else f"{self.rank}<-{peer}"
        e = entry(self.p2p[group], record_id=self._rid(), group=group, desc="default_pg" if group == "0" else "x",
                  pg_id=0, op=kind, backend=self.backend, sizes=sizes, state=state, p2p=arrow,
                  created_ns=T0 + self._rid() * 1_000_000)
        e["collective_seq_id"] = self.coll.get(group, 0)
        self.entries.append(e)

    def batch_end(self, *, group: str = "0", state: str = "completed") -> None:
        e = entry(self.p2p[group], record_id=self._rid(), group=group, pg_id=0, op="coalesced", backend=self.backend,
                  sizes=(), state=state, p2p="", created_ns=T0 + self._rid() * 1_000_000)
        e["is_p2p"], e["collective_seq_id"], e["p2p_seq_id"] = True, self.coll.get(group, 0), self.p2p[group]
        self.entries.append(e)


def _write(tmp_path: Path, ranks: list[Rank], pg_config: dict[str, Any] | None = None) -> Path:
    world = len(ranks)
    cfg = pg_config or {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}}
    for r in ranks:
        write_json(tmp_path, f"rank{r.rank}.json", dump(r.entries, pg_config=cfg, status={}))
    return tmp_path


def _headline(rep):  # type: ignore[no-untyped-def]
    head = rep.headline
    assert head is not None, rep.summary
    return head.code, head.evidence.get("rank", head.evidence.get("ranks"))


def _steps(ranks: list[Rank], n: int) -> None:
    for _ in range(n):
        for r in ranks:
            r.coll_op()


# ------------------------------------------------------------------------------------------- p2p


def test_pipeline_chain_hang_blames_the_stage_that_never_sent(tmp_path: Path) -> None:
    # 0 -> 1 -> 2 -> 3 each step, then a world all_reduce. At the last step rank 1 received from 0 but
    # never sent to 2 (stuck on the host). NCCL is asynchronous: 2 has its send to 3 and the all_reduce
    # queued behind its pending recv; 3 waits in its recv; 0 went on to the all_reduce.
    ranks = [Rank(r) for r in range(4)]
    for step in range(4):
        last = step == 3
        ranks[0].p2p_op("send", 1)
        ranks[1].p2p_op("recv", 0)
        if not last:
            ranks[1].p2p_op("send", 2)
        ranks[2].p2p_op("recv", 1, state="scheduled" if last else "completed")
        ranks[2].p2p_op("send", 3, state="scheduled" if last else "completed")
        ranks[3].p2p_op("recv", 2, state="scheduled" if last else "completed")
        for r in ranks:
            if last and r.rank == 1:
                continue
            r.coll_op(state="started" if last and r.rank in (0,) else "scheduled" if last else "completed")
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "hang", rep.summary
    assert rep.culprits == [1], rep.summary
    root = rep.roots[0]
    assert root.ranks == (1,) and root.kind in (RootKind.HOST_STUCK, RootKind.P2P_UNMATCHED)
    assert set(root.affected_ranks) == {0, 2, 3}
    assert len([r for r in rep.roots if r.kind is not RootKind.BEHIND]) == 1  # 2 and 3 are consequences


def test_batched_p2p_where_one_rank_posts_only_its_recv(tmp_path: Path) -> None:
    # batch_isend_irecv: both ranks post [send to peer, recv from peer]; at the last step rank 1 posts only
    # its recv. Its recv is matched by rank 0's send, but rank 0's batch can never finish.
    ranks = [Rank(r) for r in range(2)]
    for step in range(3):
        last = step == 2
        for r in ranks:
            peer = 1 - r.rank
            st = "scheduled" if last else "completed"
            if not (last and r.rank == 1):
                r.p2p_op("send", peer, state=st)
                r.p2p_op("recv", peer, state=st, batch=True)
            else:
                r.p2p_op("recv", peer, state=st)
            r.batch_end(state=st)
        if not last:
            _steps(ranks, 1)
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "hang", rep.summary
    assert _headline(rep) == ("collective.p2p_unmatched", 1), rep.summary
    assert "no single culprit" not in rep.summary


def test_pending_send_and_recv_with_different_sizes_is_a_p2p_mismatch(tmp_path: Path) -> None:
    ranks = [Rank(r) for r in range(2)]
    for step in range(4):
        last = step == 3
        st = "started" if last else "completed"
        ranks[0].p2p_op("send", 1, sizes=((4,),), state=st)
        ranks[1].p2p_op("recv", 0, sizes=((8,),) if last else ((4,),), state=st)
        if not last:
            _steps(ranks, 1)
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "mismatch", rep.summary
    assert _headline(rep) == ("collective.size_mismatch", 1)  # the receiver departs from the pair's history
    assert rep.headline is not None and rep.headline.evidence["shape"] == "p2p"


def test_matched_pair_that_never_completes_is_a_stall(tmp_path: Path) -> None:
    ranks = [Rank(r) for r in range(2)]
    _steps(ranks, 3)
    ranks[0].p2p_op("send", 1, state="started")
    ranks[1].p2p_op("recv", 0, state="scheduled")
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "hang", rep.summary
    assert rep.roots[0].kind is RootKind.GPU_STALL
    assert rep.roots[0].ranks == (1,)  # the side that never started


def test_receive_from_any_source_is_parsed_and_blames_the_usual_sender(tmp_path: Path) -> None:
    ranks = [Rank(r) for r in range(3)]
    for step in range(3):
        last = step == 2
        if not last:
            ranks[2].p2p_op("send", 0)
        ranks[0].p2p_op("recv", "?" if last else 2, state="scheduled" if last else "completed")
        if not last:
            _steps(ranks, 1)
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "hang", rep.summary
    assert rep.culprits == [2], rep.summary  # it sent to 0 every step before; never the rank that waits


def test_a_batch_end_marker_whose_ops_fell_out_of_the_ring_buffer_is_not_a_collective(tmp_path: Path) -> None:
    # A 4-stage pipeline in one group, batch_isend_irecv each step, a world all_reduce after. The middle
    # stages post two ops per batch, so their ring buffers (cut to the same length) begin with the end
    # marker of a batch whose ops are gone. It carries the batch's p2p id and collective id 0: read as a
    # collective, it made group 1's "#1", which the end stages never ran (a false culprit, seen in a
    # synthetic pipeline case).
    ranks = [Rank(r) for r in range(4)]
    for _ in range(8):
        for r in ranks:
            if r.rank > 0:
                r.p2p_op("recv", r.rank - 1, group="1")
            if r.rank < 3:
                r.p2p_op("send", r.rank + 1, group="1", batch=r.rank > 0)  # the middle stages' batch of two
            r.batch_end(group="1")
            r.entries[-1]["is_p2p"] = False  # as NCCL records the end marker: not p2p, the batch's p2p id
            r.coll_op()
    for r in ranks:
        r.entries = r.entries[-18:]  # six steps of the end stages, four and a half of the middle ones
    assert {r.rank for r in ranks if r.entries[0]["profiling_name"] == "nccl:coalesced"} == {1, 2}
    rep = triage(_write(tmp_path, ranks, {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                                          "1": {"name": "1", "desc": "pp", "ranks": "[0, 1, 2, 3]"}}))
    assert rep.verdict.value == "healthy", rep.summary
    assert rep.roots == [], [r.why for r in rep.roots]


def test_a_batch_waiting_for_its_receive_does_not_blame_the_rank_that_took_its_send(tmp_path: Path) -> None:
    # A 4-stage pipeline in one group: stage k posts [recv from k-1, send to k+1] as one batch each step.
    # In the last step rank 0 never sends (stuck on the host). Rank 1's batch waits for that receive; its
    # send to rank 2 went through — rank 2's batch and rank 3's completed. NCCL never moves a batch's own
    # ops, so rank 1's send reads pending, and with ring buffers cut (long jobs) only pending ops pair:
    # rank 2 looked like it never posted its receive.
    ranks = [Rank(r) for r in range(4)]
    for step in range(8):
        last = step == 7
        for r in ranks:
            if last and r.rank == 0:
                continue
            if r.rank > 0:
                r.p2p_op("recv", r.rank - 1, group="1")
            if r.rank < 3:
                r.p2p_op("send", r.rank + 1, group="1", batch=r.rank > 0)
            r.batch_end(group="1", state="started" if last and r.rank == 1 else "completed")
            r.entries[-1]["is_p2p"] = False  # as NCCL records the end marker
    for r in ranks:
        r.entries = r.entries[-12:]  # a long job: every window cut by the ring buffer
    rep = triage(_write(tmp_path, ranks, {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                                          "1": {"name": "1", "desc": "pp", "ranks": "[0, 1, 2, 3]"}}))
    assert rep.verdict.value == "hang", rep.summary
    assert rep.culprits == [0], rep.summary


# ------------------------------------------------------------------------------------- collectives


def test_mismatch_inside_a_coalesced_group_is_found_by_majority(tmp_path: Path) -> None:
    # _coalescing_manager: two broadcasts share one sequence id, then NCCL's "coalesced" end marker.
    ranks = [Rank(r) for r in range(4)]
    _steps(ranks, 3)
    for r in ranks:
        st = "started"
        r.coll_op("broadcast", sizes=((4, 4),), state=st)
        r.coll_op("broadcast", sizes=((5, 5),) if r.rank == 2 else ((4, 4),), state=st, same_seq=True)
        r.coll_op("coalesced", sizes=(), state=st, same_seq=True)
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "mismatch", rep.summary
    assert _headline(rep) == ("collective.size_mismatch", 2)
    ev = rep.findings[0].evidence
    assert ev["shape"] == "coalesced" and ev["coalesced_index"] == 1 and ev["decided_by"] == "majority"


def test_healthy_gather_and_scatter_with_empty_non_root_buffers(tmp_path: Path) -> None:
    ranks = [Rank(r, backend="gloo") for r in range(4)]
    for _ in range(3):
        for r in ranks:
            root = r.rank == 0
            r.coll_op("gather", sizes=((2,),), out=((4, 2),) if root else (), state="scheduled")
            r.coll_op("scatter", sizes=((4, 2),) if root else (), out=((2,),), state="scheduled")
    for r in ranks:
        for e in r.entries:
            e["retired"] = True
            if not e["output_sizes"]:
                e["output_dtypes"] = []
            if not e["input_sizes"]:
                e["input_dtypes"] = []
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "healthy", rep.summary
    assert rep.findings == []


def test_all_to_all_whose_splits_do_not_add_up_names_the_rank(tmp_path: Path) -> None:
    # Uneven splits are normal (MoE); totals that do not balance are not: rank 3 expects 18 back for 16 sent.
    ranks = [Rank(r) for r in range(4)]
    for step in range(3):
        last = step == 2
        for r in ranks:
            n_in = 16 + r.rank  # uneven but balanced: each rank receives what it sent in total
            n_out = 18 if (last and r.rank == 3) else n_in
            r.coll_op("all_to_all", sizes=((n_in,),), out=((n_out,),), state="started" if last else "completed")
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "mismatch", rep.summary
    assert _headline(rep) == ("collective.size_mismatch", 3)
    assert rep.findings[0].evidence["shape"] == "all_to_all"


def test_uneven_all_to_all_that_balances_is_healthy(tmp_path: Path) -> None:
    ranks = [Rank(r) for r in range(4)]
    for _ in range(3):
        for r in ranks:
            r.coll_op("all_to_all", sizes=((10 + 3 * r.rank,),), out=((19 - 3 * r.rank,),))
    assert triage(_write(tmp_path, ranks)).verdict == "healthy"


def test_self_inconsistent_all_gather_breaks_a_two_rank_tie(tmp_path: Path) -> None:
    ranks = [Rank(r) for r in range(2)]
    _steps(ranks, 2)
    ranks[0].coll_op("_all_gather_base", sizes=((4,),), out=((8,),), state="started")
    ranks[1].coll_op("_all_gather_base", sizes=((4,),), out=((12,),), state="started")
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "mismatch", rep.summary
    assert _headline(rep) == ("collective.size_mismatch", 1)
    assert rep.findings[0].evidence["decided_by"] == "own_record"


def test_two_groups_with_one_name_are_kept_apart(tmp_path: Path) -> None:
    # Older torch named split groups with a shared counter: {0,1} and {2,3} are both "1". Rank 3 never
    # reaches its TP all_reduce; merging the groups by name would invent a 2-vs-2 split and hide it.
    ranks = [Rank(r) for r in range(4)]
    for step in range(3):
        last = step == 2
        for r in ranks:
            if last and r.rank == 3:
                continue
            r.coll_op(group="1", pg_id=1, sizes=((16,),) if r.rank < 2 else ((32,),),
                      state="started" if last and r.rank == 2 else "completed")
        for r in ranks:
            if last and r.rank >= 2:
                continue
            r.coll_op(state="started" if last else "completed")
    for r in ranks:
        cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
               "1": {"name": "1", "desc": "undefined", "ranks": "[0, 1]" if r.rank < 2 else "[2, 3]"}}
        write_json(tmp_path, f"rank{r.rank}.json", dump(r.entries, pg_config=cfg, status={}))
    rep = triage(tmp_path)
    assert rep.verdict == "hang", rep.summary
    assert _headline(rep) == ("collective.missing_rank", 3)
    assert not any(f.code.endswith("_mismatch") for f in rep.findings)
    assert {g["name"] for g in rep.groups} >= {"1[0-1]", "1[2-3]"}


def test_silent_mismatch_then_stall_leads_with_the_mismatch(tmp_path: Path) -> None:
    # A broadcast whose size differs on leaf rank 3 completes (Gloo lets it through); later the job hangs.
    ranks = [Rank(r, backend="gloo") for r in range(4)]
    for step in range(6):
        for r in ranks:
            if step == 2:
                r.coll_op("broadcast", sizes=((8,),) if r.rank == 3 else ((4,),), state="scheduled")
            elif step == 5:
                r.coll_op(state="scheduled")
            else:
                r.coll_op(state="scheduled")
    for r in ranks:
        for e in r.entries[:-1]:
            e["retired"] = True
        r.entries[-1]["retired"] = False
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "mismatch", rep.summary
    assert _headline(rep) == ("collective.size_mismatch", 3), rep.summary
    head = rep.roots[0]
    assert head.kind is RootKind.MISMATCH and head.completed
    assert head.followed_by and head.followed_by[0].kind is RootKind.GPU_STALL  # nested, not a headline
    assert [f.code for f in rep.findings] == ["collective.size_mismatch"]


def test_one_readable_dump_among_unreadable_ones_is_incomplete(tmp_path: Path) -> None:
    ranks = [Rank(r) for r in range(4)]
    _steps(ranks, 3)
    ranks[0].coll_op(state="started")
    write_json(tmp_path, "rank0.json", dump(ranks[0].entries, status={}))
    for r in (1, 2, 3):
        (tmp_path / f"rank{r}.json").write_bytes(b"\x00garbage that is not a dump")
    rep = triage(tmp_path)
    assert rep.verdict == "incomplete", rep.summary
    assert rep.ranks_unreadable == [1, 2, 3]
    assert "could not be read" in rep.summary
    assert "gpu stall" not in rep.summary.lower()


def test_torch_analyser_style_records_without_sequence_ids(tmp_path: Path) -> None:
    # PyTorch's own analyser tests build records with collective_seq_id 0 and rely on order: rank 0's second
    # broadcast in a coalesced group is [5, 5] where rank 1 has [4, 4] (a tie: both named).
    for r in range(2):
        es = [entry(0, record_id=0, op="_broadcast_oop", sizes=((4, 4),)),
              entry(0, record_id=1, op="_broadcast_oop", sizes=((5, 5),) if r == 0 else ((4, 4),)),
              entry(0, record_id=2, op="ALLGATHER_coalesced", sizes=((),))]
        write_json(tmp_path, f"dump_file_rank_{r}.json", dump(es, status={}, extra={"rank": r}))
    rep = triage(tmp_path)
    assert rep.verdict == "mismatch", rep.summary
    assert sorted(f.evidence["rank"] for f in rep.findings) == [0, 1]


def test_a_pipeline_rank_that_skipped_a_world_collective_is_named_not_the_stage_it_waits_on(tmp_path: Path) -> None:
    # PP=2 x DP=3 (stage 0: ranks 0,2,4; stage 1: 1,3,5). Each step: a send 0->1 in each stage pair, three
    # gradient all_reduces in the stage's DP group, one world all_reduce. In step 2 rank 5 skips the world
    # all_reduce and posts step 3: its recv from rank 4 waits, since rank 4 waits in the world all_reduce
    # #2 for rank 5 — whose next world all_reduce NCCL also numbers #2. Two steps of history are too few
    # for rank 5's own order; its DP peers 1 and 3 posted #2 and have not reached the ops it ran first.
    pairs = {0: "1", 1: "1", 2: "2", 3: "2", 4: "3", 5: "3"}
    ranks = [Rank(r) for r in range(6)]

    def p2p(r: Rank, state: str) -> None:
        stage = r.rank % 2
        r.p2p_op("send" if stage == 0 else "recv", 1 - stage, group=pairs[r.rank], sizes=((64,),), state=state)
        e = r.entries[-1]
        e["profiling_name"] = "nccl:send 0->1" if stage == 0 else "nccl:recv 1<-0"
        e["pg_id"] = int(pairs[r.rank])

    for step in (1, 2, 3):
        for r in ranks:
            if step == 3 and r.rank != 5:
                continue
            p2p(r, "started" if step == 3 else "completed")
            for _ in range(3):
                r.coll_op(group="4" if r.rank % 2 == 0 else "5", sizes=((4096,),),
                          state="scheduled" if step == 3 else "completed")
            if step == 2 and r.rank == 5:
                continue  # the skip
            r.coll_op(state="scheduled" if step == 3 else "started" if step == 2 else "completed")
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(6)))},
           **{g: {"name": g, "desc": "pp", "ranks": str([2 * i, 2 * i + 1])} for i, g in enumerate("123")},
           "4": {"name": "4", "desc": "dp", "ranks": "[0, 2, 4]"},
           "5": {"name": "5", "desc": "dp", "ranks": "[1, 3, 5]"}}
    rep = triage(_write(tmp_path, ranks, cfg))
    assert rep.verdict == "hang", rep.summary
    assert rep.culprits == [5], rep.summary
    assert rep.roots[0].decided_by == "peers"


# ------------------------------------------------------------------------------------------ stacks


def _gloo_pipeline_dumps(tmp_path: Path) -> Path:
    """Gloo records no send/recv: in a pipeline 0→1→2→3 where rank 1 is stuck on the host, ranks 1, 2 and 3
    all look like ranks that never posted the next world all_reduce (2 and 3 are blocked in recv)."""
    ranks = [Rank(r, backend="gloo") for r in range(4)]
    for step in range(4):
        for r in ranks:
            if step == 3 and r.rank != 0:
                continue
            r.coll_op(state="scheduled")
    for r in ranks:
        for e in r.entries:
            e["retired"] = True
    ranks[0].entries[-1]["retired"] = False
    return _write(tmp_path, ranks)


def _hook_stack(*frames: tuple[str, str]) -> dict[str, Any]:
    return {"source": "hook", "hook": {"threads": [
        {"main": True, "frames": [{"file": f, "line": 10, "function": fn} for fn, f in frames]}]}}


def test_without_stacks_every_rank_that_never_posted_is_named(tmp_path: Path) -> None:
    rep = triage(_gloo_pipeline_dumps(tmp_path))
    assert rep.verdict == "hang" and rep.roots[0].ranks == (1, 2, 3), rep.summary


def test_stacks_tell_the_stuck_stage_from_the_ranks_blocked_in_recv(tmp_path: Path) -> None:
    folder = _gloo_pipeline_dumps(tmp_path)
    recv = ("recv", "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py")
    stacks = {"1": _hook_stack(("train", "/job/train.py"), ("load_batch", "/job/data.py"), ("sleep", "/job/data.py")),
              "2": _hook_stack(("train", "/job/train.py"), recv),
              3: {"source": "py-spy", "py_spy": [{"thread_name": "MainThread", "frames": [
                  {"name": "recv", "filename": recv[1], "line": 1}, {"name": "train", "filename": "/job/train.py",
                                                                      "line": 7}]}]}}
    rep = triage(folder, stacks=stacks)
    assert rep.verdict == "hang"
    assert rep.roots[0].ranks == (1,) and rep.culprits == [1], rep.summary
    assert set(rep.roots[0].affected_ranks) >= {0, 2, 3}
    assert "blocked in torch.distributed (recv)" in rep.roots[0].why
    head = rep.headline
    assert head is not None and head.evidence["live_stack"][0] == "sleep at /job/data.py:10"


def test_an_evidence_folder_is_triaged_with_its_stacks(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    _gloo_pipeline_dumps(tmp_path / "ev" / "fr")
    recv = ("recv", "/x/torch/distributed/distributed_c10d.py")
    (tmp_path / "ev" / "stacks.json").write_text(json.dumps(
        {"1": _hook_stack(("sleep", "/job/train.py")), "2": _hook_stack(recv), "3": _hook_stack(recv)}))
    out = subprocess.run([sys.executable, "-m", "gpuhealth.cli.main", "triage", str(tmp_path / "ev"), "--json"],
                         capture_output=True, text=True, timeout=120)
    doc = json.loads(out.stdout)
    assert doc["verdict"] == "hang" and doc["culprits"] == [1], doc["summary"]


def test_nccl2_profiling_names_are_read_like_nccl(tmp_path: Path) -> None:
    # Newer torch's second NCCL process group writes "nccl2:all_reduce" (torchfrtrace refuses the prefix).
    ranks = [Rank(r, backend="nccl2") for r in range(4)]
    _steps(ranks, 3)
    for r in ranks:
        if r.rank != 2:
            r.coll_op(state="started")
    rep = triage(_write(tmp_path, ranks))
    assert rep.verdict == "hang" and rep.culprits == [2], rep.summary
