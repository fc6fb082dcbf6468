"""Tracker, its agent link, its request handlers and identity, in one process (real sockets, real
torch on CPU where torch is the subject)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.agent.ranks import RankHub
from gpuhealth.instrument import Tracker, control, protocol
from gpuhealth.instrument.identity import UNKNOWN_JOB, identity_from_env, job_id_from_env
from gpuhealth.instrument.link import AgentLink
from gpuhealth.instrument.timing import HostTimer, LazyEventTimer
from gpuhealth.model import RankIdentity, StepRecord

ENV = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "GPUHEALTH_JOB_ID": "job-t"}


@pytest.fixture
def sock_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gh-trk-") as d:
        yield Path(d) / "agent.sock"


def until(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def read_jsonl(path: Path) -> list[StepRecord]:
    return [StepRecord.from_dict(json.loads(line)) for line in path.read_text().splitlines()]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


# -- identity -------------------------------------------------------------------------------------


def test_identity_from_torchrun_env() -> None:
    ident = identity_from_env(ENV)
    assert (ident.job_id, ident.rank, ident.world_size, ident.local_rank) == ("job-t", 2, 4, 0)
    assert ident.pid == os.getpid() and ident.host == socket.gethostname()
    assert ident.gpu_uuid is None  # no CUDA here


def test_identity_takes_the_gpu_a_launcher_names() -> None:
    ident = identity_from_env({**ENV, "GPUHEALTH_GPU_UUID": "GPU-abc", "GPUHEALTH_GPU_INDEX": "3"})
    assert (ident.gpu_uuid, ident.gpu_index) == ("GPU-abc", 3)
    assert identity_from_env({**ENV, "GPUHEALTH_GPU_INDEX": "three"}).gpu_index is None


def test_identity_from_slurm_and_job_id_precedence() -> None:
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "8812"}
    ident = identity_from_env(slurm)
    assert (ident.job_id, ident.rank, ident.world_size, ident.local_rank) == ("8812", 5, 16, 1)
    assert job_id_from_env({"SLURM_JOB_ID": "1", "GPUHEALTH_JOB_ID": "explicit"}) == "explicit"
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) == UNKNOWN_JOB  # torchrun's placeholder
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "rdzv-9"}) == "rdzv-9"
    bare = identity_from_env({})
    assert (bare.rank, bare.world_size, bare.job_id) == (0, 1, UNKNOWN_JOB)
    assert identity_from_env({"RANK": "x1", "WORLD_SIZE": "2"}, job_id="given").rank == 0
    assert identity_from_env(ENV, job_id="given").job_id == "given"


# -- step accounting ------------------------------------------------------------------------------


def test_step_collective_nesting_failures_and_explicit_numbers(tmp_path: Path) -> None:
    clock = FakeClock()
    out = tmp_path / "steps.jsonl"
    t = Tracker(out, socket_path="", env=ENV, timer=HostTimer(clock=clock))
    with t.collective():  # outside a step: not counted anywhere
        clock.t += 5
    with t.step():
        clock.t += 0.2
        with t.collective():
            clock.t += 0.1
            with t.collective():  # e.g. a wrapped collective inside the user's block: counted once
                clock.t += 0.1
        clock.t += 0.1
    with pytest.raises(ValueError), t.step():
        raise ValueError("a bad batch")
    with t.step(100):
        clock.t += 0.3
    with t.step(), t.step():  # a nested step is part of the outer one
        clock.t += 0.1
    t.close()
    t.close()  # idempotent
    recs = read_jsonl(out)
    assert [r.step for r in recs] == [0, 100, 101]
    assert recs[0].wall_s == pytest.approx(0.5) and recs[0].comm_wait_s == pytest.approx(0.2)
    assert recs[0].compute_s == pytest.approx(0.3)
    assert recs[1].comm_wait_s == 0.0 and recs[2].wall_s == pytest.approx(0.1)
    assert all(r.job_id == "job-t" and r.rank == 2 for r in recs)
    st = t.stats()
    assert st["steps_failed"] == 1 and st["written"] == 3 and st["dropped"] == 0 and st["timing"] == "custom"


def test_lazy_event_timer_inside_tracker_resolves_on_close(tmp_path: Path, gpu: Any) -> None:
    out = tmp_path / "r{rank}.jsonl"
    t = Tracker(out, socket_path="", env=ENV, timer=LazyEventTimer(gpu.event))
    for _ in range(4):
        with t.step():
            gpu.launch(8.0)
            with t.collective():
                gpu.launch(2.0)
    assert t.stats()["pending"] == 4 and gpu.syncs == 0  # nothing waited for the device in the loop
    t.close()
    recs = read_jsonl(tmp_path / "r2.jsonl")
    assert [r.step for r in recs] == [0, 1, 2, 3]
    assert all(r.wall_s == pytest.approx(0.010) and r.comm_wait_s == pytest.approx(0.002) for r in recs)


def test_finished_steps_are_reported_while_the_training_thread_is_stuck(tmp_path: Path, gpu: Any) -> None:
    out = tmp_path / "bg.jsonl"
    t = Tracker(out, socket_path="", env=ENV, timer=LazyEventTimer(gpu.event), flush_interval_s=0.05)
    for _ in range(3):
        with t.step():
            gpu.launch(5.0)
    # The loop now hangs (say, in a collective); the GPU finishes what it was given.
    gpu.run(100.0)
    until(lambda: out.exists() and len(out.read_text().splitlines()) == 3)
    assert [r.step for r in read_jsonl(out)] == [0, 1, 2]
    t.close()
    assert len(read_jsonl(out)) == 3


def test_device_timings_are_resolved_off_the_training_thread(tmp_path: Path, gpu: Any) -> None:
    out = tmp_path / "off.jsonl"
    t = Tracker(out, socket_path="", env=ENV, timer=LazyEventTimer(gpu.event), flush_interval_s=0.05)
    for _ in range(20):
        with t.step():
            gpu.launch(2.0)
            with t.collective():
                gpu.launch(1.0)
        gpu.run(3.0)  # the GPU keeps up
    until(lambda: out.exists() and len(out.read_text().splitlines()) == 20)
    assert threading.get_ident() not in gpu.query_threads  # the training thread never asked the GPU
    assert gpu.syncs == 0
    t.close()


def test_unencodable_records_are_dropped_and_the_link_stays_up(sock_path: Path) -> None:
    hub = RankHub(sock_path)
    got: list[StepRecord] = []
    hub.add_listener(on_steps=lambda i, rs: got.extend(rs))
    hub.start()
    link = AgentLink(RankIdentity("j", 0, 1, "h", 1), socket_path=str(sock_path), jsonl_path=None, handler=None,
                     flush_interval_s=0.05)
    link.start()
    try:
        until(lambda: link.connected)
        link.submit(StepRecord("j", 0, 0, 0.0, float("nan")))
        until(lambda: link.stats.dropped == 1)
        link.submit(StepRecord("j", 0, 1, 0.0, 0.5))
        until(lambda: len(got) == 1)
        assert got[0].step == 1 and link.stats.connects == 1 and "cannot be encoded" in link.stats.last_error
    finally:
        link.close()
        hub.stop()


def test_timing_argument_is_checked() -> None:
    with pytest.raises(ValueError, match="timing"):
        Tracker(socket_path="", env=ENV, timing="gpu")


def test_cpu_timing_by_default_without_cuda(tmp_path: Path) -> None:
    t = Tracker(tmp_path / "s.jsonl", socket_path="", env=ENV)
    assert t.timing == "cpu" and t.nccl_timing is False
    with t.step():
        time.sleep(0.01)
        with t.collective():
            time.sleep(0.01)
    t.close()
    (r,) = read_jsonl(tmp_path / "s.jsonl")
    assert r.wall_s >= 0.02 and r.comm_wait_s is not None and r.comm_wait_s >= 0.01


# -- delivery -------------------------------------------------------------------------------------


def test_records_reach_a_rank_hub_and_requests_are_answered(sock_path: Path, tmp_path: Path) -> None:
    hub = RankHub(sock_path)
    got: list[StepRecord] = []
    hub.add_listener(on_steps=lambda i, rs: got.extend(rs))
    hub.start()
    try:
        t = Tracker(socket_path=str(sock_path), env=ENV, flush_interval_s=0.05)
        for _ in range(5):
            with t.step():
                pass
        until(lambda: len(got) == 5)
        assert [r.step for r in got] == list(range(5))
        (ident,) = hub.ranks("job-t")
        assert ident == t.identity
        stacks = hub.request_stacks("job-t", 2, timeout_s=5)[2]
        assert isinstance(stacks, dict)
        main = next(th for th in stacks["threads"] if th["main"])
        # This test's own thread is blocked waiting for the answer: its stack says so.
        names = [f["function"] for f in main["frames"]]
        assert "test_records_reach_a_rank_hub_and_requests_are_answered" in names
        assert "request_stacks" in names
        assert main["frames"][-1]["file"].endswith(".py") and main["frames"][-1]["line"] > 0
        dumped = hub.request_dump("job-t", 2, str(tmp_path / "fr"), timeout_s=10)[2]
        assert isinstance(dumped, bytes | bytearray), dumped  # inline: nothing written to the folder
        assert not (tmp_path / "fr").exists()
        doc = json.loads(dumped)
        assert "entries" in doc or "pg_status" in doc
        t.close()
        until(lambda: hub.ranks() == [])
        assert t.stats()["sent"] == 5 and t.stats()["requests"] == 2
    finally:
        hub.stop()


def test_late_agent_gets_the_backlog(sock_path: Path) -> None:
    link = AgentLink(RankIdentity("j", 0, 1, "h", 1), socket_path=str(sock_path), jsonl_path=None, handler=None,
                     flush_interval_s=0.05, reconnect_s=0.05)
    link.start()
    for n in range(3):
        link.submit(StepRecord("j", 0, n, 0.0, 0.1))
    time.sleep(0.2)  # nobody listens yet: records wait in the queue
    assert link.stats.sent == 0 and link.stats.dropped == 0
    hub = RankHub(sock_path)
    got: list[StepRecord] = []
    hub.add_listener(on_steps=lambda i, rs: got.extend(rs))
    hub.start()
    try:
        until(lambda: len(got) == 3)
        hub.stop()  # the agent restarts…
        link.submit(StepRecord("j", 0, 3, 0.0, 0.1))
        hub = RankHub(sock_path)
        hub.add_listener(on_steps=lambda i, rs: got.extend(rs))
        hub.start()
        until(lambda: len(got) == 4)  # …and the rank reconnects by itself
        assert [r.step for r in got] == [0, 1, 2, 3]
        assert link.stats.connects == 2
    finally:
        link.close()
        hub.stop()


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    t = Tracker(socket_path=str(tmp_path / "none.sock"), env=ENV, max_queue=5, flush_interval_s=60)
    start = time.perf_counter()
    for _ in range(50):
        with t.step():
            pass
    assert time.perf_counter() - start < 0.5
    st = t.stats()
    assert st["submitted"] == 50 and st["dropped"] == 45
    t.close(timeout_s=1)
    assert t.stats()["dropped"] == 50  # nothing could take the 5 queued ones either


def test_jsonl_shared_by_ranks_keeps_whole_lines(tmp_path: Path) -> None:
    out = tmp_path / "all.jsonl"
    trackers = [Tracker(out, socket_path="", env={**ENV, "RANK": str(r)}, flush_interval_s=0.01) for r in range(4)]

    def run(t: Tracker) -> None:
        for _ in range(200):
            with t.step():
                pass

    threads = [threading.Thread(target=run, args=(t,)) for t in trackers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in trackers:
        t.close()
    recs = read_jsonl(out)
    assert len(recs) == 800
    assert sorted({r.rank for r in recs}) == [0, 1, 2, 3]


def test_unwritable_jsonl_counts_errors_and_drops(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    t = Tracker(blocker / "steps.jsonl", socket_path="", env=ENV)
    with t.step():
        pass
    t.close()
    st = t.stats()
    assert st["dropped"] == 1 and st["errors"] >= 1 and str(blocker) in st["last_error"]


def test_link_ignores_garbage_from_the_agent_and_answers_requests(sock_path: Path) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)
    ident = RankIdentity("j", 0, 1, "h", 1)
    link = AgentLink(ident, socket_path=str(sock_path), jsonl_path=None, handler=control.handle_request,
                     flush_interval_s=0.05)
    link.start()
    conn, _ = srv.accept()
    conn.settimeout(5)
    conn.sendall(b"nonsense\n" + protocol.encode({"type": "who_knows"}) + protocol.encode({"type": "stacks"})
                 + protocol.encode(protocol.stacks_request("q1")))
    buf = protocol.LineBuffer()
    msgs: list[dict[str, Any]] = []
    while not any(m["type"] == "reply" for m in msgs):
        msgs.extend(buf.feed(conn.recv(1 << 20)))
    assert msgs[0] == protocol.hello(ident)
    reply = next(m for m in msgs if m["type"] == "reply")
    assert reply["id"] == "q1" and reply["ok"] is True and "gpuhealth-instrument" in reply["stacks"]["text"]
    assert link.stats.malformed == 1
    link.close()
    conn.close()
    srv.close()


# -- request handlers ----------------------------------------------------------------------------


def test_handle_request_answers_known_and_ignores_unknown(tmp_path: Path) -> None:
    ident = RankIdentity("j", 4, 8, "h", 1)
    assert control.handle_request({"type": "hello"}, ident) == []
    assert control.handle_request({"type": "dump_fr"}, ident) == []  # no id: nothing to answer to
    bad = control.handle_request({"type": "dump_fr", "id": "a"}, ident)
    assert bad == [{"type": "reply", "id": "a", "ok": False, "error": "dump_fr needs 'inline' or a 'dir'"}]
    blocker = tmp_path / "f"
    blocker.write_text("")
    (err,) = control.handle_request({"type": "dump_fr", "id": "b", "dir": str(blocker / "sub")}, ident)
    assert err["ok"] is False and "cannot write" in err["error"]


def test_python_stacks_names_every_thread_and_function() -> None:
    ready = threading.Event()
    release = threading.Event()

    def parked_in_data_loader() -> None:
        ready.set()
        release.wait(10)

    th = threading.Thread(target=parked_in_data_loader, name="loader-0")
    th.start()
    ready.wait(5)
    try:
        stacks = control.python_stacks()
    finally:
        release.set()
        th.join()
    loader = next(t for t in stacks["threads"] if t["name"] == "loader-0")
    assert not loader["main"] and "parked_in_data_loader" in [f["function"] for f in loader["frames"]]
    assert "Thread " in stacks["text"] and "parked_in_data_loader" in stacks["text"]
    assert stacks["pid"] == os.getpid()


# -- real torch.distributed (Gloo, one process) ------------------------------------------------------


@pytest.fixture
def gloo_world() -> Iterator[Any]:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="gh-store-") as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
        try:
            yield dist
        finally:
            dist.destroy_process_group()


def test_wrap_collectives_counts_wait_and_unwraps(gloo_world: Any, tmp_path: Path) -> None:
    import torch

    dist = gloo_world
    original = dist.all_reduce
    clock = FakeClock()

    class TickingTimer(HostTimer):
        def begin_collective(self) -> None:
            super().begin_collective()
            clock.t += 0.25  # every counted collective "waits" 0.25 s on this clock

    t = Tracker(tmp_path / "w.jsonl", socket_path="", env=ENV, timer=TickingTimer(clock=clock))
    names = t.wrap_collectives()
    assert "all_reduce" in names and "all_gather_object" in names
    assert t.wrap_collectives() == []  # twice is harmless
    x = torch.ones(8)
    dist.all_reduce(x)  # outside a step: passes through
    with t.step():
        dist.all_reduce(x)
        with t.collective():  # the user's own block around a wrapped call: counted once
            dist.all_reduce(x)
        dist.barrier()
    t.close()
    assert dist.all_reduce is original
    assert torch.equal(x, torch.ones(8))
    (r,) = read_jsonl(tmp_path / "w.jsonl")
    assert r.comm_wait_s == pytest.approx(0.75)


def test_nccl_timing_falls_back_when_the_backend_has_no_timing(gloo_world: Any, tmp_path: Path, gpu: Any) -> None:
    import torch

    dist = gloo_world
    t = Tracker(tmp_path / "n.jsonl", socket_path="", env=ENV, timer=LazyEventTimer(gpu.event), nccl_timing=True)
    t.wrap_collectives(["all_reduce"])
    x = torch.ones(4)
    with t.step():
        gpu.launch(5.0)
        assert dist.all_reduce(x) is None  # a sync call stays sync for the caller
    gpu.run(10.0)
    # Gloo's Work has no timing: once that step is resolved, its split is unknown and later steps
    # bracket collectives with events instead.
    until(lambda: t.nccl_timing is False)
    with t.step():
        gpu.launch(5.0)
        dist.all_reduce(x)
    t.close()
    recs = read_jsonl(tmp_path / "n.jsonl")
    assert recs[0].wall_s == pytest.approx(0.005) and recs[0].compute_s is None
    assert recs[-1].comm_wait_s is not None
    assert torch.equal(x, torch.ones(4))


def test_flight_recorder_dump_is_the_real_json(gloo_world: Any, tmp_path: Path) -> None:
    import torch

    gloo_world.all_reduce(torch.ones(2))
    res = control.dump_flight_recorder(str(tmp_path / "d"), 6)
    assert res["source"] == "_dump_fr_trace_json" and res["bytes"] > 0
    dump = json.loads(Path(res["path"]).read_text())
    assert Path(res["path"]).name == "rank6.json"
    assert any(e["profiling_name"] == "gloo:all_reduce" for e in dump["entries"])
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["rank6.json"]  # no temp file left behind


# -- the dumps the hook writes feed triage ----------------------------------------------------------


def test_real_nccl_dumps_from_the_hook_triage_to_the_right_rank() -> None:
    """Dumps our hook took on 2 x H200 (data/…/README.md): triage names the hung rank and the straggler."""
    from gpuhealth.flightrec.verdict import triage

    folder = Path(__file__).parent / "data" / "nccl_h200x2_straggler_hang"
    report = triage(folder)
    assert report.verdict == "hang" and report.culprits == [1]
    codes = {(f.code, int(f.evidence["rank"])) for f in report.findings}
    assert ("collective.missing_rank", 1) in codes and ("rank.straggler", 1) in codes
    assert report.identity == {0: "filename", 1: "filename"}  # the rank comes from the hook's file name


def test_jsonl_records_carry_the_world_size(tmp_path: Path) -> None:
    # Offline triage of some ranks' records then knows which ranks it lacks (issue 33).
    out = tmp_path / "r.jsonl"
    t = Tracker(out, socket_path="", env=ENV, flush_interval_s=0.01)
    with t.step():
        pass
    t.close()
    (rec,) = read_jsonl(out)
    assert (rec.rank, rec.world_size) == (2, 4)
    # A record whose world cannot hold its rank is a bad line, not a smaller world.
    with pytest.raises(ValueError):
        StepRecord.from_dict({**rec.to_dict(), "world_size": 2})
    # Records of older hooks (no world_size) still read.
    legacy = {k: v for k, v in rec.to_dict().items() if k != "world_size"}
    assert StepRecord.from_dict(legacy).world_size is None
