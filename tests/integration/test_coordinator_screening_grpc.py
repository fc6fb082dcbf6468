"""Fleet screening over the real wire (issue 18): simulated agents (tests/simagent.py) report screens over
gRPC to a real coordinator; coverage is read back from its real /metrics and `GetFleet`; screening turns
come down the Connect stream; garbage is refused with a status naming the field; a coordinator killed
with SIGKILL and started again on the same database reports the same coverage and continues the turns."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from simagent import SimAgent, screen_result, screens_message

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.query import fleet
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

pytestmark = pytest.mark.integration

KEY = "NVIDIA H100 80GB HBM3/132sm/cuda12.8/cublas/gemm-4096-bf16"


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on the coordinator's /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def _scrape_until(port: int, cond: Callable[[dict], bool], timeout_s: float = 10.0) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while True:
        samples = await asyncio.to_thread(_scrape, port)
        if cond(samples) or time.monotonic() > deadline:
            return samples
        await asyncio.sleep(0.1)


def _with_server(tmp_path: Path, body: Callable[[CoordinatorServer], Awaitable[None]], **settings: object) -> None:
    async def main() -> None:
        coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(
            evidence_dir=str(tmp_path / "ev"), tick_s=0.1, hang_floor_s=3600, **settings))  # type: ignore[arg-type]
        srv = CoordinatorServer(coord, listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", policy=AuthPolicy(),
                                metrics_interval_s=0.1)
        await srv.start()
        try:
            await asyncio.wait_for(body(srv), 60)
        finally:
            await srv.stop(0)

    asyncio.run(main())


def _addr(srv: CoordinatorServer) -> str:
    assert srv.endpoints is not None
    return f"127.0.0.1:{srv.endpoints.grpc_port}"


def _holders(agents: list[SimAgent]) -> list[str]:
    return sorted(a.node for a in agents if a.holds_turn())


async def _settled(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Wait until ``cond`` holds — turns travel over each agent's own stream, in no set time on a loaded
    machine — then check it still holds a moment later (no extra turn was on its way)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    assert cond(), f"{what}: no longer so 0.3 s later"


async def _agents(addr: str, names: list[str], gpus: int) -> list[SimAgent]:
    agents = [SimAgent(addr, n, gpus=gpus) for n in names]
    for a in agents:
        await a.register()
        await a.connect()
    return agents


def test_coverage_from_simulated_agents_is_on_the_real_metrics_and_in_the_fleet_view(tmp_path: Path) -> None:
    _with_server(tmp_path, _coverage)


async def _coverage(srv: CoordinatorServer) -> None:
    assert srv.endpoints is not None and srv.endpoints.metrics_port is not None
    port = srv.endpoints.metrics_port
    agents = await _agents(_addr(srv), ["n1", "n2", "n3", "n4"], gpus=2)
    now = time.time()
    n1, n2, n3, _n4 = agents
    # n1: both GPUs pass; n2: GPU 0 fails (SDC), GPU 1 is aborted by a job; n3: screened two days ago.
    await n1.send(screens_message(1, [screen_result(u, index=i, finished_at=now - 60, digests=[(KEY, "aa")])
                                      for i, u in enumerate(n1.gpu_uuids())]))
    await n2.send(screens_message(1, [
        screen_result(n2.gpu_uuids()[0], index=0, finished_at=now - 30, result="fail", level="quick",
                      trigger="epilog", reason="SDC: digest differs from the golden", digests=[(KEY, "bb")]),
        screen_result(n2.gpu_uuids()[1], index=1, finished_at=now - 20, result="aborted",
                      reason="a compute process appeared on the GPU")]))
    await n3.send(screens_message(1, [screen_result(u, index=i, finished_at=now - 2 * 86_400, level="periodic",
                                                    digests=[(KEY, "aa")]) for i, u in enumerate(n3.gpu_uuids())]))
    for a in (n1, n2, n3):
        await a.wait_acked(1)
    samples = await _scrape_until(port, lambda s: s.get(("gpuhealth_fleet_screens_total", (("level", "periodic"),
                                                                                            ("result", "pass")))) == 2)
    assert samples[("gpuhealth_fleet_gpus", ())] == 8
    assert samples[("gpuhealth_fleet_gpus_unscreened", ())] == 5  # n2 GPU 1 (aborted), n3 (old), n4 (never)
    assert samples[("gpuhealth_fleet_screen_coverage_ratio", ())] == pytest.approx(3 / 8)
    assert samples[("gpuhealth_fleet_screen_oldest_age_seconds", ())] == pytest.approx(2 * 86_400, abs=30)
    assert samples[("gpuhealth_fleet_screens_total", (("level", "quick"), ("result", "pass")))] == 2
    assert samples[("gpuhealth_fleet_screens_total", (("level", "quick"), ("result", "fail")))] == 1
    assert samples[("gpuhealth_fleet_screens_total", (("level", "quick"), ("result", "aborted")))] == 1
    assert samples[("gpuhealth_fleet_screens_total", (("level", "full"), ("result", "error")))] == 0
    assert samples[("gpuhealth_fleet_screen_turns", ())] == 1  # 10 % of 4 nodes: at least one

    doc = await asyncio.to_thread(fleet, _addr(srv))
    scr = doc["screening"]
    assert (scr["gpus"], scr["screened"], scr["unscreened"]) == (8, 3, 5)
    assert [f["uuid"] for f in scr["failed"]] == ["GPU-n2-0"] and scr["failed"][0]["trigger"] == "epilog"
    assert scr["oldest"]["node"] == "n3"
    oldest = scr["least_recently_screened"]
    # Longest ago first; the never-screened count from their registration (after the agents' screens of n1, n2).
    assert [g["uuid"] for g in oldest] == ["GPU-n3-0", "GPU-n3-1", "GPU-n1-0", "GPU-n1-1", "GPU-n2-0", "GPU-n2-1",
                                           "GPU-n4-0", "GPU-n4-1"]
    assert oldest[5]["screened_at"] is None and oldest[5]["last_attempt"]["result"] == "aborted"
    assert oldest[4]["result"] == "fail" and oldest[6]["last_attempt"] is None
    # The digests voted fleet-wide per golden key: n2's GPU 0 disagrees with the four others.
    assert [(f["code"], f["entity"]["id"]) for f in doc["sdc"]] == [("sdc.mismatch", "GPU-n2-0")]

    # `gpuhealth fleet` says it in words, and a failed screen makes the exit code 1.
    from click.testing import CliRunner

    from gpuhealth.cli.main import cli

    res = await asyncio.to_thread(CliRunner().invoke, cli, ["fleet", "--coordinator", _addr(srv)])
    assert res.exit_code == 1, res.output
    text = " ".join(res.output.split())
    assert "screening: 3 of 8 GPUs (37.5 %) screened within 24.0 h; 5 not" in text
    assert "least recently screened: node n3 GPU 0 (GPU-n3-0): screened 2.0 d ago (periodic, pass)" in text
    assert "least recently screened: node n2 GPU 0 (GPU-n2-0): screened 30 s ago (quick, fail)" in text
    assert ("screen FAILED: node n2 GPU 0 (GPU-n2-0), quick (epilog), 30 s ago: SDC: digest differs from the "
            "golden") in text
    holder = scr["rotation"]["turns"][0]["node"]
    # n1 reported every GPU screened: its turn went to n2 (a GPU never completed), then the never-screened n4.
    assert holder == "n2" and "screening turns (1 of 1 slots, 30 min each): n2 (30 min left)" in text
    assert "next: n4 (in 30 min), n3 (in 60 min), n1 (in 90 min)" in text
    for a in agents:
        await a.close()


def test_turns_rotate_over_the_stream(tmp_path: Path) -> None:
    _with_server(tmp_path, _turns, screen_concurrency=0.25, screen_turn_s=600)


async def _turns(srv: CoordinatorServer) -> None:
    names = [f"node{i}" for i in range(8)]
    agents = await _agents(_addr(srv), names, gpus=2)
    for a in agents:  # every connected node hears a turn: now, or its slot later
        await a.wait_turn(lambda t: True)
    await _settled(lambda: len(_holders(agents)) == 2, "2 holders (25 % of 8)")
    holders = _holders(agents)
    waiting = [a for a in agents if not a.holds_turn()]
    assert all(a.turn is not None and a.turn.not_before > time.time() for a in waiting)
    first = next(a for a in agents if a.node == holders[0])
    # The holder reports both GPUs screened: its turn ends, the next node in line gets one at once.
    await first.send(screens_message(1, [screen_result(u, index=i, finished_at=time.time())
                                         for i, u in enumerate(first.gpu_uuids())]))
    await first.wait_acked(1)
    await first.wait_turn(lambda t: t.not_before > 0)  # told to wait for its next turn

    def handed_on() -> bool:
        now = _holders(agents)
        return len(now) == 2 and holders[0] not in now and holders[1] in now

    await _settled(handed_on, f"{holders[0]}'s turn to go to the next node")
    now_holders = _holders(agents)
    # A holder that reconnects hears its turn again, with what is left of it.
    second = next(a for a in agents if a.node == holders[1])
    await second.close()
    again = SimAgent(_addr(srv), holders[1], gpus=2)
    await again.register()
    await again.connect()
    turn = await again.wait_turn(lambda t: True)
    assert turn.not_before == 0 and 590 < turn.valid_for_s <= 600
    doc = await asyncio.to_thread(fleet, _addr(srv))
    assert sorted(t["node"] for t in doc["screening"]["rotation"]["turns"]) == sorted(now_holders)
    for a in [*agents, again]:
        await a.close()


def test_garbage_screens_get_a_clear_status_and_nothing_else_is_lost(tmp_path: Path) -> None:
    _with_server(tmp_path, _garbage)


async def _garbage(srv: CoordinatorServer) -> None:
    assert srv.endpoints is not None and srv.endpoints.metrics_port is not None
    addr = _addr(srv)
    [good] = await _agents(addr, ["n1"], gpus=2)
    uuid = good.gpu_uuids()[0]
    await good.send(screens_message(1, [screen_result(uuid, finished_at=time.time() - 5)]))
    await good.wait_acked(1)
    await good.close()
    now = time.time()
    garbage = [
        (screen_result(uuid, finished_at=float("nan")), "started_at: nan is not a time"),
        (screen_result(uuid, finished_at=now, result="ok"), "result: 'ok' is not one of pass, fail, aborted, error"),
        (screen_result(uuid, finished_at=now, result="fail", reason="r" * 10_000_000), "reason: 10000000 characters"),
    ]
    seq = 2
    for screen, message in garbage:
        agent = SimAgent(addr, "n1", gpus=2)
        await agent.register()
        await agent.connect()
        await agent.send(screens_message(seq, [screen]))
        assert await agent.status() is grpc.StatusCode.INVALID_ARGUMENT
        details = await agent.call.details()
        assert message in details and f"record seq {seq}: screens[0]" in details, details
        await agent.close()
        seq += 1
    agent = SimAgent(addr, "n1", gpus=2)
    await agent.register()
    await agent.connect()
    await agent.send(screens_message(seq, [screen_result(uuid, finished_at=now) for _ in range(100_000)]))
    assert await agent.status() is grpc.StatusCode.INVALID_ARGUMENT
    assert "100000 screens in one record is over 1024" in await agent.call.details()
    await agent.close()
    # The rejected seqs are consumed, the first screen is kept, the next record is taken.
    last = SimAgent(addr, "n1", gpus=2)
    assert (await last.register()).acked_seq == seq
    await last.connect()
    await last.send(screens_message(seq + 1, [screen_result(last.gpu_uuids()[1], finished_at=time.time())]))
    await last.wait_acked(seq + 1)
    samples = await _scrape_until(srv.endpoints.metrics_port,
                                  lambda s: s.get(("gpuhealth_fleet_gpus_unscreened", ())) == 0)
    assert samples[("gpuhealth_fleet_gpus_unscreened", ())] == 0
    assert samples[("gpuhealth_fleet_screens_total", (("level", "quick"), ("result", "pass")))] == 2
    assert samples[("gpuhealth_coordinator_rejected_records_total", ())] == 4
    await last.close()


def test_screens_of_gpus_a_node_does_not_have_are_not_kept_nor_voted(tmp_path: Path) -> None:
    _with_server(tmp_path, _foreign_gpus)


async def _foreign_gpus(srv: CoordinatorServer) -> None:
    """An agent that reports screens for GPUs it never registered (a bug, a swapped card's spooled screens,
    an attacker with a node credential): its records are taken (its real screens count), but the others
    neither grow the coordinator's memory and database nor outvote the fleet's digests."""
    assert srv.endpoints is not None and srv.endpoints.metrics_port is not None
    addr = _addr(srv)
    coord = srv.coord
    n1, n2, rogue = await _agents(addr, ["n1", "n2", "rogue"], gpus=2)
    now = time.time()
    for agent in (n1, n2):
        await agent.send(screens_message(1, [screen_result(u, index=i, finished_at=now - 60, digests=[(KEY, "aa")])
                                            for i, u in enumerate(agent.gpu_uuids())]))
        await agent.wait_acked(1)
    # rogue: its own GPU 0 passes; 5 records of 1,000 GPUs it does not have, all voting "bb"
    own = screen_result(rogue.gpu_uuids()[0], index=0, finished_at=now - 10, digests=[(KEY, "aa")])
    for seq in range(1, 6):
        fakes = [screen_result(f"GPU-fake-{seq}-{i}", index=i % 8, finished_at=now - 5, digests=[(KEY, "bb")])
                 for i in range(1_000)]
        await rogue.send(screens_message(seq, ([own] if seq == 1 else []) + fakes))
        await rogue.wait_acked(seq)
    assert len(coord.book.last) == 5 and sum(len(v) for v in coord.book.completed.values()) == 5
    assert len(coord.store.screens_last()) == 5
    samples = await _scrape_until(srv.endpoints.metrics_port,
                                  lambda s: s.get(("gpuhealth_fleet_gpus_unscreened", ())) == 1)
    assert samples[("gpuhealth_fleet_gpus", ())] == 6
    assert samples[("gpuhealth_fleet_gpus_unscreened", ())] == 1  # rogue's GPU 1
    assert coord.counters.foreign_screens == 5_000
    # what an operator sees: the dropped screens counted on /metrics
    dropped = await _scrape_until(srv.endpoints.metrics_port,
                                  lambda s: s.get(("gpuhealth_coordinator_foreign_screens_total", ())) == 5_000)
    assert dropped[("gpuhealth_coordinator_foreign_screens_total", ())] == 5_000
    doc = await asyncio.to_thread(fleet, addr)
    assert doc["sdc"] == []  # 5,000 made-up GPUs voting "bb" do not make the five real ones a mismatch
    for a in (n1, n2, rogue):
        await a.close()


# -- a real restart: the coordinator process killed and started again on its database ----------------


def _start(db: Path, port: int, metrics_port: int) -> tuple[subprocess.Popen[bytes], int, int]:
    """Ports 0 the first time (the kernel picks free ones; the ready file says which); the same again on a
    restart. Returns the process and its gRPC and metrics ports."""
    ready = db.parent / "ready.json"
    ready.unlink(missing_ok=True)
    config = db.parent / "coordinator.yaml"
    config.write_text("coordinator:\n  screen_concurrency: 0.5\n  screen_turn_s: 900\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuhealth.cli.main", "coordinator", "--config", str(config),
         "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics_port}", "--db", str(db),
         "--ready-file", str(ready), "--hang-floor", "3600"],
        stdout=subprocess.DEVNULL, stderr=open(db.parent / "coordinator.log", "ab"))  # noqa: SIM115
    deadline = time.monotonic() + 30
    while not ready.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError("the coordinator did not start: " + (db.parent / "coordinator.log").read_text())
        time.sleep(0.05)
    ports = json.loads(ready.read_text())
    assert port in (0, ports["grpc_port"]) and metrics_port in (0, ports["metrics_port"])
    return proc, int(ports["grpc_port"]), int(ports["metrics_port"])


@pytest.mark.timeout(120)
def test_a_killed_and_restarted_coordinator_keeps_coverage_and_turns(tmp_path: Path) -> None:
    db = tmp_path / "coord.db"
    proc, port, metrics_port = _start(db, 0, 0)
    try:
        asyncio.run(_before_kill(f"127.0.0.1:{port}", metrics_port))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc, _, _ = _start(db, port, metrics_port)
        asyncio.run(_after_restart(f"127.0.0.1:{port}", metrics_port))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


async def _before_kill(addr: str, metrics_port: int) -> None:
    agents = await _agents(addr, ["a", "b", "c", "d"], gpus=4)
    for a in agents:
        await a.wait_turn(lambda t: True)
    await _settled(lambda: _holders(agents) == ["a", "b"], "a and b to hold the turns")  # 50 % of 4, by name
    now = time.time()
    c = agents[2]
    await c.send(screens_message(1, [screen_result(u, index=i, finished_at=now - 10)
                                     for i, u in enumerate(c.gpu_uuids())]))
    await c.wait_acked(1)
    samples = await _scrape_until(metrics_port, lambda s: s.get(("gpuhealth_fleet_gpus_unscreened", ())) == 12)
    assert samples[("gpuhealth_fleet_screen_coverage_ratio", ())] == 0.25
    for a in agents:
        await a.close()


async def _after_restart(addr: str, metrics_port: int) -> None:
    samples = await _scrape_until(metrics_port, lambda s: s.get(("gpuhealth_fleet_gpus", ())) == 16)
    assert samples[("gpuhealth_fleet_gpus", ())] == 16
    assert samples[("gpuhealth_fleet_gpus_unscreened", ())] == 12
    assert samples[("gpuhealth_fleet_screen_coverage_ratio", ())] == 0.25
    assert samples[("gpuhealth_fleet_screen_oldest_age_seconds", ())] > 0  # from the first sighting, before the kill
    assert samples[("gpuhealth_fleet_screen_turns", ())] == 2  # the turns held before the kill continue
    agents = await _agents(addr, ["a", "b", "c", "d"], gpus=4)
    for a in agents:
        await a.wait_turn(lambda t: True)
    await _settled(lambda: _holders(agents) == ["a", "b"], "a and b to hold their turns again")
    b = agents[1]
    assert b.turn is not None and 800 < b.turn.valid_for_s < 900  # what is left of it, not a new one
    for a in agents:
        await a.close()


def test_a_screen_message_is_what_the_proto_says() -> None:
    # The helper the tests use builds the wire message the agent sends (Record payload 14).
    rec = pb.AgentMessage.FromString(screens_message(7, [screen_result("GPU-x", digests=[(KEY, "d")])])).record
    assert rec.seq == 7 and rec.WhichOneof("payload") == "screens"
    assert rec.screens.screens[0].digests[0].gpu_uuid == "GPU-x"


# -- the agent's own link (gpuhealth.agent.coordinator_link) against the coordinator: the two halves agree --


class _NodeView:
    """What the link reads of an agent: its name, its GPUs, its findings (none). The GPUs are the hardware
    boundary: two H100s by identity; the link, its spool and stream, and the coordinator are the real ones."""

    def __init__(self, name: str, uuids: list[str]) -> None:
        from gpuhealth.collectors.base import GpuIdentity

        self.node_name = name
        self.gpus = [GpuIdentity(i, u, "NVIDIA H100 80GB HBM3", f"00000000:{i + 0x18:02x}:00.0")
                     for i, u in enumerate(uuids)]
        self.config = None

    def node_report(self) -> dict[str, object]:
        return {"node": {"driver_version": "580.159.04"}}

    def current_findings(self) -> list[object]:
        return []

    def add_findings_listener(self, _callback: object) -> None:
        pass


def test_the_agents_link_reports_screens_and_hears_its_turns(tmp_path: Path) -> None:
    _with_server(tmp_path, lambda srv: _agent_link(srv, tmp_path), screen_turn_s=600)


async def _agent_link(srv: CoordinatorServer, tmp_path: Path) -> None:
    from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
    from gpuhealth.diag.screen import ScreenResult

    assert srv.endpoints is not None and srv.endpoints.metrics_port is not None
    uuids = ["GPU-5e0c7d2a-0000", "GPU-5e0c7d2a-0001"]
    link = CoordinatorLink(LinkSettings(address=_addr(srv), spool_path=str(tmp_path / "spool.db"),
                                        batch_interval_s=0.05, backoff_initial_s=0.2, backoff_max_s=1.0))
    turns: list[tuple[float, float]] = []
    link.add_turn_listener(lambda nb, valid: turns.append((nb, valid)))
    link.start(_NodeView("real-link", uuids))  # type: ignore[arg-type]
    try:
        async def until(cond: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 20
            while not cond():
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        await until(lambda: bool(turns), "the first turn")
        assert turns[-1] == (0.0, pytest.approx(600, abs=2))  # the only node: its turn is now
        [other] = await _agents(_addr(srv), ["other"], gpus=1)
        assert (await other.wait_turn(lambda t: True)).not_before > time.time()  # it waits for the link's turn
        now = time.time()
        link.on_screens([ScreenResult(u, i, now - 40, now - 1, "periodic", "pass", "", "schedule",
                                      ((KEY + "/case0", "c0ffee"),)) for i, u in enumerate(uuids)])
        await until(lambda: len(turns) >= 2, "the next turn after the screens")
        assert turns[-1][0] > time.time()  # every GPU reported: the turn ended, the next one is later
        await other.wait_turn(lambda t: t.not_before == 0)  # and the other node's turn is now
        samples = await _scrape_until(srv.endpoints.metrics_port,
                                      lambda s: s.get(("gpuhealth_fleet_gpus_unscreened", ())) == 1)
        assert samples[("gpuhealth_fleet_gpus", ())] == 3
        assert samples[("gpuhealth_fleet_screen_coverage_ratio", ())] == pytest.approx(2 / 3)
        assert samples[("gpuhealth_fleet_screens_total", (("level", "periodic"), ("result", "pass")))] == 2
        stored = srv.coord.store.screen_history("real-link", uuids[1])
        assert [(s.level, s.result, s.digests) for s in stored] == [("periodic", "pass", ((KEY + "/case0", "c0ffee"),))]
        await other.close()
    finally:
        await asyncio.to_thread(link.stop)
