"""Issue 24: triage of dumps that came from jobs never runs inside the coordinator. A real ``gpuhealth
coordinator``, an agent (raw gRPC) that answers a live triage with a hostile 32 MiB pickle as a rank's
``fr_pickle``, and ``gpuhealth triage --job`` as an operator runs it: the coordinator's peak memory stays
where receiving the payload puts it (it was 63 → 2,474 MiB), the verdict says what was wrong with the
evidence, and the coordinator keeps serving. The child's own cap and deadline are tested directly."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from simagent import SimAgent, step_batch_message

from gpuhealth.coordinator import triage_child
from gpuhealth.coordinator.triage_child import triage_in_child
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

pytestmark = pytest.mark.integration

MIB = 1 << 20
_GPUHEALTH = Path(sys.executable).with_name("gpuhealth")
CLI = [str(_GPUHEALTH)] if _GPUHEALTH.exists() else [sys.executable, "-m", "gpuhealth.cli.main"]
HOSTILE = b"\x80\x04" + b"\x8f" * (32 * MIB) + b"."  # 32 MiB of empty sets: ~7.5 GB if built


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


async def _answer(agent: SimAgent, payloads: dict[int, bytes], answered: set[int]) -> None:
    """Answer each request as an agent with ranks 0 and 1 would: dumps from ``payloads``, no stacks."""
    while True:
        for req in list(agent.requests):
            if req.request_id in answered:
                continue
            answered.add(req.request_id)
            if req.kind == pb.DUMP_FLIGHT_RECORDER:
                for rank, payload in payloads.items():
                    fmt = "fr_pickle" if payload[:1] == b"\x80" else "fr_json"
                    await agent.send(pb.AgentMessage(result=pb.RequestResult(
                        request_id=req.request_id, rank=rank, ok=True, payload=payload, format=fmt,
                        final=rank == max(payloads))).SerializeToString())
            else:
                await agent.send(pb.AgentMessage(result=pb.RequestResult(
                    request_id=req.request_id, rank=-1, ok=False, error="no stacks here", final=True)
                ).SerializeToString())
        await asyncio.sleep(0.05)


@pytest.mark.timeout(180)
def test_a_hostile_dump_is_triaged_outside_the_coordinator(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    coord = subprocess.Popen(
        [*CLI, "coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--db", str(tmp_path / "c.db"),
         "--evidence-dir", str(tmp_path / "ev"), "--ready-file", str(ready), "--hang-floor", "3600"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "coordinator.log", "wb"))  # noqa: SIM115
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert coord.poll() is None and time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
            time.sleep(0.05)
        port = json.loads(ready.read_text())["grpc_port"]
        healthy = json.dumps({"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": []}).encode()

        async def attack() -> tuple[int, dict[str, Any], int]:
            agent = SimAgent(f"127.0.0.1:{port}", "node-a")
            await agent.register()
            await agent.connect()
            await agent.send(step_batch_message(1, "victim", [0, 1], 1))
            await agent.wait_acked(1)
            await asyncio.sleep(1.0)  # past start-up: what the coordinator holds at rest
            before = _status_kib(coord.pid, "VmHWM")
            answering = asyncio.create_task(_answer(agent, {0: HOSTILE, 1: healthy}, set()))
            proc = await asyncio.create_subprocess_exec(
                *CLI, "triage", "--job", "victim", "--coordinator", f"127.0.0.1:{port}", "--json",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(proc.communicate(), 150)
            answering.cancel()
            assert b"Traceback" not in err, err.decode()[-2000:]
            grown = _status_kib(coord.pid, "VmHWM") - before
            return proc.returncode or 0, json.loads(out), grown

        code, report, grown_kib = asyncio.run(attack())
        assert coord.poll() is None, "the coordinator died"
        # Receiving a 32 MiB message costs the coordinator its copies (gRPC's buffer, the message, the bytes
        # kept until written); triage in its own process would add ~360 MiB (the unpickler's budget).
        assert grown_kib < 200 * 1024, f"coordinator VmHWM grew {grown_kib >> 10} MiB"
        assert code == 3 and report["verdict"] == "incomplete", report.get("summary")
        errors = {p["rank"]: p["message"] for p in report["problems"] if p["severity"] == "error"}
        assert list(errors) == [0] and "builds more than its 384 MiB memory budget" in errors[0], errors
        assert Path(report["evidence"]["fr_dumps"]["0"]).stat().st_size == len(HOSTILE)  # the evidence is kept
    finally:
        coord.terminate()
        coord.wait(20)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_child_runs_out_of_memory_within_its_cap_and_says_so(tmp_path: Path) -> None:
    """Under a cap below what a file needs, the loader's MemoryError is one problem line of the child's report
    (the other ranks are judged), and the coordinator's process never held any of it."""
    dump_dir = tmp_path / "fr"
    dump_dir.mkdir()
    (dump_dir / "rank_0.pkl").write_bytes(b"\x80\x04" + b"]" * (8 * MIB) + b".")  # 640 MiB of lists if built
    (dump_dir / "rank_1.json").write_text(json.dumps({"version": "2.10", "pg_config": {}, "entries": []}))
    probe = ("import gpuhealth.coordinator.triage_child, gpuhealth.flightrec.verdict; from pathlib import Path; "
             "print(next(int(l.split()[1]) for l in Path('/proc/self/status').read_text().splitlines() "
             "if l.startswith('VmSize:')) * 1024)")
    vsz = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    report, error = _run(triage_in_child(dump_dir, {"job_id": "j"}, memory_bytes=vsz + 128 * MIB))
    assert error == "" and report is not None
    problems = {p.rank: p.message for p in report.problems if p.severity == "error"}
    assert list(problems) == [0] and problems[0].startswith("ran out of memory unpickling it"), problems
    assert report.ranks_seen == [1]


