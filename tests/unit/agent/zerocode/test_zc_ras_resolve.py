"""The RAS client resolves the name it asks at once per ``RESOLVE_TTL_S``, not once per query (the watcher asks
every job every poll: getaddrinfo was the largest share of its CPU with four jobs)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from zc_fakes import Comm, FakeRas, Rank, json_reply

from gpuhealth.agent.zerocode import ras


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    real = socket.getaddrinfo

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", counting)
    monkeypatch.setattr(ras, "_resolved", {})
    return calls


def test_queries_within_the_ttl_resolve_once_and_still_reach_ras(counted: list[tuple[Any, ...]]) -> None:
    server = FakeRas([{"json": json_reply([Comm(0x1, [Rank(0, 11, 0, {"AllReduce": 5})])])}])
    try:
        for _ in range(3):
            status = ras.parse(ras.query("localhost", server.port))
            assert status.pids() == {11}
        assert len(counted) == 1 and len(server.commands) == 3
    finally:
        server.close()


def test_an_entry_past_its_ttl_is_resolved_again_and_a_failure_is_not_kept(counted: list[tuple[Any, ...]],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    ras.resolve("localhost", 28028, now=100.0)
    ras.resolve("localhost", 28028, now=100.0 + ras.RESOLVE_TTL_S - 1)
    assert len(counted) == 1
    ras.resolve("localhost", 28028, now=100.0 + ras.RESOLVE_TTL_S + 1)
    assert len(counted) == 2

    def failing(*_args: Any, **_kw: Any) -> Any:
        counted.append(("fail",))
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", failing)
    for _ in range(2):
        with pytest.raises(ras.RasUnavailable, match=r"cannot resolve no-such-host\.invalid"):
            ras.query("no-such-host.invalid", 28028)
    assert counted.count(("fail",)) == 2
