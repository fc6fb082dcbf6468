"""Hostile and absurd dumps, built for real on disk: each becomes one clear problem line (or one
warning with what was capped), within a memory cap (a child process under RLIMIT_AS of 64 × the
input + 300 MiB) and a time cap — through the loader and through ``gpuhealth triage`` as a
subprocess. Never a traceback, never an out-of-memory."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import math
import os
import pickle
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from capped import run_capped
from frbuild import dump, entry, training, write_json, write_pickle

from gpuhealth.flightrec.jsonstream import MAX_ENTRIES
from gpuhealth.flightrec.load import MAX_RANKS, load_dumps, rank_from_filename
from gpuhealth.flightrec.normalize import MAX_DIMS, MAX_TENSORS

MIB = 1 << 20
TIME_CAP_S = 120
_GPUHEALTH = Path(sys.executable).with_name("gpuhealth")
_CLI = [str(_GPUHEALTH)] if _GPUHEALTH.exists() else [sys.executable, "-m", "gpuhealth.cli.main"]
_LOADER = """
import json, resource, sys
from gpuhealth.flightrec.load import load_dumps
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r = load_dumps(sys.argv[1])
print(json.dumps({
    "ranks": r.ranks,
    "entries": {str(d.rank): len(d.entries) for d in r.dumps.values()},
    "problems": [p.to_dict() for p in r.problems],
    "rss_growth": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024,
}))
"""


def _input_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _capped(cmd: list[str], folder: Path) -> subprocess.CompletedProcess[str]:
    cap = 64 * _input_bytes(folder) + 300 * MIB

    proc = run_capped(cmd, mem_bytes=cap, capture_output=True, text=True, timeout=TIME_CAP_S)
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr[-3000:]
    return proc


def load_capped(folder: Path) -> dict[str, Any]:
    """load_dumps(folder) in a child under the memory cap."""
    proc = _capped([sys.executable, "-c", _LOADER, str(folder)], folder)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def triage_capped(folder: Path) -> tuple[int, dict[str, Any]]:
    """``gpuhealth triage FOLDER --json`` under the memory cap: (exit code, report)."""
    proc = _capped([*_CLI, "triage", str(folder), "--json"], folder)
    report: dict[str, Any] = json.loads(proc.stdout)
    return proc.returncode, report


def _errors(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {Path(p["path"]).name: p for p in out["problems"] if p["severity"] == "error"}


def _healthy_job(folder: Path, ranks: range = range(4)) -> None:
    for r in ranks:
        write_json(folder, f"rank{r}.json", dump(training(5)))


# ------------------------------------------------------------------------------------ pickles


def _entry_with(**fields: Any) -> dict[str, Any]:
    e = entry(1, json_style=False)
    e.update(fields)
    return e


def _dag(depth: int) -> list[Any]:
    node: list[Any] = []
    for _ in range(depth):
        node = [node, node]  # pickled once, referenced twice through the memo
    return node


def _tuple_key_bomb(depth: int) -> bytes:
    """{t: 1} where t = (t', t'), t' = (t'', t''), … depth levels down to (): hashing t as the key
    takes 2^depth steps (written by hand: building it in Python would hash it)."""
    ops = b"\x80\x02}q\x00)q\x010"  # {} (memo 0), () (memo 1), pop
    for i in range(1, depth + 1):
        ops += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1]) + b"0"  # (t, t) (memo i+1)
    return ops + b"h" + bytes([depth + 1]) + b"K\x01s."  # d[t] = 1


def test_keys_made_to_collide_in_the_hash_table_are_refused_at_once(tmp_path: Path) -> None:
    """Issue 30 item 6: ints a multiple of 2**61 - 1 apart share a hash, so n such dict keys cost O(n**2) to
    insert — a 1.27 MB pickle kept ``gpuhealth triage`` busy 79 s (and the coordinator's triage child its
    whole 300 s). Keys and set members may be strings and small numbers only: refused in one line, at once,
    through the command; the other ranks are judged."""
    p = (1 << 61) - 1
    colliding = {p * i: 1 for i in range(1, 4000)}
    write_pickle(tmp_path, "rank0.pkl", {"version": "2.10", "entries": [_entry_with()], "pg_status": colliding})
    (tmp_path / "rank1.pkl").write_bytes(pickle.dumps({"version": "2.10", "members": {p * i for i in range(1, 4000)}}))
    tuples = {(i, -i): 1 for i in range(100)}  # tuple keys: their hashes can be made to collide too
    write_pickle(tmp_path, "rank2.pkl", {"version": "2.10", "entries": [_entry_with()], "pg_status": tuples})
    write_pickle(tmp_path, "rank3.pkl", {"version": "2.10", "entries": [_entry_with()], "pg_status": {"0": {7: 1}}})
    start = time.monotonic()
    code, report = triage_capped(tmp_path)
    assert time.monotonic() - start < 60
    assert code != 0  # three of four ranks could not be read: never a clean answer
    problems = {Path(p["path"]).name: p["message"] for p in report["problems"] if p["severity"] == "error"}
    for r in range(3):
        assert "as a dict key or set member" in problems[f"rank{r}.pkl"], problems
    assert "rank3.pkl" not in problems  # small int keys, as a real dump has, still load


def test_pickles_that_inflate_through_reused_references_are_refused(tmp_path: Path) -> None:
    shallow, deep = _dag(20), _dag(21)
    write_pickle(tmp_path, "rank0.pkl", {"version": "2.10", "entries": [_entry_with(input_sizes=shallow,
                                                                                   input_dtypes=shallow)]})
    write_pickle(tmp_path, "rank1.pkl", {"version": "2.10", "entries": [_entry_with(input_dtypes=deep)]})
    frame: dict[str, Any] = {"name": "f", "filename": "x.py", "line": 1}
    for _ in range(30):
        frame = {"name": frame, "filename": frame, "line": 1}  # a dict DAG where a frame goes
    write_pickle(tmp_path, "rank2.pkl", {"version": "2.10", "entries": [_entry_with(frames=[frame])]})
    (tmp_path / "rank3.pkl").write_bytes(_tuple_key_bomb(60))
    shared = _entry_with()
    write_pickle(tmp_path, "rank4.pkl", {"version": "2.10", "entries": [shared] * 50_000})
    write_pickle(tmp_path, "rank5.pkl", {"version": "2.10", "entries": [shared] * 3})
    assert all(p.stat().st_size < 200_000 for p in tmp_path.iterdir())
    assert (tmp_path / "rank0.pkl").stat().st_size < 2000

    out = load_capped(tmp_path)
    errors = _errors(out)
    assert out["ranks"] == []
    assert set(errors) == {f"rank{r}.pkl" for r in range(6)}
    for r in range(5):
        assert errors[f"rank{r}.pkl"]["message"].startswith("refused: the pickle reuses"), errors
        assert errors[f"rank{r}.pkl"]["rank"] == r
    assert "more often than its size allows" in errors["rank4.pkl"]["message"]
    assert "lists one entry several times" in errors["rank5.pkl"]["message"]

    code, report = triage_capped(tmp_path)
    assert code == 3 and report["verdict"] == "incomplete"
    assert len([p for p in report["problems"] if p["severity"] == "error"]) == 6


TRIAGE_CEILING = 1 << 30  # what `gpuhealth triage` may take for the worst single dump (docs/security.md)


# `gpuhealth ARGS` in a fresh interpreter under RLIMIT_AS, writing its own VmHWM at exit: the peak of that process
# alone (wait4's ru_maxrss would carry pytest's size, copied at fork, across the exec).
_MEASURED_CLI = (
    "import atexit, resource, sys\n"
    "cap, out = int(sys.argv[1]), sys.argv[2]\n"
    "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
    "def _hwm():\n"
    "    with open('/proc/self/status') as f, open(out, 'w') as o:\n"
    "        o.write(next(l.split()[1] for l in f if l.startswith('VmHWM:')))\n"
    "atexit.register(_hwm)\n"
    "sys.argv = ['gpuhealth', *sys.argv[3:]]\n"
    "from gpuhealth.cli.main import main\n"
    "main()\n"
)


def _triage_measured(folder: Path, cap: int) -> tuple[int, dict[str, Any] | None, str, int]:
    """``gpuhealth triage FOLDER --json`` under RLIMIT_AS=cap: (exit code, report, stderr, peak RSS in bytes)."""
    hwm = folder.parent / f"{folder.name}.hwm"
    proc = subprocess.run([sys.executable, "-c", _MEASURED_CLI, str(cap), str(hwm), "triage", str(folder), "--json"],
                          capture_output=True, text=True, timeout=TIME_CAP_S, check=False)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        report = None
    peak = int(hwm.read_text()) * 1024 if hwm.exists() else 0
    return proc.returncode, report, proc.stderr, peak


def _vsz_of_the_cli() -> int:
    """Address space the triage command takes before reading anything (imports, libraries)."""
    probe = ("import gpuhealth.cli.main, gpuhealth.flightrec.verdict, gpuhealth.flightrec.load; "
             "from pathlib import Path; status = Path('/proc/self/status').read_text().splitlines(); "
             "print(next(int(l.split()[1]) for l in status if l.startswith('VmSize:')) * 1024)")
    return int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)


def test_flat_pickles_of_one_byte_opcodes_stay_under_the_triage_ceiling(tmp_path: Path) -> None:
    """Issue 24: a 16 MiB pickle of 1-byte opcodes took `gpuhealth triage` to 1.2 GiB (64 MiB: 4.7 GiB), and
    a MemoryError traceback under a cap. Empty sets are the worst opcode (232 bytes each): they stop at the
    unpickler's budget, whatever the file's size."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    (folder / "rank0.pkl").write_bytes(b"\x80\x04" + b"\x8f" * (16 * MIB) + b".")  # EMPTY_SET: ~3.7 GB if built
    (folder / "rank1.pkl").write_bytes(b"\x80\x04" + b"]" * (16 * MIB) + b".")  # EMPTY_LIST: ~1.2 GB
    _healthy_job(folder, range(2, 4))
    code, report, stderr, peak = _triage_measured(folder, 2 << 30)
    assert "Traceback" not in stderr and report is not None, stderr[-2000:]
    assert code == 3 and report["verdict"] == "incomplete"
    errors = {p["rank"]: p["message"] for p in report["problems"] if p["severity"] == "error"}
    assert set(errors) == {0, 1}
    for message in errors.values():
        assert message.startswith("refused: the pickle builds more than its 384 MiB memory budget"), message
    assert report["ranks_seen"] == [2, 3]
    assert 0 < peak < TRIAGE_CEILING, f"peak RSS {peak >> 20} MiB"


