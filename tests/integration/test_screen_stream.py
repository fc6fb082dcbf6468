"""Screen results go up the agent's real gRPC stream as a spooled ``screens`` record (resent until
acknowledged), and the coordinator's ``ScreenTurn`` comes down to screening — against a stand-in
coordinator speaking the v1 wire."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuhealth.agent.coordinator_stream import CONNECT_METHOD, REGISTER_METHOD, CoordinatorStream, StreamSettings
from gpuhealth.agent.spool import Spool
from gpuhealth.diag.screen import ScreenResult
from gpuhealth.proto import gpuhealth_v1_pb2 as pb

pytestmark = pytest.mark.integration


class StandInCoordinator:
    """Register + Connect: sends one ScreenTurn, acknowledges every record, keeps what it got."""

    def __init__(self, ack: bool = True) -> None:
        self.records: list[pb.Record] = []
        self.ack = ack
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service, register, connect = CONNECT_METHOD.split("/")[1], REGISTER_METHOD.split("/")[2], "Connect"
        handlers = {
            register: grpc.unary_unary_rpc_method_handler(
                self.register, request_deserializer=pb.RegisterRequest.FromString,
                response_serializer=pb.RegisterResponse.SerializeToString),
            connect: grpc.stream_stream_rpc_method_handler(
                self.connect, request_deserializer=pb.AgentMessage.FromString,
                response_serializer=pb.CoordinatorMessage.SerializeToString),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def register(self, req: pb.RegisterRequest, ctx: Any) -> pb.RegisterResponse:
        return pb.RegisterResponse(session_id="s1", acked_seq=0, heartbeat_interval_s=1.0, max_inflight=16)

    def connect(self, requests: Iterator[pb.AgentMessage], ctx: Any) -> Iterator[pb.CoordinatorMessage]:
        yield pb.CoordinatorMessage(screen_turn=pb.ScreenTurn(not_before=1_800_000_000.0, valid_for_s=900.0))
        for msg in requests:
            if msg.WhichOneof("body") == "record":
                with self.lock:
                    self.records.append(msg.record)
                if self.ack:
                    yield pb.CoordinatorMessage(ack=pb.Ack(up_to_seq=msg.record.seq))

    def screens(self) -> list[pb.ScreenResult]:
        with self.lock:
            return [s for r in self.records if r.WhichOneof("payload") == "screens" for s in r.screens.screens]


def _stream(tmp_path: Path, port: int, turns: list[tuple[float, float]]) -> CoordinatorStream:
    settings = StreamSettings(address=f"127.0.0.1:{port}", backoff_initial_s=0.1, backoff_max_s=0.5)
    return CoordinatorStream(settings, Spool(tmp_path / "spool.db"),
                             register=lambda inc: pb.RegisterRequest(node_name="node-a", incarnation=inc),
                             heartbeat=lambda st: pb.HealthSummary(), on_request=lambda req, emit: None,
                             wait_ready_s=0.0, on_screen_turn=lambda nb, v: turns.append((nb, v)))


def _until(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


RESULTS = [
    ScreenResult("GPU-a", 0, 100.0, 112.5, "quick", "pass", "", "epilog", (("k1/bf16-8192", "d0"),)),
    ScreenResult("GPU-b", 1, 100.0, 101.0, "quick", "aborted", "pid 4242 started on GPU 1", "epilog"),
]


def test_screen_results_reach_the_coordinator_and_its_turn_reaches_screening(tmp_path: Path) -> None:
    coord = StandInCoordinator()
    turns: list[tuple[float, float]] = []
    stream = _stream(tmp_path, coord.port, turns)
    stream.start()
    try:
        stream.on_screens(RESULTS)
        _until(lambda: len(coord.screens()) == 2, "the screens record")
        _until(lambda: turns, "the screen turn")
    finally:
        stream.stop()
        coord.server.stop(0)
    a, b = coord.screens()
    assert (a.gpu_uuid, a.gpu_index, a.level, a.result, a.trigger, a.started_at, a.finished_at) == (
        "GPU-a", 0, "quick", "pass", "epilog", 100.0, 112.5)
    assert [(d.gpu_uuid, d.key, d.digest) for d in a.digests] == [("GPU-a", "k1/bf16-8192", "d0")]
    assert (b.result, b.reason, list(b.digests)) == ("aborted", "pid 4242 started on GPU 1", [])
    assert turns == [(1_800_000_000.0, 900.0)]


def test_screen_results_wait_in_the_spool_while_the_coordinator_is_away(tmp_path: Path) -> None:
    turns: list[tuple[float, float]] = []
    first = StandInCoordinator(ack=False)  # receives, never acknowledges, then goes away
    stream = _stream(tmp_path, first.port, turns)
    stream.start()
    try:
        stream.on_screens(RESULTS[:1])
        _until(lambda: len(first.screens()) == 1, "the first send")
    finally:
        stream.stop()
        first.server.stop(0)
    # the agent restarts: the unacknowledged record is still in its spool and goes to the next coordinator
    second = StandInCoordinator()
    again = _stream(tmp_path, second.port, turns)
    again.start()
    try:
        _until(lambda: len(second.screens()) == 1, "the resend from the spool")
    finally:
        again.stop()
        second.server.stop(0)
    assert second.screens()[0].gpu_uuid == "GPU-a"