def test_a_child_that_does_not_finish_is_stopped_and_named(tmp_path: Path) -> None:
    dump_dir = tmp_path / "fr"
    dump_dir.mkdir()
    (dump_dir / "rank_0.pkl").write_bytes(b"\x80\x04" + b"N0" * (24 * MIB) + b".")  # ~20 s of pure-Python work
    started = time.monotonic()
    report, error = _run(triage_in_child(dump_dir, {"job_id": "j"}, timeout_s=1.0))
    assert report is None and error.startswith("triage did not finish within 1 s and was stopped")
    assert time.monotonic() - started < 10


def test_the_child_reports_a_memory_error_outside_the_loader_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def exhausted(*_: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(triage_child, "run_triage", exhausted)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert triage_child.main([str(tmp_path), "{}"]) == triage_child.EXIT_OUT_OF_MEMORY
    assert capsys.readouterr().err == "triage ran out of memory (cap 768 MiB)\n"


def test_dumps_go_to_disk_as_they_arrive_not_into_the_coordinators_memory(tmp_path: Path) -> None:
    from gpuhealth.coordinator.requests import PendingRequest

    pending = PendingRequest(1, pb.DUMP_FLIGHT_RECORDER, "j", {"n1"}, spool_dir=tmp_path)
    dump = b"\x80\x04" + b"N" * 1000 + b"."
    pending.add("n1", pb.RequestResult(request_id=1, rank=3, ok=True, payload=dump, format="fr_pickle"))
    pending.add("n1", pb.RequestResult(request_id=1, rank=4, ok=True, payload=b'{"entries": []}', final=True))
    three, four = pending.answers[3], pending.answers[4]
    assert three.ok and three.raw == b"" and Path(three.path).read_bytes() == dump
    assert four.ok and four.raw == b"" and Path(four.path).name == "rank_4.json"
    assert oct(Path(three.path).stat().st_mode & 0o777) == "0o600"  # the job's evidence: the service's alone