def test_running_out_of_memory_reading_a_dump_is_one_line(tmp_path: Path) -> None:
    """A process allowed less than the pickle budget (here: ~160 MiB past its imports) runs out while
    unpickling: one problem line naming the file, the memory given back, the other ranks judged."""
    folder = tmp_path / "dumps"
    folder.mkdir()
    (folder / "rank0.pkl").write_bytes(b"\x80\x04" + b"]" * (8 * MIB) + b".")  # 640 MiB of lists if built
    _healthy_job(folder, range(1, 3))
    code, report, stderr, _ = _triage_measured(folder, _vsz_of_the_cli() + 160 * MIB)
    assert "Traceback" not in stderr and "MemoryError" not in stderr and report is not None, stderr[-2000:]
    errors = {p["rank"]: p["message"] for p in report["problems"] if p["severity"] == "error"}
    assert list(errors) == [0] and errors[0].startswith("ran out of memory unpickling it"), errors
    assert code == 3 and report["ranks_seen"] == [1, 2]


def test_pickle_opcodes_that_grow_the_unpickler_itself_are_bounded(tmp_path: Path) -> None:
    # LONG_BINPUT 2^30: the C unpickler sizes its memo array by this number (16 GB for 12 bytes).
    (tmp_path / "rank0.pkl").write_bytes(b"\x80\x02N" + b"r" + (1 << 30).to_bytes(4, "little") + b".")
    (tmp_path / "rank1.pkl").write_bytes(b"\x80\x02" + b"(" * 200_000 + b".")  # 200k nested MARKs
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    write_pickle(tmp_path, "rank2.pkl", {"version": "2.10", "entries": [_entry_with(input_sizes=cyclic)]})
    out = load_capped(tmp_path)
    errors = _errors(out)
    assert "not a dump dict" in errors["rank0.pkl"]["message"]
    assert "MARKs nested" in errors["rank1.pkl"]["message"]
    # A list that holds itself loads as an unknown shape, counted in one warning.
    assert out["ranks"] == [2] and out["entries"] == {"2": 1}
    warnings = [p["message"] for p in out["problems"] if p["severity"] == "warning"]
    assert warnings == ["1 entry had values torch never writes, capped or ignored: input_sizes (1)"]


