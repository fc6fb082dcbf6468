"""The RAS client against NCCL's protocol and report formats, and the hang judgement over its counts."""

from __future__ import annotations

import socket

import pytest
from zc_fakes import Comm, FakeRas, Rank, json_reply

from gpuhealth.agent.zerocode import ras
from gpuhealth.agent.zerocode.hang import HangJudge, judge

# The text report as NCCL prints it (client_support.cc format strings), for a 2-rank job where rank 1
# stopped launching all-reduces (docs/reference/ZERO_CODE.md, measured on 2 x H200 with NCCL 2.28.9).
TEXT_HUNG = """NCCL version 2.28.9+cuda13.0 compiled with CUDA 13.0
CUDA runtime version 13000, driver version 13000

Job summary
===========

  Nodes  Processes         GPUs  Processes     GPUs
(total)   per node  per process    (total)  (total)
      1          2            1          2        2

Communicators... (0.002s)
=============

Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors
    #  in group  per comm  per node  per comm  in group
    0         1         1         2         2         2   RUNNING  MISMATCH

Errors
======

Warnings
========

#0-0 (7e67eee0d8627dca) MISMATCH
  Communicator ranks have different AllReduce operation counts
  Rank 0 has launched up to operation 33 -- GPU 0 managed by process 842 on node 10.0.0.1
  Rank 1 has launched up to operation 20 -- GPU 1 managed by process 843 on node 10.0.0.1

"""

# A 4-rank job where rank 0 skipped a DP all-reduce: the majority is not named (NCCL lists outliers only),
# the DP communicator names both, and an INCOMPLETE communicator lists a rank nobody heard from.
TEXT_SUBGROUP = """NCCL version 2.27.7+cuda12.9 compiled with CUDA 12.9

Errors
======

#1-0 (00000000000000aa) INCOMPLETE
  Missing communicator data from 1 rank
  Rank 3 -- GPU 3 managed by process 1066 on node 10.0.0.2

Warnings
========

#0-0 (0000000000000f00) MISMATCH
  Communicator ranks have different AllReduce operation counts
  3 ranks have launched up to operation 6
  Rank 0 has launched up to operation 5 -- GPU 0 managed by process 1063 on node 10.0.0.1

#1-1 (00000000000000d1) MISMATCH
  Communicator ranks have different AllReduce operation counts
  Rank 0 has launched up to operation 5 -- GPU 0 managed by process 1063 on node 10.0.0.1
  Rank 1 has launched up to operation 6 -- GPU 2 (NVML 3) managed by process 1065 on node 10.0.0.2

"""


def test_text_report_names_ranks_counts_and_processes() -> None:
    st = ras.parse_text(TEXT_HUNG)
    assert st.nccl_version == "2.28.9+cuda13.0"
    (comm,) = st.communicators
    assert comm.key == "7e67eee0d8627dca" and comm.labels == ("MISMATCH",)
    assert {(r.comm_rank, r.pid, r.nvml_dev, r.counts["AllReduce"]) for r in comm.ranks} == {(0, 842, 0, 33),
                                                                                           (1, 843, 1, 20)}
    sub = ras.parse_text(TEXT_SUBGROUP)
    world = next(c for c in sub.communicators if c.key == "0000000000000f00")
    majority = next(g for g in world.groups if g.count == 6)
    assert (majority.n, majority.ranks) == (3, ())  # counted, not named
    dp = next(c for c in sub.communicators if c.key == "00000000000000d1")
    assert {(r.comm_rank, r.pid, r.cuda_dev, r.nvml_dev) for r in dp.ranks} == {(0, 1063, 0, 0), (1, 1065, 2, 3)}
    incomplete = next(c for c in sub.communicators if c.key == "00000000000000aa")
    assert [(r.comm_rank, r.pid) for r in incomplete.missing] == [(3, 1066)]


