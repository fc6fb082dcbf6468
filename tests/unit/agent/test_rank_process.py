"""The root part's side of the privilege split (issue 30): the channel's schema, what the root part believes of
the rank process (nothing it cannot check), and py-spy pointed only at pids it may trace."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from typing import Any

import pytest

from gpuhealth.agent.coordinator_requests import ExecutorSettings, RequestExecutor
from gpuhealth.agent.rank_process import RankProcess, pid_may_be_traced
from gpuhealth.agent.tenant_channel import TO_RANK_PROCESS, TO_ROOT, Channel, ChannelError, check
from gpuhealth.model import RankIdentity, StepRecord
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

IDENT = RankIdentity("j", 0, 2, "h", 1234).to_dict()


@pytest.mark.parametrize("message, payload, why", [
    ({"op": "shell", "rid": 1}, b"", "unexpected op"),
    ({"op": "end", "rid": 1, "extra": 1}, b"", "unexpected fields"),
    ({"op": "end", "rid": True}, b"", "not a int"),
    ({"op": "end", "rid": "1"}, b"", "not a int"),
    ({"op": "value", "rid": 1, "ranks": "all", "stats": None}, b"", "not a list"),
    ({"op": "identity", "identity": IDENT}, b"x", "carries bytes"),
    ({"op": "verify", "rid": 1, "pid": 1, "job_id": "j" * 5000}, b"", "not a str"),
])
def test_the_root_part_refuses_any_frame_outside_the_schema(message: dict[str, Any], payload: bytes, why: str) -> None:
    with pytest.raises(ChannelError, match=why):
        check(message, TO_ROOT, payload)


def test_ops_are_one_way() -> None:
    """The child cannot send what the root part sends (a 'dump' request), nor the root part a 'verify'."""
    with pytest.raises(ChannelError):
        check({"op": "dump", "rid": 1, "job_id": "j", "rank": None, "out_dir": None, "timeout_s": 1.0}, TO_ROOT, b"")
    with pytest.raises(ChannelError):
        check({"op": "verify", "rid": 1, "pid": 1, "job_id": "j"}, TO_RANK_PROCESS, b"")


def test_an_oversized_frame_is_refused_before_it_is_read() -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(struct.pack("!II", 64, 1 << 30))  # a 1 GiB payload announced: nothing is allocated for it
        with pytest.raises(ChannelError, match="over the channel's limits"):
            Channel(b, TO_ROOT).receive()
        a.sendall(struct.pack("!II", 5 << 20, 0))
        with pytest.raises(ChannelError, match="over the channel's limits"):
            Channel(b, TO_ROOT).receive()
    finally:
        a.close()
        b.close()


def test_a_round_trip_carries_a_dump_as_bytes() -> None:
    a, b = socket.socketpair()
    try:
        msg = {"op": "answer", "rid": 3, "rank": 1, "kind": "dump", "path": None, "stacks": None, "error_type": None,
               "error": None}
        Channel(a, TO_RANK_PROCESS).send(msg, b"\x80\x02}q\x00.")
        op, got, payload = Channel(b, TO_ROOT).receive()
        assert (op, got, payload) == ("answer", msg, b"\x80\x02}q\x00.")
    finally:
        a.close()
        b.close()


def test_step_records_count_only_for_the_identity_they_come_with() -> None:
    """A rank process that was taken over cannot put steps of another job or rank into the agent."""
    rp = RankProcess("/nonexistent/agent.sock")
    got: list[tuple[str, int, int]] = []
    rp.add_listener(on_steps=lambda ident, recs: got.extend((r.job_id, r.rank, r.step) for r in recs))
    own = StepRecord("j", 0, 5, 1.7e9, 0.1, 0.08, 0.02).to_dict()
    other = StepRecord("other-job", 3, 9, 1.7e9, 0.1, 0.08, 0.02).to_dict()
    rp._dispatch("steps", {"op": "steps", "identity": IDENT, "records": [own, other, {"step": "x"}]}, b"")
    assert got == [("j", 0, 5)]
    assert rp.stats()["rank_process_bad_records"] == 2
    assert rp.stats()["records"] == 1


def test_py_spy_is_pointed_only_at_a_pid_it_may_trace() -> None:
    """A root process that does not name the job is never traced on the rank process's word; one whose own
    environment names the job is."""
    env = {**os.environ, "GPUHEALTH_JOB_ID": "named-job"}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"  # exec'd: its own environment now
        owner_root = os.stat(f"/proc/{proc.pid}").st_uid == 0
        assert pid_may_be_traced(proc.pid, "named-job")
        assert pid_may_be_traced(proc.pid, "another-job") is (not owner_root)
    finally:
        proc.kill()
        proc.wait()
    assert not pid_may_be_traced(2**22 + 7, "named-job")  # no such process


class _Source:
    """A rank source that vouches for no pid (as ``RankProcess`` for a root process)."""

    def ranks(self, job_id: str | None = None) -> list[RankIdentity]:
        return [RankIdentity("j", 0, 1, "h", 1)]

    def traceable_pid(self, ident: RankIdentity) -> int | None:
        return None

    def iter_dumps(self, *a: Any, **k: Any) -> Any:
        return iter(())

    def request_stacks(self, job_id: str, rank: int | None, timeout_s: float = 10.0) -> dict[int, Any]:
        return {0: LookupError("no hook")}


def test_stacks_of_an_untraceable_pid_say_why_and_run_no_py_spy(tmp_path: Any) -> None:
    marker = tmp_path / "ran"
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\necho '[]'\n")
    fake.chmod(0o755)
    ex = RequestExecutor(ExecutorSettings(pyspy=True, pyspy_path=str(fake)), ranks=_Source())
    out: list[pb.RequestResult] = []
    try:
        ex.stacks(pb.AgentRequest(request_id=1, kind=pb.CAPTURE_STACKS, job_id="j", rank=-1, timeout_s=5), out.append)
    finally:
        ex.close()
    assert not marker.exists()
    assert len(out) == 1 and not out[0].ok and "not traced" in out[0].error


BAD_CHILD = r'''
import argparse, os, socket, sys, time
from gpuhealth.agent.tenant_channel import TO_RANK_PROCESS, Channel
ap = argparse.ArgumentParser()
for a in ("--listen-fd", "--channel-fd", "--socket-path", "--uid", "--gid", "--memory-bytes", "--cpu-seconds"):
    ap.add_argument(a)
args = ap.parse_args()
ch = Channel(socket.socket(fileno=int(args.channel_fd)), TO_RANK_PROCESS)
from gpuhealth.agent.tenant_proc import sandbox  # SANDBOX
sandbox(None, None, 0, 0)  # SANDBOX
ch.send({"op": "ready", "pid": os.getpid(), "uid": os.geteuid()})
time.sleep(0.2)
ch.send({"op": "identity", "identity": {"job_id": "j", "rank": 0}, "admin": True})  # a field no op has
time.sleep(30)
'''


def _wait(cond: Any, timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_frame_outside_the_schema_costs_the_child_its_life(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The root part treats the rank process as untrusted: a frame with a field its op does not have closes the
    channel, the child is killed and another is started (the agent's listeners never see the frame)."""
    (tmp_path / "bad_child.py").write_text(BAD_CHILD)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    rp = RankProcess(tmp_path / "s" / "agent.sock", child_module="bad_child", restart_backoff_s=(0.2, 0.2))
    seen: list[Any] = []
    rp.add_listener(on_identity=seen.append)
    rp.start()
    try:
        _wait(lambda: rp.restarts >= 1)
        assert "unexpected fields" in rp.last_exit, rp.last_exit
        assert rp.stats()["rank_process_rejected_frames"] >= 1
        assert seen == []
    finally:
        rp.stop()


