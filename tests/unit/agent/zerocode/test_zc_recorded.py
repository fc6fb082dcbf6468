"""The RAS client and the judge against NCCL's own replies, recorded on 2 x H200 (NCCL 2.28.9, torch 2.11).

Recorded by scripts/device/zero_code_runs.sh (tests/fixtures/zerocode/h200x2_nccl2.28.9/run_log.txt): unmodified
torchrun jobs of tests/integration/zerocode_job/train.py, 2 ranks. A: rank 1 host-stuck at step 600, world group
plus a second group (two communicators). B: the same, launched with `gpuhealth env`'s variables, RAS on port 28029.
D: rank 1 broadcasts where rank 0 all-reduces at step 600 — NCCL paired the two and the job ran on. Replies taken
6, 12 and 18 s after the fault, as JSON and as text. The healthy reply is A's real reply with the counts made
equal (no healthy reply was recorded: RAS starts with the first communicator, after the "ready" line).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from zc_fakes import FakeRas

from gpuhealth.agent.zerocode import ras
from gpuhealth.agent.zerocode.hang import HangJudge

REC = Path(__file__).resolve().parents[4] / "tests" / "fixtures" / "zerocode" / "h200x2_nccl2.28.9" / "ras"


def _reply(name: str) -> str:
    return (REC / name).read_text()


@pytest.mark.parametrize("job", ["A", "B"])
def test_real_hung_replies_name_the_host_stuck_rank_in_both_formats(job: str) -> None:
    for i in range(3):
        for status in (ras.parse_json(_reply(f"{job}_hung_{i}.json")), ras.parse_text(_reply(f"{job}_hung_{i}.txt"))):
            assert status.nccl_version == "2.28.9"
            assert status.communicators and all(c.counts_differ() for c in status.communicators)
    judge = HangJudge(threshold_s=30)
    verdicts = [judge.observe(ras.parse_json(_reply(f"{job}_hung_{i}.json")), now=t)
                for i, t in enumerate((6.0, 12.0, 40.0))]
    assert verdicts[:2] == [[], []]  # under the threshold
    (v,) = verdicts[2]
    pid = {"A": 771, "B": 765}[job]  # rank 1's process (job_A.log / job_B.log)
    assert v.kind == "hang" and [(c.rank.comm_rank, c.rank.pid, c.rank.nvml_dev) for c in v.culprits] == [(1, pid, 1)]
    assert (v.culprits[0].count, v.culprits[0].ahead_count) == (600, 601)
    text_judge = HangJudge(threshold_s=30)
    text = [text_judge.observe(ras.parse_text(_reply(f"{job}_hung_{i}.txt")), now=t)
            for i, t in enumerate((6.0, 12.0, 40.0))]
    assert [c.rank.pid for c in text[2][0].culprits] == [pid]


def test_both_communicators_of_job_a_agree() -> None:
    status = ras.parse_json(_reply("A_hung_0.json"))
    assert len(status.communicators) == 2
    for comm in status.communicators:
        groups = comm.ops_groups("AllReduce")
        assert [(g.count, [r.pid for r in g.ranks]) for g in groups] == [(601, [770]), (600, [771])]


def test_the_real_collective_mismatch_ran_on_and_is_told_apart_from_a_hang() -> None:
    judge = HangJudge(threshold_s=10)
    out = [judge.observe(ras.parse_json(_reply(f"D_hung_{i}.json")), now=t) for i, t in enumerate((6.0, 12.0, 18.0))]
    assert out[0] == [] and out[1] == []
    (v,) = out[2]
    assert v.kind == "diverged"  # AllReduce went 2116 -> 3320 -> 4524 on both ranks; Broadcast stayed 1 vs 0
    assert {(c.op, c.rank.pid, c.count) for c in v.culprits} == {("Broadcast", 768, 1), ("Broadcast", 767, 0)}
    # the text report lists only the differing type: the AllReduce progress is not visible there
    text = ras.parse_text(_reply("D_hung_0.txt"))
    assert [g.op for c in text.communicators for g in c.groups] == ["Broadcast", "Broadcast"]


def test_a_healthy_reply_in_the_real_format_is_no_verdict() -> None:
    doc = json.loads(_reply("A_hung_0.json"))
    judge = HangJudge(threshold_s=0)
    for t in range(4):
        for comm in doc["communicators"]:
            for r in comm["ranks"]:
                r["collective_counts"]["AllReduce"] = 601  # every rank at the same count, standing still
        assert judge.observe(ras.parse_json(json.dumps(doc)), now=float(t)) == []


def test_the_client_reads_the_recorded_replies_over_the_protocol() -> None:
    server = FakeRas([{"json": _reply("A_hung_0.json"), "text": _reply("A_hung_0.txt")}])
    try:
        reply, status = ras.fetch("127.0.0.1", server.port)
        assert reply.format == "json" and status.pids() == {770, 771}
        reply, status = ras.fetch("127.0.0.1", server.port, fmt="text")
        assert reply.format == "text" and status.pids() == {770, 771}
    finally:
        server.close()


H100 = Path(__file__).resolve().parents[4] / "tests" / "fixtures" / "zerocode" / "h100x2_nccl2.28.9" / "ras"


@pytest.mark.parametrize(("job", "pid"), [("A", 3013), ("B", 3009)])
def test_a_second_recording_on_2_x_h100_names_the_same_rank(job: str, pid: int) -> None:
    """Recorded on 2 x H100 in another session (fixture README): rank 1's process named again, both formats."""
    judge, text_judge = HangJudge(threshold_s=30), HangJudge(threshold_s=30)
    for i, t in enumerate((6.0, 12.0, 40.0)):
        got = judge.observe(ras.parse_json((H100 / f"{job}_hung_{i}.json").read_text()), now=t)
        text = text_judge.observe(ras.parse_text((H100 / f"{job}_hung_{i}.txt").read_text()), now=t)
    (v,) = got
    assert v.kind == "hang" and [(c.rank.comm_rank, c.rank.pid, c.op, c.count) for c in v.culprits] == [
        (1, pid, "AllReduce", 600)]
    assert [c.rank.pid for c in text[0].culprits] == [pid]


@pytest.mark.parametrize("job", ["A", "B", "C", "D"])
def test_real_replies_of_running_jobs_are_no_verdict_however_soon(job: str) -> None:
    """Replies recorded while the jobs ran (before the fault; C throughout): counts taken a moment apart
    differ or move, and no threshold, however short, turns that into a hang."""
    replies = sorted(H100.glob(f"{job}_healthy_*.json"))
    assert len(replies) >= 2
    judge = HangJudge(threshold_s=0)
    for i, path in enumerate(replies):
        status = ras.parse_json(path.read_text())
        assert status.nccl_version == "2.28.9" and status.communicators
        assert judge.observe(status, now=10.0 * i) == []