def test_json_report_as_nccl_2_28_writes_it_missing_comma_included() -> None:
    text = json_reply([Comm(0x7E67, [Rank(0, 842, 0, {"AllReduce": 33}), Rank(1, 843, 1, {"AllReduce": 20})],
                            missing=[Rank(2, 900, 0, {}, host="10.0.0.2")])])
    with pytest.raises(ValueError):
        import json

        json.loads(text)  # NCCL's own output is not valid JSON when a rank is missing
    st = ras.parse_json(text)
    (comm,) = st.communicators
    assert comm.size == 3 and [r.pid for r in comm.missing] == [900]
    assert [(g.count, [r.comm_rank for r in g.ranks]) for g in comm.ops_groups("AllReduce")] == [(33, [0]), (20, [1])]
    assert st.pids() == {842, 843, 900}


def test_client_speaks_the_protocol_and_falls_back_to_text_on_older_nccl() -> None:
    new = FakeRas([{"json": json_reply([Comm(1, [Rank(0, 5, 0, {"AllReduce": 3})])]), "text": TEXT_HUNG}])
    old = FakeRas([{"json": "", "text": TEXT_HUNG}], json_supported=False)
    try:
        reply, status = ras.fetch("127.0.0.1", new.port, collective_timeout_s=5)
        assert reply.format == "json" and status.communicators[0].ranks[0].pid == 5
        assert new.commands[0] == ["CLIENT PROTOCOL 2", "TIMEOUT 5", "SET FORMAT json", "VERBOSE STATUS"]
        reply, status = ras.fetch("127.0.0.1", old.port)
        assert reply.format == "text" and status.communicators[0].key == "7e67eee0d8627dca"
    finally:
        new.close()
        old.close()


def test_nothing_listening_or_not_ras_is_said_in_words() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ras.RasUnavailable, match=r"nothing listens .* NCCL_RAS_ENABLE=0"):
        ras.query("127.0.0.1", port)
    other = FakeRas([{"text": ""}], greeting="HTTP/1.1 400 Bad Request\n")
    try:
        with pytest.raises(ras.RasProtocolError, match="is not NCCL RAS"):
            ras.query("127.0.0.1", other.port)
    finally:
        other.close()


def _status(*comms: Comm) -> ras.RasStatus:
    return ras.parse_json(json_reply(list(comms)))


def _two(c0: int, c1: int, key: int = 0xA) -> Comm:
    return Comm(key, [Rank(0, 100, 0, {"AllReduce": c0}), Rank(1, 101, 1, {"AllReduce": c1})])


def test_a_healthy_job_that_lags_is_no_hang_and_a_stall_with_a_rank_behind_is() -> None:
    j = HangJudge(threshold_s=30)
    for t, (a, b) in enumerate([(2154, 2151), (2300, 2297), (2450, 2449), (2600, 2598)]):
        assert j.observe(_status(_two(a, b)), now=t * 10.0) == []  # counts move: the lag is asynchrony
    assert j.observe(_status(_two(33, 20)), now=100.0) == []
    assert j.observe(_status(_two(33, 20)), now=120.0) == []  # still < threshold
    (v,) = j.observe(_status(_two(33, 20)), now=131.0)
    assert v.kind == "hang" and v.polls == 3 and v.stalled_s == 31.0
    (c,) = v.culprits
    assert (c.rank.comm_rank, c.rank.pid, c.count, c.ahead_count) == (1, 101, 20, 33)
    assert j.observe(_status(_two(34, 34)), now=140.0) == []  # moving again: the verdict is withdrawn


def test_one_poll_is_never_a_hang_and_equal_counts_are_not_rass_to_judge() -> None:
    j = HangJudge(threshold_s=0)
    assert j.observe(_status(_two(33, 20)), now=0.0) == []  # a single snapshot proves nothing
    assert j.observe(_status(_two(33, 20)), now=1.0) != []
    k = HangJudge(threshold_s=0)
    for t in range(5):
        assert k.observe(_status(_two(40, 40)), now=float(t)) == []  # a GPU stall: every rank launched it