# ------------------------------------------------------------------------------------ ranks


def test_absurd_ranks_are_refused_and_the_rest_is_judged(tmp_path: Path) -> None:
    _healthy_job(tmp_path)
    write_json(tmp_path, "rank9999999999999.json", dump(training(5)))
    small = tmp_path / "dump.json"
    small.write_text('{"version":"2.10","rank":30000000,"entries":[]}')
    assert small.stat().st_size == 47
    huge = dump(training(5), extra={"gpuhealth": {"rank": 10**40}})
    write_json(tmp_path, "mystery.json", huge)
    # The world's list naming a rank far beyond the job: the rank is dropped, not tabled.
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3, 30000000, 99999999999999999999]"}}
    write_json(tmp_path, "rank3.json", dump(training(5), pg_config=cfg))

    out = load_capped(tmp_path)
    assert out["ranks"] == [0, 1, 2, 3]
    errors = _errors(out)
    assert "file name says rank 9,999,999,999,999" in errors["rank9999999999999.json"]["message"]
    assert "says it is rank 30,000,000" in errors["dump.json"]["message"]
    assert "says it is rank ≈2^132" in errors["mystery.json"]["message"]
    assert all(p["rank"] is None for p in errors.values())  # no impossible rank reaches triage
    assert f"ranks above {MAX_RANKS - 1:,} are refused" in errors["dump.json"]["message"]
    assert any("pg_config: rank numbers that are not ranks" in p["message"] and p["rank"] == 3
               for p in out["problems"])

    code, report = triage_capped(tmp_path)
    assert code == 0 and report["verdict"] == "healthy", report["summary"]
    assert report["ranks_seen"] == [0, 1, 2, 3]

    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "rank9999999999999.json").write_text('{"version":"2.10","entries":[]}')
    code, report = triage_capped(alone)
    assert code == 3 and report["verdict"] == "incomplete"
    assert [p["message"][:33] for p in report["problems"]] == ["the file name says rank 9,999,999"]


