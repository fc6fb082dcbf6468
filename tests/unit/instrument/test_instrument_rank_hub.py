"""RankHub over real unix sockets, with scripted ranks speaking the protocol byte by byte."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.agent.ranks import RankHub, RankHubError, RankNotConnectedError, RankRequestError
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity, StepRecord


def ident(rank: int, job: str = "j1") -> RankIdentity:
    # pid: the hub takes it from the kernel (SO_PEERCRED); these scripted ranks live in this process
    return RankIdentity(job, rank, 16, "node-a", os.getpid())


def rec(rank: int, step: int, job: str = "j1") -> StepRecord:
    return StepRecord(job, rank, step, 1.7e9 + step, 0.1, 0.08, 0.02)


class ScriptedRank:
    """A fake rank process: sends what it is told, answers requests with ``answer(msg)``."""

    def __init__(self, path: Path, answer: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.answer = answer
        self.received: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def send(self, data: bytes | dict[str, Any]) -> None:
        self.sock.sendall(data if isinstance(data, bytes) else protocol.encode(data))

    def _read(self) -> None:
        buf = protocol.LineBuffer()
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            for msg in buf.feed(data):
                self.received.append(msg)
                if self.answer is not None:
                    reply = self.answer(msg)
                    try:
                        for one in reply if isinstance(reply, list) else [] if reply is None else [reply]:
                            self.send(one)
                    except OSError:  # closed by the test (or the hub) meanwhile
                        return

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes our reader thread and sends the FIN
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.fixture
def sock_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gh-hub-") as d:
        yield Path(d) / "sub" / "agent.sock"


@pytest.fixture
def hub(sock_path: Path) -> Iterator[RankHub]:
    h = RankHub(sock_path)
    h.start(object())
    yield h
    h.stop()


def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_start_creates_the_socket_with_its_mode_and_stop_removes_it(sock_path: Path) -> None:
    hub = RankHub(sock_path, mode=0o660)
    assert hub.name == "ranks"
    hub.start(None)
    try:
        st = sock_path.stat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    finally:
        hub.stop()
    assert not sock_path.exists()
    hub.stop()  # idempotent


def test_stale_socket_is_replaced(sock_path: Path) -> None:
    sock_path.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock_path))
    dead.close()  # the file stays, nobody listens: what a crashed agent leaves
    hub = RankHub(sock_path)
    hub.start()
    try:
        r = ScriptedRank(sock_path)
        r.send(protocol.hello(ident(0)))
        until(lambda: len(hub.ranks()) == 1)
        r.close()
    finally:
        hub.stop()


def test_refuses_a_live_socket_a_regular_file_and_a_too_long_path(hub: RankHub, sock_path: Path) -> None:
    with pytest.raises(RankHubError, match="already listening"):
        RankHub(sock_path).start()
    assert hub.ranks() == []  # the live hub is untouched
    other = sock_path.parent / "file.sock"
    other.write_text("precious")
    with pytest.raises(RankHubError, match="not a socket"):
        RankHub(other).start()
    assert other.read_text() == "precious"
    with pytest.raises(RankHubError, match="longer than"):
        RankHub(sock_path.parent / ("x" * 120)).start()


def test_identities_steps_and_listeners(hub: RankHub, sock_path: Path) -> None:
    got_ids: list[RankIdentity] = []
    got_steps: list[tuple[RankIdentity | None, list[StepRecord]]] = []
    gone: list[RankIdentity] = []
    hub.add_listener(on_identity=got_ids.append, on_steps=lambda i, rs: got_steps.append((i, rs)),
                     on_disconnect=gone.append)
    ranks = [ScriptedRank(sock_path) for _ in range(3)]
    for n, r in enumerate(ranks):
        r.send(protocol.hello(ident(n, job="j1" if n < 2 else "j2")))
    until(lambda: len(hub.ranks()) == 3)
    assert [(i.job_id, i.rank) for i in hub.ranks()] == [("j1", 0), ("j1", 1), ("j2", 2)]
    assert [i.rank for i in hub.ranks("j1")] == [0, 1]
    ranks[1].send(protocol.steps([rec(1, 0), rec(1, 1)]))
    until(lambda: len(got_steps) == 1)
    assert got_steps[0] == (ident(1), [rec(1, 0), rec(1, 1)])
    ranks[1].close()
    until(lambda: len(gone) == 1)
    assert gone == [ident(1)] and [i.rank for i in hub.ranks("j1")] == [0]
    assert sorted(i.rank for i in got_ids) == [0, 1, 2]
    for r in ranks:
        r.close()


def test_garbage_is_counted_and_never_stops_the_hub(hub: RankHub, sock_path: Path) -> None:
    got: list[StepRecord] = []
    hub.add_listener(on_steps=lambda i, rs: got.extend(rs))
    bad = ScriptedRank(sock_path)
    bad.send(b"this is not json\n[1,2,3]\n{\"type\": 7}\n")
    bad.send({"type": "hello", "identity": {"rank": "x"}})  # malformed identity
    # one well-formed record, one not; the good one is not counted either: no hello, nobody to speak for
    bad.send({"type": "steps", "records": [rec(0, 0).to_dict(), {"rank": 1}]})
    bad.send({"type": "some_future_message", "x": 1})
    bad.send({"type": "reply", "id": "nobody-asked", "ok": True})
    bad.send(b"\xff\xfe\x00garbage\n")
    until(lambda: hub.stats()["malformed"] == 5 and hub.stats()["late_replies"] == 1)
    st = hub.stats()
    assert st["malformed"] == 5 and st["bad_records"] == 1 and st["unknown_messages"] == 1
    assert st["foreign_records"] == 1 and st["records"] == 0 and got == []
    good = ScriptedRank(sock_path)
    good.send(protocol.hello(ident(2)))
    until(lambda: [i.rank for i in hub.ranks()] == [2])
    good.send(protocol.steps([rec(2, 0), rec(3, 0), rec(2, 1, job="j2")]))  # only its own record counts
    until(lambda: len(got) == 1)
    assert got == [rec(2, 0)] and hub.stats()["foreign_records"] == 3
    bad.close()
    good.close()


def test_a_raising_listener_is_counted_and_others_still_run(hub: RankHub, sock_path: Path) -> None:
    seen: list[int] = []

    def boom(i: RankIdentity) -> None:
        raise RuntimeError("listener bug")

    hub.add_listener(on_identity=boom)
    hub.add_listener(on_identity=lambda i: seen.append(i.rank))
    r = ScriptedRank(sock_path)
    r.send(protocol.hello(ident(5)))
    until(lambda: seen == [5])
    assert hub.stats()["listener_errors"] == 1
    r.close()


def _answers(rank: int, out: Path) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    def answer(msg: dict[str, Any]) -> dict[str, Any] | None:
        if msg["type"] == "dump_fr":
            path = Path(msg["dir"]) / f"rank{rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}")
            return protocol.reply_ok(msg["id"], path=str(path))
        if msg["type"] == "stacks":
            return protocol.reply_ok(msg["id"], stacks={"pid": rank, "threads": [], "text": f"rank {rank}"})
        return None

    return answer


def test_request_dump_and_stacks_for_a_job(hub: RankHub, sock_path: Path, tmp_path: Path) -> None:
    ranks = []
    for n in range(3):
        r = ScriptedRank(sock_path, _answers(n, tmp_path))
        r.send(protocol.hello(ident(n)))
        ranks.append(r)
    other_job = ScriptedRank(sock_path, _answers(9, tmp_path))
    other_job.send(protocol.hello(ident(9, job="j2")))
    until(lambda: len(hub.ranks()) == 4)
    paths = hub.request_dump("j1", None, str(tmp_path / "fr"), timeout_s=5)
    assert paths == {n: str(tmp_path / "fr" / f"rank{n}.json") for n in range(3)}
    assert all(Path(p).exists() for p in paths.values() if isinstance(p, str))
    assert other_job.received == []  # another job's rank is never asked
    stacks = hub.request_stacks("j1", 1, timeout_s=5)
    assert stacks == {1: {"pid": 1, "threads": [], "text": "rank 1"}}
    assert hub.request_dump("no-such-job", None, str(tmp_path), timeout_s=1) == {}
    for r in [*ranks, other_job]:
        r.close()


def test_request_errors_timeouts_and_disconnects(hub: RankHub, sock_path: Path, tmp_path: Path) -> None:
    def refuse(msg: dict[str, Any]) -> dict[str, Any] | None:
        return protocol.reply_error(msg["id"], "DumpError: disk full")

    erring = ScriptedRank(sock_path, refuse)
    erring.send(protocol.hello(ident(0)))
    silent = ScriptedRank(sock_path)  # never answers
    silent.send(protocol.hello(ident(1)))
    leaving = ScriptedRank(sock_path, lambda msg: (leaving.close(), None)[1])
    leaving.send(protocol.hello(ident(2)))
    until(lambda: len(hub.ranks()) == 3)
    t0 = time.monotonic()
    res = hub.request_dump("j1", None, str(tmp_path), timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert isinstance(res[0], RankRequestError) and "disk full" in str(res[0])
    assert isinstance(res[1], TimeoutError)
    assert isinstance(res[2], RankNotConnectedError)
    assert elapsed < 3.0  # one shared deadline, not one per rank
    missing = hub.request_stacks("j1", 7, timeout_s=1)
    assert isinstance(missing[7], RankNotConnectedError)
    erring.close()
    silent.close()


def test_a_restarted_rank_replaces_its_old_connection(hub: RankHub, sock_path: Path, tmp_path: Path) -> None:
    old = ScriptedRank(sock_path)  # stays connected but will never answer
    old.send(protocol.hello(ident(0)))
    until(lambda: len(hub.ranks()) == 1)
    new = ScriptedRank(sock_path, _answers(0, tmp_path))
    new.send(protocol.hello(RankIdentity("j1", 0, 4, "node-b", 5555)))
    # The old connection is dropped (its disconnect told) before the new one is in: ranks() may be empty
    # for that moment.
    until(lambda: [i.host for i in hub.ranks()] == ["node-b"])
    assert hub.ranks()[0].pid == os.getpid()  # the kernel's pid of the caller, not the hello's claim
    assert hub.request_stacks("j1", 0, timeout_s=2)[0] == {"pid": 0, "threads": [], "text": "rank 0"}
    old.close()
    time.sleep(0.1)
    assert [i.host for i in hub.ranks()] == ["node-b"]  # the old one leaving does not remove the new one
    new.close()


def test_stop_fails_pending_requests_quickly(sock_path: Path, tmp_path: Path) -> None:
    hub = RankHub(sock_path)
    hub.start()
    silent = ScriptedRank(sock_path)
    silent.send(protocol.hello(ident(0)))
    until(lambda: len(hub.ranks()) == 1)
    result: dict[int, Any] = {}
    t = threading.Thread(target=lambda: result.update(hub.request_stacks("j1", None, timeout_s=30)))
    t.start()
    time.sleep(0.2)
    hub.stop()
    t.join(5)
    assert not t.is_alive() and isinstance(result[0], RankNotConnectedError)
    silent.close()


def test_neither_the_hub_nor_the_hook_imports_torch_by_itself() -> None:
    """The agent process never imports torch; the hook leaves it to the training script."""
    code = ("import sys, tempfile; import gpuhealth.agent.ranks, gpuhealth.instrument.protocol; "
            "from gpuhealth.instrument import Tracker; "
            "t = Tracker(tempfile.mkdtemp() + '/s.jsonl', socket_path=''); "
            "ctx = t.step(); ctx.__enter__(); ctx.__exit__(None, None, None); t.close(); "
            "assert t.stats()['written'] == 1, t.stats(); "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True,
                         env={**os.environ})
    assert json.loads(out.stdout) == []


# -- inline dumps (the rank sends the bytes over the socket) ---------------------------------------


def _inline(data: bytes, *, chunk: int = 1000, tamper: Callable[[list[dict[str, Any]]], None] | None = None
            ) -> Callable[[dict[str, Any]], Any]:
    def answer(msg: dict[str, Any]) -> Any:
        if msg["type"] != "dump_fr":
            return None
        assert msg.get("inline") is True
        msgs = [*protocol.dump_chunks(msg["id"], data, chunk_bytes=chunk)]
        msgs.append(protocol.inline_dump_reply(msg["id"], data, len(msgs)))
        if tamper:
            tamper(msgs)
        return msgs

    return answer


def test_an_inline_dump_arrives_whole_in_chunks_and_needs_no_shared_folder(hub: RankHub, sock_path: Path) -> None:
    data = json.dumps({"version": "2.10", "entries": [{"record_id": i} for i in range(2000)]}).encode()
    rank = ScriptedRank(sock_path, _inline(data, chunk=4096))
    rank.send(protocol.hello(ident(0)))
    until(lambda: len(hub.ranks()) == 1)
    got = hub.request_dump("j1", None, timeout_s=5)
    assert got == {0: data} and len(data) > 9 * 4096  # ten chunks
    (request,) = [m for m in rank.received if m["type"] == "dump_fr"]
    assert "dir" not in request  # nothing is written anywhere
    rank.close()


@pytest.mark.parametrize(("tamper", "why"), [
    (lambda msgs: msgs.pop(-2), "incomplete"),  # the last chunk lost
    (lambda msgs: msgs.insert(0, msgs.pop(1)), "out of order"),
    (lambda msgs: msgs[-1].update(sha256="0" * 64), "digest"),
])
def test_a_damaged_inline_dump_is_an_error_not_a_wrong_dump(hub: RankHub, sock_path: Path,
                                                            tamper: Callable[[list[dict[str, Any]]], None],
                                                            why: str) -> None:
    rank = ScriptedRank(sock_path, _inline(b'{"entries": []}' * 300, chunk=1000, tamper=tamper))
    rank.send(protocol.hello(ident(0)))
    until(lambda: len(hub.ranks()) == 1)
    res = hub.request_dump("j1", None, timeout_s=3)[0]
    assert isinstance(res, RankRequestError) and why in str(res)
    rank.close()


def test_an_inline_dump_over_the_limit_is_refused_without_buffering_it(sock_path: Path) -> None:
    hub = RankHub(sock_path, max_dump_bytes=10_000)
    hub.start(None)
    try:
        rank = ScriptedRank(sock_path, _inline(b"x" * 50_000, chunk=4000))
        rank.send(protocol.hello(ident(0)))
        until(lambda: len(hub.ranks()) == 1)
        res = hub.request_dump("j1", None, timeout_s=3)[0]
        assert isinstance(res, RankRequestError) and "10000-byte limit" in str(res)
        until(lambda: hub.stats()["late_replies"] >= 1)  # the rest of its chunks went nowhere
        rank.close()
    finally:
        hub.stop()


def test_another_connection_cannot_slip_chunks_into_a_ranks_dump(hub: RankHub, sock_path: Path) -> None:
    real = json.dumps({"entries": [1, 2, 3]}).encode()
    asked: queue.Queue[str] = queue.Queue()

    def after_the_intruder(msg: dict[str, Any]) -> Any:
        # The request is pending (it reached the rank): the intruder answers it first, and the real rank
        # only once the hub has turned a forged chunk away — in that order whatever the machine's load.
        if msg["type"] == "dump_fr":
            asked.put(protocol.request_id_of(msg))
            deadline = time.monotonic() + 30
            while hub.stats()["foreign_replies"] < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        return _inline(real)(msg)

    rank = ScriptedRank(sock_path, after_the_intruder)
    rank.send(protocol.hello(ident(0)))
    until(lambda: len(hub.ranks()) == 1)
    intruder = ScriptedRank(sock_path)

    def inject() -> None:
        rid = asked.get(timeout=30)  # the request's real id: a perfect guess
        for m in protocol.dump_chunks(rid, b'{"forged": true}'):
            intruder.send(m)

    threading.Thread(target=inject, daemon=True).start()
    assert hub.request_dump("j1", None, timeout_s=60) == {0: real}
    assert hub.stats()["foreign_replies"] >= 1
    rank.close()
    intruder.close()


def test_dumps_arriving_together_share_one_memory_budget(sock_path: Path) -> None:
    hub = RankHub(sock_path, max_dump_bytes=40_000, max_inflight_dump_bytes=50_000)
    hub.start(None)
    try:
        # Rank 0 sends its chunks but never the closing reply (it hangs half-way); rank 1, a moment
        # later, would take the agent past its budget for dumps in flight.
        stalled = ScriptedRank(sock_path, _inline(b"y" * 30_000, chunk=1000, tamper=lambda msgs: msgs.pop()))
        stalled.send(protocol.hello(ident(0)))
        inline = _inline(b"z" * 30_000, chunk=1000)

        def late(msg: dict[str, Any]) -> Any:
            time.sleep(0.3)
            return inline(msg)

        second = ScriptedRank(sock_path, late)
        second.send(protocol.hello(ident(1)))
        until(lambda: len(hub.ranks()) == 2)
        res = hub.request_dump("j1", None, timeout_s=2)
        assert isinstance(res[0], TimeoutError)
        assert isinstance(res[1], RankRequestError) and "budget" in str(res[1])
        assert hub.stats()["dump_bytes_in_flight"] == 0  # what the stalled rank sent is let go
        stalled.close()
        second.close()
    finally:
        hub.stop()


def test_a_dump_stays_charged_to_the_budget_until_the_caller_is_done_with_it(sock_path: Path) -> None:
    # A slow caller (a slow link to the coordinator): answered dumps must not pile up uncounted.
    hub = RankHub(sock_path, max_dump_bytes=40_000, max_inflight_dump_bytes=50_000)
    hub.start(None)
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], hub.stats()["dump_bytes_in_flight"])
            time.sleep(0.002)

    try:
        ranks = []
        for n in range(4):
            inline = _inline(bytes([65 + n]) * 30_000, chunk=5000)

            def staggered(msg: dict[str, Any], n: int = n, inline: Any = inline) -> Any:
                time.sleep(0.05 * n)
                return inline(msg)

            r = ScriptedRank(sock_path, staggered)
            r.send(protocol.hello(ident(n)))
            ranks.append(r)
        until(lambda: len(hub.ranks()) == 4)
        threading.Thread(target=watch, daemon=True).start()
        got: dict[int, Any] = {}
        for rank, res in hub.iter_dumps("j1", None, timeout_s=5):
            got[rank] = res
            time.sleep(0.3)  # shipping it takes a while
        stop.set()
        shipped = [r for r, v in got.items() if isinstance(v, bytes | bytearray)]
        refused = [r for r, v in got.items() if isinstance(v, RankRequestError) and "budget" in str(v)]
        assert sorted(shipped + refused) == [0, 1, 2, 3] and shipped and refused
        assert peak[0] <= 50_000  # never more than the budget held, answered dumps included
        assert hub.stats()["dump_bytes_in_flight"] == 0
        for r in ranks:
            r.close()
    finally:
        stop.set()
        hub.stop()


def _switches(native_id: int) -> int:
    """Voluntary + involuntary context switches of one thread of this process: how often it woke."""
    text = Path(f"/proc/self/task/{native_id}/status").read_text()
    return sum(int(line.split()[1]) for line in text.splitlines() if "ctxt_switches" in line)


def test_an_idle_hub_and_one_whose_ranks_are_between_records_do_not_wake(hub: RankHub, sock_path: Path) -> None:
    """The hub's loop sleeps until a socket is ready unless a sweep needs the clock (it woke every second: on
    every node, all day, for nothing); a connection with no hello is still closed on time."""
    got: list[list[StepRecord]] = []
    hub.add_listener(on_steps=lambda _i, rs: got.append(rs))
    tid = hub._thread.native_id  # type: ignore[union-attr]
    assert tid is not None
    time.sleep(0.3)
    before = _switches(tid)
    time.sleep(3.0)
    assert _switches(tid) - before <= 1  # the old loop: 3
    rank = ScriptedRank(sock_path)
    rank.send(protocol.hello(ident(0)))
    until(lambda: len(hub.ranks()) == 1)
    time.sleep(0.3)
    before = _switches(tid)
    time.sleep(3.0)
    assert _switches(tid) - before <= 1
    rank.send(protocol.steps([rec(0, 0)]))  # records still arrive at once
    until(lambda: got == [[rec(0, 0)]], timeout=2.0)
    rank.close()


def test_a_connection_without_a_hello_is_closed_after_the_timeout_though_the_hub_was_asleep(sock_path: Path) -> None:
    h = RankHub(sock_path, hello_timeout_s=1.0)
    h.start(object())
    try:
        time.sleep(1.5)  # asleep with no timeout: the new connection must bring the sweeps back
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        silent.connect(str(sock_path))
        silent.settimeout(10)
        t0 = time.monotonic()
        while silent.recv(4096):  # until the hub closes it (EOF); our own 10 s timeout would raise
            pass
        assert 0.9 <= time.monotonic() - t0 < 5.0
        silent.close()
    finally:
        h.stop()
