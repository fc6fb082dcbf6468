"""A real coordinator (gRPC on loopback) and an agent's link to it whose ranks are a zero-code watcher's: what
the zero-code integration tests put a watcher in front of."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
from gpuhealth.agent.zerocode.ranksource import CombinedRanks
from gpuhealth.agent.zerocode.watcher import ZeroCodeWatcher
from gpuhealth.config import CoordinatorConfig
from gpuhealth.coordinator.security import AuthPolicy
from gpuhealth.coordinator.server import CoordinatorServer
from gpuhealth.coordinator.service import Coordinator
from gpuhealth.coordinator.store import Store


@contextlib.asynccontextmanager
async def coordinator_and_link(tmp_path: Path, watcher: ZeroCodeWatcher, *, pyspy: bool = True,
                               evidence_timeout_s: float = 40.0) -> AsyncIterator[tuple[Coordinator, CoordinatorLink]]:
    coord = Coordinator(Store(tmp_path / "c.db"), CoordinatorConfig(evidence_dir=str(tmp_path / "ev"),
                                                                    evidence_timeout_s=evidence_timeout_s))
    server = CoordinatorServer(coord, listen="127.0.0.1:0", metrics_listen=None, policy=AuthPolicy())
    endpoints = await server.start()
    settings = LinkSettings(address=f"127.0.0.1:{endpoints.grpc_port}", spool_path=str(tmp_path / "spool.db"),
                            work_dir=str(tmp_path / "w"), pyspy=pyspy)
    link = CoordinatorLink(settings, rank_hub=CombinedRanks(None, watcher))
    link.start(None)
    try:
        yield coord, link
    finally:
        link.stop()
        await server.stop(0)


async def until(what: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """``what()`` once it is truthy; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
