"""A process on the rank socket must not make the agent read and ship a file it names.

A fake rank (real unix socket, real protocol) answers the agent's flight-recorder request with the
path of some other JSON file it can name: the link must refuse it, and accept the real dump file.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuhealth.agent.coordinator_link import CoordinatorLink, LinkSettings
from gpuhealth.agent.ranks import RankHub
from gpuhealth.instrument import protocol
from gpuhealth.model import RankIdentity
from gpuhealth.proto import gpuhealth_v1_pb2 as pb


def _collect(out: list[pb.RequestResult]) -> Callable[[pb.RequestResult | bytes], None]:
    """An emit that keeps results as messages (a dump is emitted as its AgentMessage's wire bytes)."""
    return lambda r: out.append(pb.AgentMessage.FromString(r).result if isinstance(r, bytes) else r)


def _fake_rank(sock_path: Path, answer: Any, stop: threading.Event) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock_path))
        ident = RankIdentity("victimjob", 0, 1, "h", os.getpid())
        s.sendall(protocol.encode(protocol.hello(ident)))
        buf = protocol.LineBuffer()
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                return
            for msg in buf.feed(chunk):
                if msg.get("type") == protocol.DUMP_FR:
                    rid = protocol.request_id_of(msg)
                    got = answer(Path(msg["dir"]) if msg.get("dir") else None)
                    if isinstance(got, bytes):  # a current hook: the dump inline
                        chunks = protocol.dump_chunks(rid, got, chunk_bytes=4096)
                        for c in chunks:
                            s.sendall(protocol.encode(c))
                        s.sendall(protocol.encode(protocol.inline_dump_reply(rid, got, len(chunks))))
                    else:  # a hook older than inline dumps: a file in the folder it was given
                        s.sendall(protocol.encode(protocol.reply_ok(rid, path=str(got))))


def _dump_through_link(tmp_path: Path, answer: Any) -> list[pb.RequestResult]:
    hub = RankHub(tmp_path / "agent.sock")
    hub.start(None)
    stop = threading.Event()
    t = threading.Thread(target=_fake_rank, args=(tmp_path / "agent.sock", answer, stop), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not hub.ranks() and time.monotonic() < deadline:
        time.sleep(0.02)
    link = CoordinatorLink(LinkSettings(address="127.0.0.1:1", spool_path=str(tmp_path / "spool.db"),
                                        work_dir=str(tmp_path / "fr")), rank_hub=hub)
    out: list[pb.RequestResult] = []
    try:
        link.requests.dump(pb.AgentRequest(request_id=7, kind=pb.DUMP_FLIGHT_RECORDER, job_id="victimjob",
                                      rank=-1, timeout_s=5), _collect(out))
    finally:
        stop.set()
        hub.stop()
        link.spool.close()
    return out


def test_a_rank_naming_another_file_gets_nothing_shipped(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"aws_secret": "hunter2"}))
    (result,) = _dump_through_link(tmp_path, lambda _dir: secret)
    assert not result.ok and b"hunter2" not in result.payload
    assert "not the dump file" in result.error


def test_a_symlinked_dump_is_refused_and_a_real_one_travels(tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"aws_secret": "hunter2"}))

    def symlink(d: Path) -> Path:
        (d / "rank0.json").symlink_to(secret)
        return d / "rank0.json"

    (tmp_path / "a").mkdir()
    (linked,) = _dump_through_link(tmp_path / "a", symlink)
    assert not linked.ok and b"hunter2" not in linked.payload

    def real(d: Path) -> Path:
        (d / "rank0.json").write_text(json.dumps({"version": "2.10", "entries": []}))
        return d / "rank0.json"

    (tmp_path / "b").mkdir()
    (ok,) = _dump_through_link(tmp_path / "b", real)
    assert ok.ok and json.loads(ok.payload)["version"] == "2.10"