def test_a_spent_cpu_budget_gives_a_fresh_rank_process(tmp_path: Any) -> None:
    """RLIMIT_CPU is a lifetime budget: at its soft limit the child exits and the root part starts another."""
    rp = RankProcess(tmp_path / "s" / "agent.sock", cpu_seconds=1, restart_backoff_s=(0.2, 0.2))
    rp.start()
    first = rp.child_pid
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(tmp_path / "s" / "agent.sock"))
        sock.settimeout(1.0)
        line = b'{"type":"hello","identity":{"job_id":"j","rank":0,"world_size":1,"host":"h","pid":1}}\n'
        junk = b"[" + b"1," * 400_000 + b"1]\n"  # parsed and refused, over and over: CPU time in the child
        import time

        deadline = time.monotonic() + 60
        try:
            sock.sendall(line)
            while rp.restarts == 0 and time.monotonic() < deadline:
                sock.sendall(junk)
        except OSError:
            pass  # the child died under it
        _wait(lambda: rp.restarts >= 1 and rp.child_pid != first, 30)
        assert "CPU-time budget of 1 s" in rp.last_exit and "exit status 75" in rp.last_exit, rp.last_exit
        _wait(lambda: rp.ranks() == [] and rp.stats().get("connected") == 0)  # the new one serves
    finally:
        rp.stop()


def test_a_child_that_did_not_sandbox_itself_never_serves(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The root part reads the child's /proc status after its ready: a child without no_new_privs (here one
    that skips the sandbox) is killed, and the socket is not served by it."""
    lax = "\n".join(line for line in BAD_CHILD.splitlines() if "# SANDBOX" not in line)
    (tmp_path / "lax_child.py").write_text(lax)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    from gpuhealth.agent.ranks import RankHubError

    rp = RankProcess(tmp_path / "s" / "agent.sock", child_module="lax_child")
    with pytest.raises(RankHubError, match=r"not sandboxed .*NoNewPrivs is 0"):
        rp.start()
    assert not (tmp_path / "s" / "agent.sock").exists()


def test_the_rank_process_imports_only_what_it_needs() -> None:
    """docs/architecture.md: the rank process loads the hub, the instrument protocol and the vocabulary — none of
    the tracker, the config, the wire to the coordinator, grpc, yaml or torch (it parses tenants' bytes: less code,
    less to attack, and each agent pays its memory)."""
    code = "import sys, gpuhealth.agent.tenant_proc; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    ours = {m for m in loaded if m.startswith("gpuhealth")}
    assert ours == {"gpuhealth", "gpuhealth.agent", "gpuhealth.agent.ranks", "gpuhealth.agent.tenant_channel",
                    "gpuhealth.agent.tenant_proc", "gpuhealth.instrument", "gpuhealth.instrument.protocol",
                    "gpuhealth.model", "gpuhealth.runtime", "gpuhealth.runtime.logs",
                    "gpuhealth.runtime.threadnames"}, sorted(ours)
    assert not loaded & {"torch", "grpc", "yaml", "numpy", "google.protobuf", "psutil"}