# ------------------------------------------------------------------------------------ JSON size


def test_a_flood_of_entries_is_refused_past_what_a_buffer_holds(tmp_path: Path) -> None:
    with (tmp_path / "rank0.json").open("w") as f:
        f.write('{"version":"2.10","entries":[' + ",".join(["{}"] * (MAX_ENTRIES + 1)) + "]}")
    out = load_capped(tmp_path)
    assert out["ranks"] == []
    assert _errors(out)["rank0.json"]["message"] == (f"more than {MAX_ENTRIES:,} entries: more than any "
                                                     "flight-recorder buffer holds")
    assert _errors(out)["rank0.json"]["rank"] == 0
    code, report = triage_capped(tmp_path)
    assert code == 3 and report["verdict"] == "incomplete"


def test_malformed_entries_are_counted_in_one_line(tmp_path: Path) -> None:
    good = dump(training(3))
    good["entries"] += [{}] * 100_000 + [[]] * 1000 + ["x", 1, None, {"record_id": 1}]
    write_json(tmp_path, "rank0.json", good)
    write_json(tmp_path, "rank1.json", dump(training(3)))
    out = load_capped(tmp_path)
    assert out["entries"] == {"0": 3, "1": 3}
    assert [p["message"] for p in out["problems"]] == ["101004 malformed entries skipped"]


