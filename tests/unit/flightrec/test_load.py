"""The loader: real dumps, format drift, identity, bad files and hostile pickles."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
from frbuild import FIXTURES, dump, entry, training, write_json, write_pickle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuhealth.flightrec.load import load_dumps, rank_from_filename
from gpuhealth.flightrec.safe_pickle import SharedReferenceError, UnsafePickleError, loads_plain

GLOO = FIXTURES / "gloo_4rank_hang_skip"
NCCL = FIXTURES / "nccl_2gpu"


def test_real_gloo_dumps_load_with_frames_from_the_pickle_pair() -> None:
    res = load_dumps(GLOO)
    assert res.ranks == [0, 1, 2, 3]
    assert not [p for p in res.problems if p.severity == "error"]
    d = res.dumps[3]
    assert d.format == "json" and d.backend == "gloo" and d.version == "2.10"
    assert res.identity_sources == {r: "filename" for r in range(4)}
    # JSON has no frames; the rank3.pkl next to it lends its call-site stacks.
    assert d.frames_from and d.frames_from.endswith("rank3.pkl")
    assert any(f.filename.endswith("job.py") for f in d.entries[-1].frames)
    # pg ids are local: rank 3's TP group is pg_id 1 locally but named "2".
    assert d.group_status()["2"].enqueued is not None
    assert all(e.started_ns is None for e in d.entries)  # Gloo: 0 in JSON becomes None


def test_real_nccl_dump_fields() -> None:
    res = load_dumps(NCCL / "straggler" / "dumps")
    d = res.dumps[1]
    assert d.backend == "nccl" and d.comm_lib_version == "2.28.9"
    assert any(e.duration_ms is not None for e in d.entries)
    assert d.pg_config["0"].ranks == (0, 1)


def test_json_and_pickle_of_one_dump_agree(tmp_path: Path) -> None:
    only_pkl = tmp_path / "p"
    only_pkl.mkdir()
    shutil.copy(GLOO / "rank2.pkl", only_pkl / "rank2.pkl")
    a = load_dumps(only_pkl).dumps[2]
    b = load_dumps(GLOO / "rank2.json").dumps[2]
    assert a.format == "pickle" and b.format == "json"
    assert [(e.group, e.seq, e.op, e.in_sizes, e.retired) for e in a.entries] == \
           [(e.group, e.seq, e.op, e.in_sizes, e.retired) for e in b.entries]
    assert {k: (v.enqueued, v.completed) for k, v in a.pg_status.items()} == \
           {k: (v.enqueued, v.completed) for k, v in b.pg_status.items()}


def test_identity_from_contents_wins_and_conflict_is_reported(tmp_path: Path) -> None:
    write_json(tmp_path, "rank5.json", dump(training(3), extra={"rank": 2, "host": "node-a"}))
    res = load_dumps(tmp_path)
    assert res.identity_sources == {2: "contents"}
    assert res.dumps[2].host == "node-a"
    assert any("file name says rank 5" in p.message for p in res.problems)


def test_file_name_patterns() -> None:
    assert rank_from_filename("rank3.json") == (3, None)
    assert rank_from_filename("node7-rank12.json") == (12, "node7")
    assert rank_from_filename("gpu-host-01_rank_3.pkl") == (3, "gpu-host-01")
    assert rank_from_filename("nccl_trace_rank_5") == (5, None)
    assert rank_from_filename("fr_dump3") == (3, None)
    assert rank_from_filename("notes.json") is None


def test_format_drift_is_tolerated(tmp_path: Path) -> None:
    old = dump(training(4, json_style=False), json_style=False, version="2.2")
    old.pop("comm_lib_version")
    old["nccl_version"] = "2.18.1"  # pre-2.4 name
    write_pickle(tmp_path, "rank0.pkl", old)
    new = dump(training(4), version="2.10")
    new.pop("nccl_comm_state")
    write_json(tmp_path, "rank1.json", new)
    empty = dump([], version="2.10")
    empty.pop("entries")  # JSON leaves "entries" out when there are none
    write_json(tmp_path, "rank2.json", empty)
    res = load_dumps(tmp_path)
    assert res.ranks == [0, 1, 2]
    assert res.dumps[0].comm_lib_version == "2.18.1"
    assert res.dumps[0].pg_status[0].completed == 4 and res.dumps[1].pg_status[0].completed == 4
    assert res.dumps[2].entries == []
    assert [e.seq for e in res.dumps[0].entries] == [e.seq for e in res.dumps[1].entries]


def test_unknown_major_version_warns_but_loads(tmp_path: Path) -> None:
    write_json(tmp_path, "rank0.json", dump(training(2), version="3.0"))
    res = load_dumps(tmp_path)
    assert res.ranks == [0]
    assert any("not 2.x" in p.message and p.severity == "warning" for p in res.problems)


def test_bad_files_become_problems_and_the_rest_loads(tmp_path: Path) -> None:
    write_json(tmp_path, "rank0.json", dump(training(3)))
    (tmp_path / "rank1.json").write_bytes(b"\x00\xffgarbage\x13" * 20)
    good = json.dumps(dump(training(3)))
    (tmp_path / "rank2.json").write_text(good[: len(good) // 2])  # cut short mid-write
    (tmp_path / "rank3.json").write_text("[1, 2, 3]")
    (tmp_path / "rank4.json").write_text("")
    (tmp_path / "rank5.pkl").write_bytes(pickle.dumps({"entries": []})[:-3])  # truncated pickle
    (tmp_path / "mystery.json").write_text(json.dumps(dump(training(1))))  # no rank anywhere
    bad_entries = dump(training(2))
    bad_entries["entries"].append("not an entry")
    bad_entries["entries"].append({"profiling_name": "nccl:all_reduce"})  # no seq / record id
    write_json(tmp_path, "rank6.json", bad_entries)
    res = load_dumps(tmp_path)
    assert res.ranks == [0, 6]
    msgs = {Path(p.path).name: p.message for p in res.problems}
    assert "not a flight-recorder dump" in msgs["rank1.json"]
    assert "broken JSON" in msgs["rank2.json"]
    assert "not a flight-recorder dump" in msgs["rank3.json"]
    assert msgs["rank4.json"] == "empty file"
    assert "corrupt pickle" in msgs["rank5.pkl"]
    assert "cannot tell which rank" in msgs["mystery.json"]
    assert "2 malformed entries skipped" in msgs["rank6.json"]
    assert len(res.dumps[6].entries) == 2
    # A file named as a rank's dump that cannot be read says whose dump it was.
    assert {Path(p.path).name: p.rank for p in res.problems if p.severity == "error"} == {
        "rank1.json": 1, "rank2.json": 2, "rank3.json": 3, "rank4.json": 4, "rank5.pkl": 5, "mystery.json": None}


def test_duplicate_rank_is_reported(tmp_path: Path) -> None:
    write_json(tmp_path / "a", "rank1.json", dump(training(2)))
    write_json(tmp_path / "b", "rank1.json", dump(training(3)))
    res = load_dumps(tmp_path)
    assert res.ranks == [1]
    assert any("already loaded" in p.message for p in res.problems)


def test_size_cap_refuses_whole_file_parse(tmp_path: Path) -> None:
    write_json(tmp_path, "rank0.json", dump(training(50)))
    res = load_dumps(tmp_path, max_file_bytes=1000)
    assert res.ranks == []
    assert "limit" in res.problems[0].message


def test_tail_reading_covers_the_frontier_and_matches_full_parse(tmp_path: Path) -> None:
    # 400 completed collectives and one pending: the tail reader must read a few, not 401.
    entries = training(400, state_last="scheduled")
    write_json(tmp_path, "rank0.json", dump(entries))
    full = load_dumps(tmp_path).dumps[0]
    tail = load_dumps(tmp_path, tail_entries=8).dumps[0]
    assert tail.tail_only and not full.tail_only
    assert 8 <= len(tail.entries) < 50
    assert [e.seq for e in tail.entries] == [e.seq for e in full.entries][-len(tail.entries):]
    assert tail.pg_status == full.pg_status
    # A frontier far back (a group whose last completion is old) makes the reader go further.
    entries = [entry(s, group="1", desc="tp", pg_id=1) for s in range(1, 6)]
    entries += [entry(s, record_id=100 + s) for s in range(1, 400)]
    write_json(tmp_path, "rank1.json", dump(entries))
    tail1 = load_dumps(tmp_path / "rank1.json", tail_entries=8).dumps[1]
    assert {e.group for e in tail1.entries} == {"0", "1"}


def test_hostile_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    payload = {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": [{"frames": Exploit()}]}
    write_pickle(tmp_path, "rank0.pkl", payload)
    # A second attack through builtins.eval, found by STACK_GLOBAL.
    (tmp_path / "rank1.pkl").write_bytes(
        b"\x80\x04\x95" + (40).to_bytes(8, "little")
        + b"\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94\x8c\x10open('x','w')\x94\x85\x94R\x94."
    )
    res = load_dumps(tmp_path)
    assert res.ranks == []
    assert not marker.exists()
    assert not (Path.cwd() / "x").exists()
    msgs = sorted(p.message for p in res.problems)
    assert all("refused" in m for m in msgs), msgs
    assert any("posix.system" in m or "os.system" in m for m in msgs)
    assert any("builtins.eval" in m for m in msgs)


def test_restricted_unpickler_builds_plain_containers() -> None:
    data = {"a": [1, 2.5, None, True], "b": ("x", b"y"), "c": {"d": {1, 2}}}
    assert loads_plain(pickle.dumps(data, protocol=4)) == data
    try:
        loads_plain(pickle.dumps(Path("/etc")))
    except UnsafePickleError as exc:
        assert "refused" in str(exc)
    else:
        raise AssertionError("a Path object must be refused")


def test_restricted_unpickler_reads_every_committed_pickle_like_pickle_loads() -> None:
    paths = [p for p in sorted(FIXTURES.rglob("*")) if p.is_file() and p.read_bytes()[:1] == b"\x80"]
    assert len(paths) >= 10
    for path in paths:
        data = path.read_bytes()
        assert loads_plain(data) == pickle.loads(data), path


def test_restricted_unpickler_bounds_what_a_small_pickle_can_build() -> None:
    # LONG_BINPUT 2^30: the C unpickler sizes its memo array by it (16 GB for these 12 bytes).
    assert loads_plain(b"\x80\x02N" + b"r" + (1 << 30).to_bytes(4, "little") + b".") is None
    nested: list[object] = []
    for _ in range(20):
        nested = [nested, nested]  # 2^20 leaves as a tree, a few hundred bytes as a pickle
    with pytest.raises(SharedReferenceError, match="reuses a list of over 256 items"):
        loads_plain(pickle.dumps(nested))
    small = [1, 2]  # reused a few times (frbuild shares a shape list between input and output)
    assert loads_plain(pickle.dumps([small, small])) == [[1, 2], [1, 2]]
    ranks = list(range(200))
    with pytest.raises(SharedReferenceError, match="more often than its size allows"):
        loads_plain(pickle.dumps([ranks] * 5000))
    with pytest.raises(SharedReferenceError, match="MARKs nested"):
        loads_plain(b"\x80\x02" + b"(" * 5000 + b".")


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=20,
)
_ENTRY_KEYS = ["collective_seq_id", "record_id", "pg_id", "process_group", "profiling_name", "input_sizes",
               "output_sizes", "input_dtypes", "state", "retired", "time_created_ns", "duration_ms", "frames"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    top=st.dictionaries(st.sampled_from(["version", "pg_config", "pg_status", "entries", "rank", "comm_lib_version"]),
                        _JSONISH, max_size=6),
    entries=st.lists(st.dictionaries(st.sampled_from(_ENTRY_KEYS), _JSONISH, max_size=10), max_size=5),
    noise=st.binary(max_size=64),
    cut=st.floats(min_value=0.0, max_value=1.0),
    as_pickle=st.booleans(),
    big=st.booleans(),
)
def test_fuzz_loader_never_crashes(tmp_path: Path, top: dict, entries: list, noise: bytes, cut: float,
                                   as_pickle: bool, big: bool) -> None:
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    doc = dict(top)
    doc.setdefault("entries", entries)
    if big:  # past 64 KiB the JSON tail reader is used: fuzz it too
        doc["nccl_comm_state"] = {"pad": "x" * 70_000}
        doc["entries"] = list(doc["entries"]) * 3 if isinstance(doc["entries"], list) else doc["entries"]
    data = pickle.dumps(doc) if as_pickle else json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    cut = int(len(data) * cut)
    (folder / "rank0.json").write_bytes(data)
    (folder / "rank1.json").write_bytes(data[:cut] + noise)
    (folder / "rank2.json").write_bytes(noise)
    res = load_dumps(folder, tail_entries=2)
    res2 = load_dumps(folder)
    for r in (res, res2):
        assert not [p for p in r.problems if "bug in gpuhealth" in p.message], r.problems
        assert all(isinstance(x, int) and x >= 0 for x in r.ranks)
        assert len(r.ranks) + len([p for p in r.problems if p.severity == "error"]) >= 1
        for d in r.dumps.values():
            for e in d.entries:
                assert isinstance(e.seq, int) and isinstance(e.group, str)


def test_parallel_loading_gives_the_same_result(tmp_path: Path) -> None:
    for r in range(6):
        write_json(tmp_path, f"rank{r}.json", dump(training(300, state_last="started")))
    (tmp_path / "rank9.json").write_text("garbage")
    one = load_dumps(tmp_path, tail_entries=4, workers=1)
    two = load_dumps(tmp_path, tail_entries=4, workers=2)
    assert one.ranks == two.ranks == list(range(6))
    assert [p.message for p in one.problems] == [p.message for p in two.problems]
    assert all([e.seq for e in one.dumps[r].entries] == [e.seq for e in two.dumps[r].entries] for r in range(6))


def test_fast_and_careful_entry_readers_agree_on_real_dumps() -> None:
    from gpuhealth.flightrec.normalize import entry_fast as _entry_fast
    from gpuhealth.flightrec.normalize import entry_slow as _entry_slow

    n = 0
    for path in sorted(FIXTURES.rglob("rank*.json")):
        for item in json.loads(path.read_text()).get("entries", []):
            fast = _entry_fast(item)
            assert fast is not None, item
            assert fast == _entry_slow(item)
            n += 1
    assert n > 400