def test_a_connection_cannot_answer_another_ranks_request(tmp_path: Path) -> None:
    """Request ids are guessable: a second process on the socket must not answer rank 0's request."""
    hub = RankHub(tmp_path / "agent.sock")
    hub.start(None)
    stop = threading.Event()
    seen: dict[str, Any] = {}
    asked = threading.Event()

    def after_the_intruder(_dir: Path) -> Path:
        # The request is pending (it reached the rank): the intruder answers it first, and the real rank
        # only once the hub has turned a forged reply away — in that order whatever the machine's load.
        asked.set()
        deadline = time.monotonic() + 30
        while hub.stats()["foreign_replies"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return _dir / "rank0.json"

    t = threading.Thread(target=_fake_rank, args=(tmp_path / "agent.sock", after_the_intruder, stop), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not hub.ranks() and time.monotonic() < deadline:
        time.sleep(0.02)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as intruder:
        intruder.connect(str(tmp_path / "agent.sock"))

        def answer_for_it() -> None:
            asked.wait(30)
            for n in range(1, 50):  # guess the request id
                rid = f"{os.getpid()}-{n}"
                intruder.sendall(protocol.encode(protocol.reply_ok(rid, path="/etc/passwd")))
                intruder.sendall(protocol.encode(protocol.reply_ok(str(n), path="/etc/passwd")))

        threading.Thread(target=answer_for_it, daemon=True).start()
        seen.update(hub.request_dump("victimjob", None, str(tmp_path), timeout_s=60.0))
    stop.set()
    hub.stop()
    assert isinstance(seen[0], str) and seen[0].endswith("rank0.json")
    assert hub.stats()["foreign_replies"] >= 1


@pytest.mark.parametrize("data", [b"\x80\x04\x95pickle", b"garbage", b"[" * 200_000, b"{\xff\xfe}"])
def test_only_a_json_object_is_shipped_and_hostile_bytes_never_crash(data: bytes) -> None:
    from gpuhealth.agent.coordinator_requests import _looks_like_json_object

    with pytest.raises(ValueError):
        _looks_like_json_object(data)
    assert _looks_like_json_object(b' {"version": "2.10"}\n') == b' {"version": "2.10"}\n'


def _inline_rank(sock_path: Path, rank: int, data: bytes, both_sent: threading.Barrier, stop: threading.Event) -> None:
    """A rank of job "bigjob" that answers a dump request inline in small chunks. The first time, it
    holds its closing reply until the other rank has sent all its chunks too: both dumps are in flight."""
    first = True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(sock_path))
        s.sendall(protocol.encode(protocol.hello(RankIdentity("bigjob", rank, 2, "h", os.getpid()))))
        buf = protocol.LineBuffer()
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                got = s.recv(65536)
            except TimeoutError:
                continue
            if not got:
                return
            for msg in buf.feed(got):
                if msg.get("type") == protocol.DUMP_FR:
                    rid = protocol.request_id_of(msg)
                    chunks = protocol.dump_chunks(rid, data, chunk_bytes=4096)
                    for c in chunks:
                        s.sendall(protocol.encode(c))
                    if first:
                        first = False
                        both_sent.wait(5)
                        time.sleep(0.2)  # let the hub read both before either reply
                    s.sendall(protocol.encode(protocol.inline_dump_reply(rid, data, len(chunks))))


def test_ranks_refused_for_the_memory_budget_are_asked_again_and_every_dump_ships(tmp_path: Path) -> None:
    hub = RankHub(tmp_path / "agent.sock", max_dump_bytes=60_000, max_inflight_dump_bytes=70_000)
    hub.start(None)
    stop = threading.Event()
    dumps = {r: json.dumps({"version": "2.10", "rank": r, "pad": "x" * 50_000}).encode() for r in range(2)}
    both_sent = threading.Barrier(2)
    for r in range(2):
        threading.Thread(target=_inline_rank, args=(tmp_path / "agent.sock", r, dumps[r], both_sent, stop),
                         daemon=True).start()
    deadline = time.monotonic() + 5
    while len(hub.ranks()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    link = CoordinatorLink(LinkSettings(address="127.0.0.1:1", spool_path=str(tmp_path / "spool.db"),
                                        work_dir=str(tmp_path / "fr")), rank_hub=hub)
    out: list[pb.RequestResult] = []
    try:
        link.requests.dump(pb.AgentRequest(request_id=9, kind=pb.DUMP_FLIGHT_RECORDER, job_id="bigjob", rank=-1,
                                      timeout_s=10), _collect(out))
    finally:
        stop.set()
        hub.stop()
        link.spool.close()
    assert sorted((r.rank, r.ok) for r in out) == [(0, True), (1, True)], [r.error for r in out]
    assert {r.rank: r.payload for r in out} == dumps
    assert hub.stats()["dump_budget_refusals"] >= 1  # one was refused while both were in flight
    assert hub.stats()["dump_bytes_in_flight"] == 0


def _real_dump(d: Path) -> Path:
    (d / "rank0.json").write_text(json.dumps({"version": "2.10", "entries": []}))
    return d / "rank0.json"


def test_a_planted_link_never_turns_the_agents_folder_onto_a_host_folder(tmp_path: Path) -> None:
    """Issue 30 item 3: the dump folder is made where tenants can write (beside the rank socket). A link
    planted at the agent's folder (or, before, at the predictable per-request name) made root mkdir and
    chmod 1733 a host folder. Now the folder is opened without following links and must be the agent's:
    the request is refused, in words, and the host folder is untouched."""
    victim = tmp_path / "etc"
    victim.mkdir(mode=0o755)
    os.chmod(victim, 0o755)
    (tmp_path / "fr").symlink_to(victim)
    asked: list[Path | None] = []

    def inline(d: Path | None) -> bytes:
        asked.append(d)
        return json.dumps({"version": "2.10", "entries": []}).encode()

    (result,) = _dump_through_link(tmp_path, inline)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755 and list(victim.iterdir()) == []
    # the dump still travels inline: a planted link cannot hide a hang's evidence
    assert result.ok and asked == [None] and json.loads(result.payload)["version"] == "2.10"


def test_a_folder_someone_else_made_is_refused(tmp_path: Path) -> None:
    (tmp_path / "fr").mkdir()
    os.chown(tmp_path / "fr", 65534, 65534)  # a tenant made it first
    asked: list[Path | None] = []
    (result,) = _dump_through_link(tmp_path, lambda d: asked.append(d) or b'{"version": "2.10"}')
    assert result.ok and asked == [None] and list((tmp_path / "fr").iterdir()) == []


def test_the_drop_box_has_an_unguessable_name_and_is_gone_afterwards(tmp_path: Path) -> None:
    seen: list[Path] = []

    def answer(d: Path) -> Path:
        seen.append(d)
        assert stat.S_IMODE(d.stat().st_mode) == 0o1733 and d.parent == tmp_path / "fr"
        (d / "tenant-link").symlink_to(tmp_path)  # what a tenant leaves behind is removed, never followed
        return _real_dump(d)

    (ok,) = _dump_through_link(tmp_path, answer)
    assert ok.ok and json.loads(ok.payload)["version"] == "2.10"
    (folder,) = seen
    assert folder.name.startswith("victimjob-7-") and len(folder.name) == len("victimjob-7-") + 16
    assert not folder.exists() and (tmp_path / "secret.json").exists() is False and tmp_path.exists()
    assert stat.S_IMODE((tmp_path / "fr").stat().st_mode) == 0o711
