"""The coordinator's side of fleet screening, on a real SQLite store without the network: screens stored
(bounded) and kept across a restart, their SDC digests voted fleet-wide, turns handed out and released,
a bad record refused with nothing else lost. The gRPC and /metrics path:
tests/integration/test_coordinator_screening_grpc.py."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.service import Coordinator, Session, StreamRejected
from gpuhealth.coordinator.store import Store
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

NOW = 1_800_000_000.0


class Clock:
    def __init__(self, t: float = NOW) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _coordinator(db: Path, clock: Clock, **settings: object) -> Coordinator:
    return Coordinator(Store(db), CoordinatorConfig(**settings), clock=clock)  # type: ignore[arg-type]


def _connect(coord: Coordinator, node: str, gpus: int = 2) -> Session:
    req = pb.RegisterRequest(node_name=node, incarnation="i1", gpus=[
        pb.GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="NVIDIA H100 80GB HBM3") for i in range(gpus)])
    coord.register(req)
    session = coord.by_node[node]
    coord.stream_opened(session)
    return session


def _screen(node: str, gpu: int, finished: float, result: str = "pass", level: str = "quick",
            digest: str | None = None) -> pb.ScreenResult:
    uuid = f"GPU-{node}-{gpu}"
    return pb.ScreenResult(gpu_uuid=uuid, gpu_index=gpu, started_at=finished - 20, finished_at=finished, level=level,
                           result=result, trigger="schedule",
                           digests=[pb.SdcDigest(key="H100/132sm/cublas/gemm-4k", digest=digest)] if digest else [])


def _send(coord: Coordinator, session: Session, *screens: pb.ScreenResult) -> None:
    rec = pb.Record(seq=session.received + 1, screens=pb.ScreenResults(screens=list(screens)))
    coord.handle_record(session, pb.AgentMessage(record=rec).SerializeToString(), rec)


def test_screens_are_stored_bounded_and_coverage_survives_a_restart(tmp_path: Path) -> None:
    clock = Clock(NOW - 1000)
    coord = _coordinator(tmp_path / "c.db", clock, screen_history=3)
    s1, _ = _connect(coord, "n1"), _connect(coord, "n2")
    clock.t = NOW
    for k in range(5):  # five screens of n1's GPU 0: the history keeps the last three
        _send(coord, s1, _screen("n1", 0, NOW - 500 + k * 10, level="periodic"))
    _send(coord, s1, _screen("n1", 0, NOW - 100, level="full", result="fail"),
          _screen("n1", 1, NOW - 90, result="aborted"))
    history = coord.store.screen_history("n1", "GPU-n1-0")
    assert [s.finished_at for s in history] == [NOW - 100, NOW - 460, NOW - 470]
    # the newest of each level and result, whatever the history has dropped
    assert {(s.gpu_uuid, s.level, s.result) for s in coord.store.screens_last()} == {
        ("GPU-n1-0", "periodic", "pass"), ("GPU-n1-0", "full", "fail"), ("GPU-n1-1", "quick", "aborted")}
    snap = coord.metrics_snapshot()
    assert (snap["gpus_known"], snap["gpus_unscreened"], snap["screen_coverage_ratio"]) == (4, 3, 0.25)
    assert snap["screens"][("periodic", "pass")] == 5 and snap["screens"][("full", "fail")] == 1
    assert snap["screens"][("quick", "aborted")] == 1 and snap["screens"][("standard", "error")] == 0
    doc = coord.screening_doc()
    assert [f["uuid"] for f in doc["failed"]] == ["GPU-n1-0"]
    assert doc["oldest"]["uuid"] == "GPU-n1-1" and doc["oldest"]["screened_at"] is None
    assert doc["oldest"]["last_attempt"]["result"] == "aborted"
    turns_before = {t.node: t for t in coord.rotation.active.values()}
    coord.store.close()

    clock.t = NOW + 3600  # a real restart: a new coordinator on the same database
    again = _coordinator(tmp_path / "c.db", clock, screen_history=3)
    snap = again.metrics_snapshot()
    assert (snap["gpus_known"], snap["gpus_unscreened"], snap["screen_coverage_ratio"]) == (4, 3, 0.25)
    # never-screened GPUs count from when the coordinator first saw them (before the restart)
    assert snap["screen_oldest_age_s"] == 4600
    assert again.screening_doc()["failed"][0]["uuid"] == "GPU-n1-0"
    assert {t.node: t for t in again.rotation.active.values()} == turns_before
    again.store.close()


def test_digests_in_screens_join_the_fleet_vote_per_golden_key(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path / "c.db", Clock())
    sessions = {n: _connect(coord, n, gpus=1) for n in ("n1", "n2", "n3", "n4")}
    for n, s in sessions.items():
        _send(coord, s, _screen(n, 0, NOW - 60, digest="bad" if n == "n3" else "good"))
    doc = coord.fleet_doc()
    assert [(f["code"], f["entity"]["id"]) for f in doc["sdc"]] == [("sdc.mismatch", "GPU-n3-0")]
    assert doc["sdc"][0]["evidence"]["agree"] == 3 and doc["sdc"][0]["evidence"]["node"] == "n3"
    # A digest from a screen about a GPU the node did not register does not vote.
    rogue = _connect(coord, "rogue", gpus=1)
    for k in range(4):
        _send(coord, rogue, pb.ScreenResult(gpu_uuid=f"GPU-n{k + 1}-0", gpu_index=0, started_at=NOW - 9,
                                            finished_at=NOW - 1, level="quick", result="pass",
                                            digests=[pb.SdcDigest(key="H100/132sm/cublas/gemm-4k", digest="bad")]))
    assert [f["entity"]["id"] for f in coord.fleet_doc()["sdc"]] == ["GPU-n3-0"]
    coord.store.close()


def test_a_garbage_record_is_refused_and_nothing_else_is_lost(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path / "c.db", Clock())
    s = _connect(coord, "n1")
    _send(coord, s, _screen("n1", 0, NOW - 60))
    bad = _screen("n1", 1, NOW - 30, result="mostly-fine")
    with pytest.raises(StreamRejected) as err:
        _send(coord, s, _screen("n1", 0, NOW - 20), bad)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details == ("record seq 2: screens[1].result: 'mostly-fine' is not one of pass, fail, aborted, "
                                 "error")
    assert coord.store.acked_seq("n1", "i1") == 2  # consumed: the agent does not resend it forever
    # The earlier screen stays; nothing of the refused record was written (the good screen in it neither).
    assert [x.finished_at for x in coord.store.screen_history("n1", "GPU-n1-0")] == [NOW - 60]
    assert coord.counters.rejected == 1 and coord.metrics_snapshot()["screens"][("quick", "pass")] == 1
    _send(coord, s, _screen("n1", 1, NOW - 10))  # the next record is taken
    assert coord.metrics_snapshot()["gpus_unscreened"] == 0
    coord.store.close()


def test_turns_go_to_the_unscreened_nodes_and_a_screened_node_releases_its_turn(tmp_path: Path) -> None:
    clock = Clock()
    coord = _coordinator(tmp_path / "c.db", clock, screen_concurrency=0.25, screen_turn_s=600)
    sessions = {n: _connect(coord, n) for n in ("a", "b", "c", "d", "e", "f", "g", "h")}
    for n in ("a", "b", "c", "d", "e", "f"):  # screened a while ago, oldest first in name order
        _send(coord, sessions[n], *[_screen(n, g, NOW - 10_000 + ord(n)) for g in range(2)])
    clock.t += 1
    coord.rotate()
    assert sorted(coord.rotation.active) == ["g", "h"]  # never screened: first (2 = 25 % of 8)
    assert sessions["g"].turn == pb.ScreenTurn(not_before=0.0, valid_for_s=600)
    assert sessions["a"].turn is not None and sessions["a"].turn.not_before == clock.t + 599  # next in line
    # g screens one GPU: it keeps the turn; the second GPU too: released, the next node goes.
    clock.t += 30
    _send(coord, sessions["g"], _screen("g", 0, clock.t))
    assert "g" in coord.rotation.active
    _send(coord, sessions["g"], _screen("g", 1, clock.t))
    assert "g" not in coord.rotation.active
    coord.rotate()
    assert sorted(coord.rotation.active) == ["a", "h"]
    assert sessions["a"].turn == pb.ScreenTurn(not_before=0.0, valid_for_s=600)
    assert sessions["g"].turn is not None and sessions["g"].turn.not_before > clock.t  # waits for its next turn
    doc = coord.screening_doc()["rotation"]
    assert [t["node"] for t in doc["turns"]] == ["h", "a"] and doc["slots"] == 2
    assert doc["next"][0]["node"] == "b"
    coord.store.close()


def test_rotation_off_sends_no_turns(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path / "c.db", Clock(), screen_rotation=False)
    s = _connect(coord, "n1")
    assert coord.rotate() == {} and s.turn is None and coord.rotation.active == {}
    coord.store.close()


def test_retention_drops_old_history_but_keeps_the_last_screens_of_registered_gpus(tmp_path: Path) -> None:
    clock = Clock(NOW - 40 * 86_400)
    coord = _coordinator(tmp_path / "c.db", clock, retention_days=30, evidence_dir=str(tmp_path / "ev"))
    s1, s2 = _connect(coord, "n1", gpus=1), _connect(coord, "n2", gpus=1)
    _send(coord, s1, _screen("n1", 0, clock.t - 10))
    _send(coord, s2, _screen("n2", 0, clock.t - 10))
    clock.t = NOW
    _send(coord, s1, _screen("n1", 0, NOW - 10, level="full"))
    # n2 comes back with another GPU: its old one is gone from every registration.
    coord.register(pb.RegisterRequest(node_name="n2", incarnation="i2", gpus=[pb.GpuInfo(index=0, uuid="GPU-new")]))
    coord.prune(NOW)
    assert [s.level for s in coord.store.screen_history("n1", "GPU-n1-0")] == ["full"]  # the 40-day-old one went
    assert {(s.gpu_uuid, s.level) for s in coord.store.screens_last()} == {("GPU-n1-0", "quick"),
                                                                          ("GPU-n1-0", "full")}
    assert set(coord.store.gpus_first_seen()) == {("n1", "GPU-n1-0"), ("n2", "GPU-new")}
    coord.store.close()


def test_retention_forgets_the_rotation_state_of_nodes_gone_that_long(tmp_path: Path) -> None:
    clock = Clock(NOW - 40 * 86_400)
    coord = _coordinator(tmp_path / "c.db", clock, retention_days=30, evidence_dir=str(tmp_path / "ev"))
    _connect(coord, "gone", gpus=1)
    coord.rotate()
    assert "gone" in coord.rotation.last_turn
    clock.t = NOW
    _connect(coord, "here", gpus=1)
    coord.rotate()
    coord.prune(NOW)
    rot = coord.rotation
    assert all("gone" not in d for d in (rot.active, rot.last_turn, rot.estimates))  # node names churn
    assert "here" in rot.last_turn
    coord.store.close()


def test_sdc_digest_records_keep_only_the_nodes_own_gpus(tmp_path: Path) -> None:
    coord = _coordinator(tmp_path / "c.db", Clock())
    s = _connect(coord, "n1", gpus=2)
    key = "H100/132sm/cublas/gemm-4k"
    digests = [pb.SdcDigest(gpu_uuid="GPU-n1-0", key=key, digest="aa", at=NOW),
               pb.SdcDigest(gpu_uuid="cpu:0", key="cpu/gloo", digest="cc", at=NOW)]  # a CPU run: no real GPU
    digests += [pb.SdcDigest(gpu_uuid=f"GPU-elsewhere-{i}", key=key, digest="bb", at=NOW) for i in range(500)]
    rec = pb.Record(seq=s.received + 1, sdc=pb.SdcDigests(digests=digests))
    coord.handle_record(s, pb.AgentMessage(record=rec).SerializeToString(), rec)
    stored = {(gpu, digest) for _, gpu, _, digest, _ in coord.store.sdc_digests()}
    assert stored == {("GPU-n1-0", "aa"), ("cpu:0", "cc")}  # another node's 500 GPUs never reach the database
    assert coord.counters.foreign_digests == 500 and coord.metrics_snapshot()["foreign_digests"] == 500
    # A record of more digests than any node has GPUs x keys is refused in one line, and nothing of it kept.
    huge = pb.Record(seq=s.received + 1, sdc=pb.SdcDigests(digests=[digests[0]] * 5000))
    with pytest.raises(StreamRejected, match="5000 digests in one record, more than 4096"):
        coord.handle_record(s, pb.AgentMessage(record=huge).SerializeToString(), huge)
    assert len(coord.store.sdc_digests()) == 2
    coord.store.close()
