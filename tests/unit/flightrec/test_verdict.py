"""Matching and verdicts on synthetic dumps in the real format (each test one failure shape)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from frbuild import dump, entry, training, write_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhealth.flightrec.verdict import VERDICTS, triage


def _codes(report) -> list[tuple[str, int | None]]:  # type: ignore[no-untyped-def]
    return [(f.code, f.evidence.get("rank")) for f in report.findings]


def test_majority_decides_the_culprit_even_when_it_is_the_first_file(tmp_path: Path) -> None:
    # torchfrtrace takes the first file as the reference and blames the three healthy ranks.
    for r in range(4):
        es = training(5)
        es.append(entry(6, sizes=[[2048]] if r == 0 else [[1024]], state="scheduled"))
        write_json(tmp_path, f"rank{r}.json", dump(es))
    rep = triage(tmp_path)
    assert rep.verdict == "mismatch"
    assert _codes(rep) == [("collective.size_mismatch", 0)]
    ev = rep.findings[0].evidence
    assert ev["seq"] == 6 and ev["actual"]["input_sizes"] == [[2048]] and ev["expected"]["input_sizes"] == [[1024]]
    assert ev["decided_by"] == "majority" and ev["completed"] is False


def test_tie_is_broken_by_history_and_later_entries_are_not_noise(tmp_path: Path) -> None:
    for r in range(2):
        es = training(5)
        es.append(entry(6, dtype="Int" if r == 1 else "Float", state="completed"))
        # After a mismatch, later seqs may be misaligned: they must not produce more findings.
        es += [entry(7, op="broadcast" if r else "all_reduce"), entry(8, sizes=[[r + 1]])]
        write_json(tmp_path, f"rank{r}.json", dump(es))
    rep = triage(tmp_path)
    assert _codes(rep) == [("collective.dtype_mismatch", 1)]
    ev = rep.findings[0].evidence
    assert ev["decided_by"] == "history" and ev["completed"] is True
    assert ev["later_mismatches_not_compared"] == 2


def test_undecidable_tie_names_both_sides_as_warnings(tmp_path: Path) -> None:
    for r in range(2):
        es = [entry(1, op="broadcast" if r else "all_gather", state="scheduled")]
        write_json(tmp_path, f"rank{r}.json", dump(es))
    rep = triage(tmp_path)
    assert {f.evidence["rank"] for f in rep.findings} == {0, 1}
    assert all(f.evidence["decided_by"] == "undecided" for f in rep.findings)


def test_rank_that_never_enqueued_is_named_with_call_site(tmp_path: Path) -> None:
    frames = [{"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 1},
              {"name": "train_step", "filename": "/job/train.py", "line": 42}]
    for r in range(8):
        es = training(9)
        if r != 5:
            es.append(entry(10, state="started", frames=frames))
        write_json(tmp_path, f"node{r // 4}-rank{r}.json", dump(es))
    rep = triage(tmp_path)
    assert rep.verdict == "hang"
    assert _codes(rep) == [("collective.missing_rank", 5)]
    ev = rep.findings[0].evidence
    assert ev["seq"] == 10 and ev["waiting_ranks"] == [0, 1, 2, 3, 4, 6, 7] and ev["host"] == "node1"
    assert ev["stack"] == ["train_step at /job/train.py:42"]
    assert ev["last_seen"]["seq"] == 9 and ev["last_seen"]["completed"]


def test_gpu_stall_narrowed_to_the_rank_that_never_started(tmp_path: Path) -> None:
    for r in range(4):
        es = training(4)
        es.append(entry(5, state="scheduled" if r == 2 else "started"))
        write_json(tmp_path, f"rank{r}.json", dump(es))
    rep = triage(tmp_path)
    assert rep.verdict == "hang"
    assert _codes(rep) == [("collective.gpu_stall", 2)]


def test_gpu_stall_without_narrowing_is_one_job_level_finding(tmp_path: Path) -> None:
    for r in range(4):
        es = training(4)
        es.append(entry(5, state="started"))
        write_json(tmp_path, f"rank{r}.json", dump(es))
    rep = triage(tmp_path, job={"job_id": "j1"})
    assert [(f.code, f.entity.kind.value, f.entity.id) for f in rep.findings] == [("collective.gpu_stall", "job", "j1")]
    assert rep.findings[0].evidence["ranks"] == [0, 1, 2, 3]


def _tp_job(tmp_path: Path, sleeper: int) -> None:
    """TP groups {0,1} ("1") and {2,3} ("2") + world ("0"): each step a TP then a world all_reduce.
    ``sleeper`` stops before its TP all_reduce of step 5 (Gloo-style: state always scheduled)."""
    for r in range(4):
        tp = "1" if r < 2 else "2"
        es, rid = [], 0
        for step in range(1, 6):
            for grp, pid in ((tp, 1), ("0", 0)):
                if r == sleeper and step == 5:
                    break
                if grp == "0" and step == 5 and r // 2 == sleeper // 2:
                    break  # the sleeper's TP peer waits in the TP group
                done = step < 5 or (grp != "0" and r // 2 != sleeper // 2)
                es.append(entry(step, record_id=rid, group=grp, desc="default_pg" if grp == "0" else "undefined",
                                pg_id=pid, backend="gloo", state="scheduled", retired=done,
                                created_ns=1_700_000_000_000_000_000 + rid * 1000))
                rid += 1
        gloo_cfg = {"": {"name": "", "desc": "", "ranks": "[]"}}  # what Gloo really records
        write_json(tmp_path, f"rank{r}.json", dump(es, pg_config=gloo_cfg, comm=""))


def test_subgroup_hang_picks_the_root_group_and_says_why(tmp_path: Path) -> None:
    _tp_job(tmp_path, sleeper=3)
    rep = triage(tmp_path)
    assert rep.verdict == "hang"
    assert _codes(rep) == [("collective.missing_rank", 3)]
    ev = rep.findings[0].evidence
    assert ev["group"] == "2" and ev["waiting_ranks"] == [2]
    assert ev["consequences"] == ["0"]  # the world group is stuck only because of this
    assert "not waiting in any collective" in ev["why"]
    groups = {g["name"]: g for g in rep.groups}
    assert groups["2"]["members"] == [2, 3] and groups["2"]["membership_source"] == "entries"
    assert groups["0"]["membership_source"] == "world"


def test_skipped_collective_in_a_circular_wait_blames_the_rank_that_ran_ahead(tmp_path: Path) -> None:
    # Rank 3 skips world #5 and enters TP #6; rank 2 waits in world #5, rank 3 in TP #6.
    for r in range(4):
        tp = "1" if r < 2 else "2"
        es, rid = [], 0
        for step in range(1, 6):
            es.append(entry(step, record_id=rid, group=tp, desc="undefined", pg_id=1, backend="gloo",
                            state="scheduled", retired=True))
            rid += 1
            if r == 3 and step == 5:
                continue
            es.append(entry(step, record_id=rid, group="0", pg_id=0, backend="gloo", state="scheduled",
                            retired=step < 5))
            rid += 1
        if r == 3:
            es.append(entry(6, record_id=rid, group=tp, desc="undefined", pg_id=1, backend="gloo", state="scheduled",
                            retired=False))
        write_json(tmp_path, f"rank{r}.json", dump(es, comm=""))
    rep = triage(tmp_path)
    assert _codes(rep) == [("collective.missing_rank", 3)]
    ev = rep.findings[0].evidence
    assert ev["kind"] == "skipped" and ev["group"] == "0" and ev["seq"] == 5
    assert "skipped a collective" in ev["why"]


def test_missing_dump_of_the_blocking_rank_is_incomplete_not_a_guess(tmp_path: Path) -> None:
    for r in range(3):  # rank 3 left no dump
        es = training(4)
        es.append(entry(5, state="started"))
        write_json(tmp_path, f"rank{r}.json", dump(es, pg_config={"0": {"name": "0", "desc": "default_pg",
                                                                      "ranks": "[0, 1, 2, 3]"}}))
    rep = triage(tmp_path)
    assert rep.verdict == "incomplete"
    assert rep.ranks_missing == [3]
    assert _codes(rep) == [("flightrec.dump_missing", 3)]


def test_ring_buffer_truncation_aligns_on_sequence_ids(tmp_path: Path) -> None:
    # Rank 0 kept seqs 1..100, rank 1 only 61..100 (smaller buffer): no false missing rank or mismatch.
    write_json(tmp_path, "rank0.json", dump(training(100)))
    write_json(tmp_path, "rank1.json", dump([entry(s) for s in range(61, 101)]))
    rep = triage(tmp_path)
    assert rep.verdict == "healthy" and rep.findings == []


def test_p2p_send_without_matching_recv(tmp_path: Path) -> None:
    for r in range(2):
        es = training(3)
        if r == 0:
            es.append(entry(1, record_id=50, op="send", p2p="0->1", state="started"))
        write_json(tmp_path, f"rank{r}.json", dump(es))
    rep = triage(tmp_path)
    assert rep.verdict == "hang"
    assert _codes(rep) == [("collective.p2p_unmatched", 1)]
    assert rep.findings[0].evidence["peer"] == 0


def test_healthy_job_has_no_findings_and_json_shape(tmp_path: Path) -> None:
    for r in range(4):
        write_json(tmp_path, f"rank{r}.json", dump(training(20)))
    rep = triage(tmp_path)
    d = rep.to_dict()
    assert d["verdict"] == "healthy" and d["findings"] == []
    assert d["ranks_seen"] == [0, 1, 2, 3] and d["ranks_missing"] == []
    assert {"verdict", "findings", "ranks_seen", "ranks_missing", "groups"} <= set(d)


def test_already_loaded_dumps_and_lists_of_paths_are_accepted(tmp_path: Path) -> None:
    from gpuhealth.flightrec.load import load_dumps

    paths = [write_json(tmp_path, f"rank{r}.json", dump(training(3))) for r in range(2)]
    assert triage(paths).verdict == "healthy"
    assert triage(load_dumps(tmp_path)).verdict == "healthy"
    assert triage(load_dumps(tmp_path).dumps).verdict == "healthy"


def test_nothing_readable_is_incomplete(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text("garbage")
    rep = triage(tmp_path)
    assert rep.verdict == "incomplete" and rep.problems


def test_mixed_versions_and_formats_in_one_job(tmp_path: Path) -> None:
    from frbuild import write_pickle

    for r in range(4):
        es = training(6, json_style=(r != 0))
        if r != 2:
            es.append(entry(7, state="started", json_style=(r != 0)))
        if r == 0:  # an old pickle: nccl_version, int pg_status, None times, tuples
            d = dump(es, json_style=False, version="2.3")
            d["nccl_version"] = d.pop("comm_lib_version")
            write_pickle(tmp_path, "rank0.pkl", d)
        else:
            write_json(tmp_path, f"rank{r}.json", dump(es, version="2.10"))
    rep = triage(tmp_path)
    assert rep.verdict == "hang"
    assert _codes(rep) == [("collective.missing_rank", 2)]
    assert rep.findings[0].evidence["waiting_ranks"] == [0, 1, 3]


_ENTRY = st.fixed_dictionaries({
    "seq": st.integers(min_value=1, max_value=6),
    "group": st.sampled_from(["0", "1", "2"]),
    "op": st.sampled_from(["all_reduce", "broadcast", "all_gather", "send", "recv"]),
    "size": st.sampled_from([1, 2, 1024]),
    "dtype": st.sampled_from(["Float", "Int"]),
    "state": st.sampled_from(["scheduled", "started", "completed"]),
    "retired": st.booleans(),
    "p2p": st.sampled_from(["", "0->1", "1<-0", "3->0"]),
    "duration": st.none() | st.floats(min_value=0, max_value=50),
})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ranks=st.dictionaries(st.integers(min_value=0, max_value=4), st.lists(_ENTRY, max_size=8), min_size=1,
                             max_size=5),
       world=st.none() | st.integers(min_value=1, max_value=6))
def test_fuzz_triage_never_crashes(tmp_path: Path, ranks: dict, world: int | None) -> None:
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    for r, items in ranks.items():
        es = [entry(i["seq"], record_id=n, group=i["group"], pg_id=int(i["group"]), op=i["op"],
                    sizes=[[i["size"]]], dtype=i["dtype"], state=i["state"], retired=i["retired"],
                    p2p=i["p2p"] if i["op"] in ("send", "recv") else "", duration_ms=i["duration"])
              for n, i in enumerate(items)]
        write_json(folder, f"rank{r}.json", dump(es))
    rep = triage(folder, job={"world_size": world} if world else None)
    assert rep.verdict in VERDICTS
    for f in rep.findings:
        if f.entity.kind.value == "rank":
            assert isinstance(f.evidence["rank"], int)
    json.dumps(rep.to_dict(), default=str)


def _late_dumps(tmp_path: Path, idle_s: float) -> None:
    """Rank 2 never enqueued #6; the others show #6 finished (what a dump after a Gloo timeout
    looks like) and issued nothing for ``idle_s`` before their dumps (dump time in the contents)."""
    base = 1_700_000_000_000_000_000
    for r in range(4):
        es = [entry(s, backend="gloo", state="scheduled", retired=True, created_ns=base + s * 10**6)
              for s in range(1, 6 if r == 2 else 7)]
        for e in es:
            e["timeout_ms"] = 30_000
        newest = es[-1]["time_created_ns"]
        write_json(tmp_path, f"rank{r}.json", dump(es, comm="", extra={"dump_time_ns": newest + int(idle_s * 1e9)}))


def test_dump_taken_after_the_timeout_still_names_the_rank(tmp_path: Path) -> None:
    _late_dumps(tmp_path, idle_s=45.0)
    rep = triage(tmp_path)
    assert rep.verdict == "hang"
    assert _codes(rep) == [("collective.missing_rank", 2)]
    ev = rep.findings[0].evidence
    assert ev["kind"] == "timed_out" and ev["ahead_ranks"] == [0, 1, 3] and ev["timeout_s"] == 30.0
    assert ev["idle_s"] >= 45.0


def test_one_collective_of_dump_skew_in_a_running_job_is_not_a_hang(tmp_path: Path) -> None:
    _late_dumps(tmp_path, idle_s=0.2)
    rep = triage(tmp_path)
    assert rep.verdict == "healthy"
    assert [(f.code, f.severity.name) for f in rep.findings] == [("collective.rank_behind", "INFO")]


def test_groups_stuck_behind_a_mismatched_subgroup_are_consequences_not_more_findings(tmp_path: Path) -> None:
    # TP {2,3} is stuck in a mismatched all_reduce (rank 3 passes 2048 where the group always ran
    # 1024); ranks 0,1 went on to the world all_reduce and wait there for ranks 2,3.
    for r in range(4):
        tp = "1" if r < 2 else "2"
        es, rid = [], 0
        for step in range(1, 5):
            last = step == 4
            size = [[2048]] if (r == 3 and last) else [[1024]]
            es.append(entry(step, record_id=rid, group=tp, desc="tp", pg_id=1, sizes=size,
                            state="started" if (last and r >= 2) else "completed"))
            rid += 1
            if last and r >= 2:
                break
            es.append(entry(step, record_id=rid, group="0", pg_id=0, state="started" if last else "completed"))
            rid += 1
        write_json(tmp_path, f"rank{r}.json", dump(es))
    rep = triage(tmp_path)
    assert rep.verdict == "mismatch"
    assert _codes(rep) == [("collective.size_mismatch", 3)]
    assert rep.findings[0].evidence["decided_by"] == "history"


def test_rank_lists_stay_readable_at_scale() -> None:
    from gpuhealth.flightrec.text import format_ranks

    assert format_ranks([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert format_ranks(r for r in range(5, 16384, 8) if r != 12293) == "5-16381 every 8th except 12293 (2047 ranks)"
    assert format_ranks(range(0, 40, 2)) == "0-38 every 2nd (20 ranks)"
    long = format_ranks([*range(0, 3000, 3), 1])
    assert long.endswith("(1001 ranks)") and len(long) <= 110


def _tp_dp_job(tmp_path: Path, *, skipper: int, tp_per_step: int = 3, buckets: int = 4, steps: int = 5,
               accum: int = 1) -> None:
    """Each step: ``tp_per_step`` TP all_reduces, then ``buckets`` data-parallel gradient buckets in the
    world group (Gloo, 4 ranks, TP pairs {0,1} {2,3}); with ``accum`` > 1 the buckets come only every
    ``accum``-th step (gradient accumulation). In the last step ``skipper`` skips its last TP all_reduce
    and goes on to the first bucket; its TP peer waits in that TP all_reduce."""
    peer = skipper ^ 1
    for r in range(4):
        tp = "1" if r < 2 else "2"
        es, rid = [], 0
        tp_seq = world_seq = 0
        for step in range(1, steps + 1):
            last = step == steps
            for k in range(tp_per_step):
                if last and r == skipper and k == tp_per_step - 1:
                    continue
                tp_seq += 1
                es.append(entry(tp_seq, record_id=rid, group=tp, desc="undefined", pg_id=1, backend="gloo",
                                state="scheduled", retired=not (last and r in (skipper, peer) and k == tp_per_step - 1),
                                created_ns=1_700_000_000_000_000_000 + rid * 1000))
                rid += 1
            if last and r == peer:
                break  # stuck in its last TP all_reduce
            if step % accum:
                continue  # accumulating: no gradient all_reduce this step
            for _ in range(buckets):
                world_seq += 1
                es.append(entry(world_seq, record_id=rid, group="0", pg_id=0, backend="gloo", state="scheduled",
                                retired=not last, created_ns=1_700_000_000_000_000_000 + rid * 1000))
                rid += 1
                if last:
                    break  # everyone waits in the first bucket (the peer never comes)
        write_json(tmp_path, f"rank{r}.json", dump(es, pg_config={"": {"name": "", "desc": "", "ranks": "[]"}},
                                                   comm=""))


@pytest.mark.parametrize(("tp_per_step", "buckets", "steps", "accum"), [
    (1, 1, 5, 1), (3, 4, 5, 1), (2, 1, 5, 1), (1, 6, 5, 1),
    (20, 1, 4, 1), (17, 2, 4, 1),  # more collectives per step than a short cycle search would try
    (2, 2, 16, 4),  # gradient accumulation: the data-parallel buckets come every 4th step
])
def test_a_skipped_tp_collective_is_blamed_on_the_skipper_whatever_the_step_looks_like(
        tmp_path: Path, tp_per_step: int, buckets: int, steps: int, accum: int) -> None:
    _tp_dp_job(tmp_path, skipper=3, tp_per_step=tp_per_step, buckets=buckets, steps=steps, accum=accum)
    rep = triage(tmp_path)
    assert rep.verdict == "hang"
    assert _codes(rep) == [("collective.missing_rank", 3)], rep.summary
    ev = rep.findings[0].evidence
    assert ev["kind"] == "skipped" and ev["group"] == "2" and ev["waiting_ranks"] == [2]


@pytest.mark.parametrize(("tp_per_step", "buckets", "steps", "accum"), [(3, 4, 2, 1), (2, 2, 3, 1), (1, 1, 2, 1),
                                                                        (2, 2, 8, 4)])
def test_with_too_little_history_both_candidates_are_named_never_only_the_waiting_peer(
        tmp_path: Path, tp_per_step: int, buckets: int, steps: int, accum: int) -> None:
    # The skipper (3) and its waiting peer (2) are mirror images by counts alone; only a repeating
    # history tells them apart. Without one, say both — never the peer alone.
    _tp_dp_job(tmp_path, skipper=3, tp_per_step=tp_per_step, buckets=buckets, steps=steps, accum=accum)
    rep = triage(tmp_path)
    ranks = sorted(r for _, r in _codes(rep))
    assert ranks in ([3], [2, 3]), rep.summary
    if ranks == [2, 3]:
        assert "too little repeating history" in rep.findings[0].evidence["why"]