def test_subgroup_skip_names_the_rank_behind_not_the_ranks_waiting_for_it() -> None:
    st = ras.parse_text(TEXT_SUBGROUP)
    stalled = [c for c in st.communicators if c.counts_differ()]
    v = judge(stalled, 60.0, 3)
    assert v is not None and v.kind == "hang"
    assert [(c.rank.pid, c.rank.host) for c in v.culprits] == [(1063, "10.0.0.1")]


def test_a_pipeline_wait_is_a_consequence_and_different_collectives_are_a_mismatch() -> None:
    # Stage 0 (pid 100) is stuck: stage 1 waits for it in comm A, so stage 1 is behind stage 2 in comm B.
    a = Comm(0xA, [Rank(0, 100, 0, {"AllReduce": 5}), Rank(1, 101, 1, {"AllReduce": 6})])
    b = Comm(0xB, [Rank(0, 101, 1, {"AllReduce": 9}), Rank(1, 102, 2, {"AllReduce": 10})])
    v = judge(_status(a, b).communicators, 40.0, 2)
    assert v is not None and [c.rank.pid for c in v.culprits] == [100]
    assert {b.rank.pid for b in v.behind} == {100, 101}
    # Rank 1 broadcast where rank 0 all-reduced: each waits for the other.
    m = Comm(0xC, [Rank(0, 200, 0, {"AllReduce": 601, "Broadcast": 0}),
                   Rank(1, 201, 1, {"AllReduce": 600, "Broadcast": 1})])
    v = judge(_status(m).communicators, 40.0, 2)
    assert v is not None and v.kind == "mismatch" and {c.rank.pid for c in v.culprits} == {200, 201}


def test_multi_node_reply_names_the_remote_rank_with_its_node() -> None:
    # 2 nodes x 2 ranks, as RAS reports from any one process: rank 3 on node 10.0.0.2 stopped.
    ranks = [Rank(r, 500 + r, r % 2, {"AllReduce": 80 if r != 3 else 71}, host=f"10.0.0.{1 + r // 2}")
             for r in range(4)]
    j = HangJudge(threshold_s=10)
    j.observe(_status(Comm(0xF, ranks)), now=0.0)
    (v,) = j.observe(_status(Comm(0xF, ranks)), now=12.0)
    assert [(c.rank.comm_rank, c.rank.host, c.rank.pid) for c in v.culprits] == [(3, "10.0.0.2", 503)]
    assert "process 503 on 10.0.0.2" in v.summary()


NETNS_SERVER = r"""
import fcntl, socket, struct, sys
ctl = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a new namespace's loopback starts down: up it
flags = struct.unpack("16sH", fcntl.ioctl(ctl, 0x8913, struct.pack("16sH", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(ctl, 0x8914, struct.pack("16sH", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
f = conn.makefile("rb")
for line in f:
    cmd = line.strip().lower()
    if cmd.startswith(b"client protocol"):
        conn.sendall(b"SERVER PROTOCOL 2\n")
    elif cmd.startswith(b"set format"):
        conn.sendall(b"ERROR: Unknown command\n")
    elif cmd.endswith(b"status"):
        conn.sendall(sys.argv[1].encode()); break
"""


def test_a_job_in_its_own_network_namespace_is_reached_inside_it() -> None:
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux unshare is needed to make a network namespace"
    job = subprocess.Popen([unshare, "-n", sys.executable, "-c", NETNS_SERVER, TEXT_HUNG], stdout=subprocess.PIPE)
    try:
        assert job.stdout is not None
        port = int(job.stdout.readline())
        with pytest.raises(ras.RasUnavailable):
            ras.query("127.0.0.1", port, timeout_s=2)  # the agent's own localhost has no such port
        reply, status = ras.fetch("127.0.0.1", port, netns_pid=job.pid, timeout_s=5)
        assert reply.format == "text" and status.pids() == {842, 843}
    finally:
        job.kill()
        job.wait()