def test_streaming_keeps_memory_a_small_multiple_of_the_file(tmp_path: Path) -> None:
    """The reason to stream: json.loads of a whole dump holds every entry as a dict (5-26× the
    file); entry by entry, only the normalized entries and the file's bytes are held."""
    write_json(tmp_path, "rank0.json", dump([entry(s, duration_ms=1.5) for s in range(1, 40_001)]))
    size = _input_bytes(tmp_path)
    assert size > 15 * MIB
    out = load_capped(tmp_path)
    assert out["entries"] == {"0": 40_000}
    assert out["rss_growth"] < 3.5 * size, out["rss_growth"] / size


def test_deeply_nested_json_is_a_problem_line(tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "rank0.json").write_text('{"version":"2.10","entries":[' + deep + "]}")
    (tmp_path / "rank1.json").write_text('{"version":"2.10","pg_config":' + deep + ',"entries":[]}')
    (tmp_path / "rank2.json").write_text('{"version":"2.10","entries":[{"record_id":' + deep + "}]}")
    out = load_capped(tmp_path)
    errors = _errors(out)
    # An element that is no object is skipped unread, however deep; one that must be decoded is refused.
    assert out["entries"] == {"0": 0}
    assert [p["message"] for p in out["problems"] if p["rank"] == 0] == ["1 malformed entry skipped"]
    assert errors["rank1.json"]["message"] == "the top-level 'pg_config' is nested too deeply"
    assert errors["rank2.json"]["message"] == "entry #1 is nested too deeply"


# ------------------------------------------------------------------------------------ packed


def _plain_job(folder: Path) -> dict[int, bytes]:
    """A 4-rank hang (rank 2 never enqueues the last all_reduce): the same dumps, however shipped."""
    data = {}
    for r in range(4):
        entries = training(5, state_last="started") if r != 2 else training(4)
        data[r] = json.dumps(dump(entries), separators=(",", ":"), sort_keys=True).encode()
        (folder / f"rank{r}.json").write_bytes(data[r])
    return data


