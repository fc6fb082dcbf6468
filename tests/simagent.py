"""A minimal simulated agent speaking the raw gRPC API: for the protocol tests and the load benchmark
(a real agent uses ``gpuhealth.agent.coordinator_link``). Async, one stream per instance.

A test helper, not part of the installed package: ``tests/`` is on ``sys.path`` under pytest (the
rootdir's conftest), and ``benchmarks/coordinator_load.py`` adds it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import grpc

from gpuhealth.proto import gpuhealth_v1_pb2 as pb
from gpuhealth.proto.options import NODE_METADATA, SESSION_METADATA, UNARY_DEADLINE_S, client_options

REGISTER = "/gpuhealth.v1.Coordinator/Register"
CONNECT = "/gpuhealth.v1.Coordinator/Connect"


def step_batch_message(seq: int, job_id: str, ranks: Sequence[int], step: int, *, wall_s: float = 0.5,
                       compute: Sequence[float] | None = None, start_time: float = 1.7e9) -> bytes:
    """One AgentMessage carrying one step of ``ranks`` (columnar)."""
    n = len(ranks)
    batch = pb.StepBatch(job_id=job_id, rank=list(ranks), step=[step] * n, start_time=[start_time] * n,
                         wall_s=[wall_s] * n, compute_s=list(compute) if compute is not None else [wall_s * 0.6] * n)
    return pb.AgentMessage(record=pb.Record(seq=seq, steps=batch)).SerializeToString()


def screen_result(uuid: str, *, index: int = -1, finished_at: float = 1.7e9, duration_s: float = 30.0,
                  level: str = "quick", result: str = "pass", reason: str = "", trigger: str = "schedule",
                  digests: Sequence[tuple[str, str]] = ()) -> pb.ScreenResult:
    """One GPU's screen as an agent reports it; ``digests``: (golden key, digest)."""
    return pb.ScreenResult(gpu_uuid=uuid, gpu_index=index, started_at=finished_at - duration_s, finished_at=finished_at,
                           level=level, result=result, reason=reason, trigger=trigger,
                           digests=[pb.SdcDigest(gpu_uuid=uuid, key=k, digest=d, at=finished_at) for k, d in digests])


def screens_message(seq: int, screens: Sequence[pb.ScreenResult]) -> bytes:
    """One AgentMessage carrying ``screens`` (Record.screens)."""
    return pb.AgentMessage(record=pb.Record(seq=seq, screens=pb.ScreenResults(screens=list(screens)))
                           ).SerializeToString()


class SimAgent:
    def __init__(self, address: str, node: str, *, incarnation: str = "sim", metadata: Sequence[tuple[str, str]] = (),
                 credentials: grpc.ChannelCredentials | None = None, gpus: int = 0,
                 versions: dict[str, str] | None = None, simulated: bool = False) -> None:
        self.address = address
        self.node = node
        self.incarnation = incarnation
        self.metadata = tuple(metadata)
        self.credentials = credentials
        self.gpus = gpus
        self.versions = versions or {}
        self.simulated = simulated  # registers as an agent that replays a recording
        self.acked = 0
        self.acked_event = asyncio.Event()
        self.requests: list[pb.AgentRequest] = []
        self.turns: list[tuple[float, pb.ScreenTurn]] = []  # (loop time received, turn), oldest first
        self.turn_event = asyncio.Event()
        self.channel: grpc.aio.Channel | None = None
        self.call: Any = None
        self.session: pb.RegisterResponse | None = None
        self._reader: asyncio.Task[None] | None = None

    async def register(self, node: str | None = None) -> pb.RegisterResponse:
        opts = client_options()
        self.channel = (grpc.aio.secure_channel(self.address, self.credentials, options=opts) if self.credentials
                        else grpc.aio.insecure_channel(self.address, options=opts))
        reg = self.channel.unary_unary(REGISTER, request_serializer=pb.RegisterRequest.SerializeToString,
                                       response_deserializer=pb.RegisterResponse.FromString)
        req = pb.RegisterRequest(node_name=node or self.node, incarnation=self.incarnation, versions=self.versions,
                                 simulated=self.simulated, backend="simulated from test" if self.simulated else "")
        for i in range(self.gpus):
            req.gpus.append(pb.GpuInfo(index=i, uuid=f"GPU-{self.node}-{i}", pci_bus_id=f"00000000:{i:02x}:00.0",
                                       name="NVIDIA H100 80GB HBM3", vbios="96.00.99.00.01"))
        self.session = await reg(req, timeout=UNARY_DEADLINE_S, metadata=self.metadata)
        self.acked = self.session.acked_seq
        return self.session

    async def connect(self, node: str | None = None) -> None:
        assert self.channel is not None and self.session is not None
        stream = self.channel.stream_stream(CONNECT, request_serializer=None,
                                            response_deserializer=pb.CoordinatorMessage.FromString)
        self.call = stream(metadata=(*self.metadata, (SESSION_METADATA, self.session.session_id),
                                     (NODE_METADATA, node or self.node)))
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.call:
            if msg.WhichOneof("body") == "ack":
                self.acked = max(self.acked, msg.ack.up_to_seq)
                self.acked_event.set()
            elif msg.WhichOneof("body") == "screen_turn":
                self.turns.append((asyncio.get_running_loop().time(), msg.screen_turn))
                self.turn_event.set()
            else:
                self.requests.append(msg.request)

    async def send(self, raw: bytes) -> None:
        await self.call.write(raw)

    async def wait_acked(self, seq: int, timeout_s: float = 10.0) -> None:
        async def wait() -> None:
            while self.acked < seq:
                self.acked_event.clear()
                if self._reader is not None and self._reader.done():
                    self._reader.result()  # raises the stream's error
                    raise ConnectionError("stream ended before the ack")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.acked_event.wait(), 0.5)

        await asyncio.wait_for(wait(), timeout_s)

    def gpu_uuids(self) -> list[str]:
        return [f"GPU-{self.node}-{i}" for i in range(self.gpus)]

    @property
    def turn(self) -> pb.ScreenTurn | None:
        """The newest turn the coordinator sent (what an agent acts on)."""
        return self.turns[-1][1] if self.turns else None

    def holds_turn(self) -> bool:
        """The newest turn opens now (``not_before`` 0) — the node may start a scheduled screen."""
        return self.turn is not None and self.turn.not_before == 0.0 and self.turn.valid_for_s > 0

    async def wait_turn(self, predicate: Any, timeout_s: float = 10.0) -> pb.ScreenTurn:
        """Wait until the newest turn satisfies ``predicate(turn)``."""
        async def wait() -> pb.ScreenTurn:
            while self.turn is None or not predicate(self.turn):
                self.turn_event.clear()
                if self._reader is not None and self._reader.done():
                    self._reader.result()
                    raise ConnectionError("stream ended before the turn")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.turn_event.wait(), 0.5)
            return self.turn

        return await asyncio.wait_for(wait(), timeout_s)

    async def status(self) -> grpc.StatusCode:
        """Wait for the stream to end; its status code."""
        assert self.call is not None
        with contextlib.suppress(Exception):
            if self._reader is not None:
                await self._reader
        return await self.call.code()

    async def close(self) -> None:
        if self.call is not None:
            self.call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        if self.channel is not None:
            await self.channel.close()