def test_compressed_dumps_and_archives_load_like_plain_ones(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    data = _plain_job(plain)
    packed = {name: tmp_path / name for name in ("gz", "bz2", "xz", "zip", "tgz", "tar", "mixed")}
    for folder in packed.values():
        folder.mkdir()
    for r, raw in data.items():
        (packed["gz"] / f"rank{r}.json.gz").write_bytes(gzip.compress(raw))
        (packed["bz2"] / f"node1-rank{r}.json.bz2").write_bytes(bz2.compress(raw))
        (packed["xz"] / f"rank{r}.json.xz").write_bytes(lzma.compress(raw))
    with zipfile.ZipFile(packed["zip"] / "dumps.zip", "w", zipfile.ZIP_DEFLATED) as z:
        for r, raw in data.items():
            z.writestr(f"job-7/dumps/rank{r}.json", raw)
        z.writestr("job-7/dumps/steps_rank0.jsonl", "{}\n")  # not a dump: skipped as on disk
        z.writestr("__MACOSX/job-7/dumps/._rank0.json", b"\x00\x05\x16\x07")
    for name, mode in (("tgz", "w:gz"), ("tar", "w")):
        with tarfile.open(packed[name] / f"dumps.{'tar.gz' if name == 'tgz' else 'tar'}", mode) as t:
            for r, raw in data.items():
                info = tarfile.TarInfo(f"dumps/rank{r}.json")
                info.size, info.mtime = len(raw), 1_795_657_448
                t.addfile(info, io.BytesIO(raw))
    # A zip of gzipped dumps, next to a plain one.
    with zipfile.ZipFile(packed["mixed"] / "some.zip", "w") as z:
        for r in (0, 1):
            z.writestr(f"rank{r}.json.gz", gzip.compress(data[r]))
    (packed["mixed"] / "rank2.json").write_bytes(data[2])
    (packed["mixed"] / "rank3.json.gz").write_bytes(gzip.compress(data[3]))

    want = load_dumps(plain)
    for name, folder in packed.items():
        got = load_dumps(folder)
        assert got.problems == [], (name, got.problems)
        assert got.ranks == [0, 1, 2, 3], name
        for r in range(4):
            assert got.dumps[r].entries == want.dumps[r].entries, (name, r)
    tar_dump = load_dumps(packed["tar"]).dumps[0]
    assert tar_dump.path.endswith("dumps.tar!/dumps/rank0.json")
    assert tar_dump.dump_time_ns == 1_795_657_448 * 10**9 and tar_dump.dump_time_source == "mtime"
    assert load_dumps(packed["bz2"]).dumps[1].host == "node1"

    code, report = triage_capped(packed["tgz"])
    code_plain, report_plain = triage_capped(plain)
    assert code == code_plain == 2
    assert report["verdict"] == report_plain["verdict"] == "hang"
    assert report["summary"] == report_plain["summary"]


class _Spaces:
    """A file of ``n`` spaces that is never held in memory."""

    def __init__(self, n: int) -> None:
        self.left = n

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        self.left -= size
        return b" " * size


def _deflate_bomb(f: Any, n_mib: int, start: bytes = b'{"version":"2.10","entries":[') -> None:
    f.write(start)
    chunk = b" " * MIB
    for _ in range(n_mib):
        f.write(chunk)
    f.write(b"]}")


def test_decompression_bombs_are_problem_lines(tmp_path: Path) -> None:
    good = json.dumps(dump(training(5)), separators=(",", ":"), sort_keys=True).encode()
    with zipfile.ZipFile(tmp_path / "dumps.zip", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open("rank0.json", "w", force_zip64=True) as f:
            _deflate_bomb(f, 300)
        z.writestr("rank1.json", good)
    with gzip.open(tmp_path / "rank2.json.gz", "wb", compresslevel=9) as f:
        _deflate_bomb(f, 300)
    with tarfile.open(tmp_path / "more.tar.gz", "w:gz", compresslevel=9) as t:
        info = tarfile.TarInfo("rank3.json")
        info.size = 300 * MIB
        t.addfile(info, _Spaces(info.size))
    (tmp_path / "rank4.json.zst").write_bytes(b"(\xb5/\xfd" + os.urandom(64))  # zstd: not unpacked here
    assert _input_bytes(tmp_path) < 2 * MIB

    out = load_capped(tmp_path)
    assert out["ranks"] == [1]
    errors = {p["rank"]: p["message"] for p in out["problems"] if p["severity"] == "error"}
    # rank3's tar header says 300 MiB: over the per-file limit before a byte of it is unpacked (and the tar
    # itself, read past that member, is over its own allowance: a line without a rank).
    assert set(errors) == {0, 2, 3, 4, None}, out["problems"]
    for r in (0, 2, None):
        assert "zip bomb?" in errors[r] and "unpacks to more than" in errors[r], errors[r]
    assert errors[3] == "unpacks to 300 MiB, over the 64 MiB limit for one dump"
    assert errors[4] == ("compressed with zstd, which gpuhealth does not unpack: unpack it first "
                         "(zstd -d rank4.json.zst)")

    code, report = triage_capped(tmp_path)
    assert code == 3 and report["verdict"] == "incomplete"


# ------------------------------------------------------------------------------------ identity


def test_unreadable_files_named_as_dumps_carry_their_rank(tmp_path: Path) -> None:
    write_json(tmp_path, "rank0.json", dump(training(3)))
    (tmp_path / "rank1.json").write_bytes(b"\x00\xffgarbage" * 10)
    (tmp_path / "rank2.pkl").write_bytes(b"\x80\x04\x95" + (40).to_bytes(8, "little") + b"\x8c\x08builtins\x94"
                                         b"\x8c\x04eval\x94\x93\x94\x8c\x10open('x','w')\x94\x85\x94R\x94.")
    good = json.dumps(dump(training(3)))
    (tmp_path / "rank3.json").write_text(good[: len(good) // 2])
    (tmp_path / "node7-rank4.json").write_text("")
    (tmp_path / "rank5.json.gz").write_bytes(gzip.compress(good.encode())[:40])
    write_pickle(tmp_path, "rank6.pkl", {"version": "2.10", "entries": [_entry_with(input_dtypes=_dag(12))]})
    (tmp_path / "nccl_trace_rank_7").write_bytes(b"\x80\x02}q\x00.")  # a pickle of {}: not a dump
    with zipfile.ZipFile(tmp_path / "late.zip", "w") as z:
        z.writestr("dumps/rank8.json", '{"version":"2.10","entries":[{"record_id":')
    (tmp_path / "steps_rank0.jsonl").write_text("{}\n")  # not a dump: no problem line
    (tmp_path / "notes.txt").write_text("rank 9 was slow")

    res = load_dumps(tmp_path)
    assert res.ranks == [0]
    by_rank = {p.rank: p for p in res.problems}
    assert sorted(by_rank) == list(range(1, 9)), res.problems
    assert all(p.severity == "error" for p in res.problems)
    assert "not a flight-recorder dump" in by_rank[1].message
    assert "builtins.eval" in by_rank[2].message
    assert "broken JSON" in by_rank[3].message
    assert by_rank[4].message == "empty file"
    assert "damaged gzip" in by_rank[5].message
    assert "reuses" in by_rank[6].message
    assert "not a flight-recorder dump" in by_rank[7].message
    assert by_rank[8].path.endswith("late.zip!/dumps/rank8.json") and "broken JSON" in by_rank[8].message
    assert not Path("x").exists()
    # Triage does not judge from rank 0 alone: the others exist, their dumps could not be read.
    code, report = triage_capped(tmp_path)
    assert code == 3 and report["verdict"] == "incomplete"
    assert report["ranks_unreadable"] == list(range(1, 9))


def test_compressed_names_give_ranks() -> None:
    assert rank_from_filename("rank3.json.gz") == (3, None)
    assert rank_from_filename("node2-rank12.pkl.xz") == (12, "node2")
    assert rank_from_filename("nccl_trace_rank_5.bz2") == (5, None)


# ------------------------------------------------------------------------------------ fields


def test_any_source_p2p_parses(tmp_path: Path) -> None:
    entries = [entry(1, op="recv", p2p="1<-?", state="started"), entry(2, op="send", p2p="0->?", state="started"),
               entry(3, op="send", p2p="0->99999999999", state="started")]
    write_json(tmp_path, "rank1.json", dump(entries))
    res = load_dumps(tmp_path)
    recv, send, absurd = res.dumps[1].entries
    assert (recv.op, recv.p2p_src, recv.p2p_dst) == ("recv", None, 1)
    assert (send.op, send.p2p_src, send.p2p_dst) == ("send", 0, None)
    assert (absurd.op, absurd.p2p_src, absurd.p2p_dst) == ("send", 0, None)
    assert [p.message for p in res.problems] == [
        "1 entry had values torch never writes, capped or ignored: profiling_name (1)"]


def _absurd_entries(many: int) -> list[dict[str, Any]]:
    """Each absurd in another way, the same on input and output (so the records stay self-consistent)."""
    e = [entry(s) for s in range(1, 9)]
    for side in ("input", "output"):
        e[0][f"{side}_sizes"] = [[-5, 3]]
        e[1][f"{side}_sizes"] = [[1] for _ in range(many)]
        e[1][f"{side}_dtypes"] = ["Float"] * many
        e[2][f"{side}_sizes"] = [[2] * many]
    e[3]["duration_ms"] = math.nan
    e[4]["duration_ms"] = math.inf
    e[5]["time_created_ns"] = "yesterday"
    e[5]["time_discovered_started_ns"] = "1795657428304121098"
    e[6]["time_discovered_completed_ns"] = -7
    e[7]["timeout_ms"] = 10**30
    e[7]["process_group"] = ["0", {"nested": ["dict"]}]
    return e


@pytest.mark.parametrize("fmt", ["json", "pickle"])
def test_absurd_field_values_are_capped_and_counted(tmp_path: Path, fmt: str) -> None:
    for r in (0, 1):
        # 10^6 tensors or dimensions; 2×10^5 in a pickle (the pure-Python unpickler is slower)
        doc = dump(_absurd_entries(1_000_000 if fmt == "json" else 200_000))
        if fmt == "json":
            (tmp_path / f"rank{r}.json").write_text(json.dumps(doc))  # NaN and Infinity as Python writes them
        else:
            write_pickle(tmp_path, f"rank{r}.pkl", doc)
    res = load_dumps(tmp_path)
    assert res.ranks == [0, 1]
    e = res.dumps[0].entries
    assert len(e) == 8
    assert e[0].in_sizes == ((-1, 3),)
    assert len(e[1].in_sizes) == len(e[1].out_dtypes) == MAX_TENSORS
    assert len(e[2].in_sizes[0]) == len(e[2].out_sizes[0]) == MAX_DIMS
    assert e[3].duration_ms is None and e[4].duration_ms is None
    assert e[5].created_ns is None and e[5].started_ns == 1795657428304121098
    assert e[6].completed_ns is None and e[7].timeout_ms is None and e[7].group_desc == ""
    lines = [p.message for p in res.problems if p.rank == 0]
    assert lines == ["8 entries had values torch never writes, capped or ignored: duration_ms (2), input_dtypes (1), "
                     "input_sizes (3), output_dtypes (1), output_sizes (3), process_group (1), time_created_ns (1), "
                     "time_discovered_completed_ns (1), time_discovered_started_ns (1), timeout_ms (1)"]
    code, report = triage_capped(tmp_path)
    assert code == 0 and report["verdict"] == "healthy", report["summary"]
    assert len([p for p in report["problems"] if p["severity"] == "warning"]) == 2


def _json_tensors(mib: int) -> bytes:
    """A dump of tensor-heavy JSON entries (the most records per byte) of about ``mib`` MiB."""
    one = entry(1, sizes=[[1000 + j] for j in range(60_000)], out_sizes=[[7]])
    n = max(1, mib * MIB // len(json.dumps(one, separators=(",", ":"))))
    return json.dumps(dump([{**one, "record_id": i, "collective_seq_id": i + 1} for i in range(n)]),
                      separators=(",", ":")).encode()


def test_an_archive_costs_triage_what_one_file_does(tmp_path: Path) -> None:
    """Issue 30, item 8: one zip holding six 60 MiB JSON dumps took `gpuhealth triage` to 2.35 GiB (each
    member was bounded like a file, their records added up); the ceiling is 1 GiB for one input file of any
    format. Now an archive's members unpack to one file's limit (64 MiB) together: the first is judged, the
    rest are problem lines naming them and the limit."""
    text = _json_tensors(60)
    folder = tmp_path / "dumps"
    folder.mkdir()
    with zipfile.ZipFile(folder / "dumps.zip", "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for r in range(6):
            z.writestr(f"rank{r}.json", text)
    code, report, stderr, peak = _triage_measured(folder, 3 << 30)
    assert "Traceback" not in stderr and report is not None, stderr[-2000:]
    assert 0 < peak < TRIAGE_CEILING, f"peak RSS {peak >> 20} MiB"
    assert code == 3 and report["verdict"] == "incomplete"
    errors = [p["message"] for p in report["problems"] if p["severity"] == "error"]
    assert len(errors) == 5 and all("unpack to more than 64 MiB together" in m for m in errors), errors
    assert report["ranks_seen"] == [0]
