"""Compressed dumps and archives of dumps, unpacked in memory within bounds.

Dumps are often shipped compressed: ``rank3.json.gz``, a zip or a tarball of the dump folder. The
kind is told by the file's first bytes, not its name. Nothing is written to disk. A member may unpack
to at most ``max(DECOMPRESSION_FLOOR, DECOMPRESSION_RATIO × its packed size)`` (and the loader's
per-file limit), so a zip bomb is a problem line, not an out-of-memory: reading stops as soon as a
bound is passed, and ``tarfile`` only ever reads through a :class:`_Bounded` stream (its PAX and
long-name headers are read whole). An archive is one input file: all its members together (after a
nested ``.gz`` is unpacked too) unpack to at most the loader's limit for one file, so what one archive
costs is what one dump file costs; the members past it are problem lines naming them.
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import zipfile

# The decompressors, zipfile and tarfile are imported where used: most triage runs never meet a
# packed file, and the worker processes of a large job should not carry them.

DECOMPRESSION_RATIO = 256  # real dumps pack 8-50× (gzip to xz); deflate bombs reach 1,000×
DECOMPRESSION_FLOOR = 64 << 20  # any dump up to this size unpacks whatever its ratio
_CHUNK = 1 << 20
_TAR_BLOCK = 512

COMPRESSED = ("gzip", "bzip2", "xz")
ARCHIVES = ("zip",)
_UNSUPPORTED = {"zstd": "zstd -d", "7z": "7z x", "rar": "unrar x", "lz4": "lz4 -d"}
_MAGIC = (
    (b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"PK\x03\x04", "zip"),
    (b"PK\x05\x06", "zip"), (b"(\xb5/\xfd", "zstd"), (b"7z\xbc\xaf\x27\x1c", "7z"), (b"Rar!\x1a\x07", "rar"),
    (b"\x04\x22\x4d\x18", "lz4"),
)


class _Reader(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


class ArchiveError(ValueError):
    """A compressed file or archive that cannot be unpacked within the bounds (the message says why)."""


@dataclass(slots=True)
class Member:
    """One dump out of a compressed file or an archive: its bytes, or why it could not be had."""

    display: str  # "dumps.zip!/run/rank3.json": where it came from, for people
    name: str  # its own file name ("rank3.json"): where a rank number may be
    data: bytes | None
    mtime_ns: int | None = None
    error: str | None = None


def sniff(head: bytes) -> str:
    """The kind of a file from its first 512 bytes: a key of :data:`_MAGIC`'s kinds, "tar", or ""."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return ""


def is_packed(kind: str) -> bool:
    return kind in COMPRESSED or kind in ARCHIVES or kind == "tar" or kind in _UNSUPPORTED


def allowance(packed: int, max_file_bytes: int) -> int:
    """The most bytes ``packed`` bytes may unpack to (one file)."""
    return min(max_file_bytes, max(DECOMPRESSION_FLOOR, DECOMPRESSION_RATIO * packed))


def unpack(path: Path, kind: str, max_file_bytes: int, wanted: Callable[[str], bool]) -> Iterator[Member]:
    """The dumps in a compressed file or an archive at ``path`` (``kind`` from :func:`sniff`).
    A member that cannot be read is a Member with ``error``; ArchiveError when nothing can."""
    if kind in _UNSUPPORTED:
        raise ArchiveError(f"compressed with {kind}, which gpuhealth does not unpack: unpack it first "
                           f"({_UNSUPPORTED[kind]} {path.name})")
    size = path.stat().st_size
    try:
        if kind == "zip":
            yield from _zip(path, size, max_file_bytes, wanted)
        elif kind == "tar":
            with path.open("rb") as fh:
                yield from _tar(path, fh, size, max_file_bytes, wanted)
        else:
            yield from _single(path, kind, size, max_file_bytes, wanted)
    except ArchiveError:
        raise
    except OSError as exc:
        if exc.errno is not None:  # the file could not be read (BadGzipFile has no errno: damaged)
            raise
        raise ArchiveError(f"damaged {kind} file: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # zlib/lzma/bz2/zipfile/tarfile errors: a damaged or hostile file
        raise ArchiveError(f"damaged {kind} file: {type(exc).__name__}: {exc}") from exc


def _opener(kind: str) -> Callable[[IO[bytes]], io.BufferedIOBase]:
    import bz2
    import gzip
    import lzma

    if kind == "gzip":
        return lambda f: gzip.GzipFile(fileobj=f, mode="rb")
    if kind == "bzip2":
        return lambda f: bz2.BZ2File(f, mode="rb")
    return lambda f: lzma.LZMAFile(f, mode="rb")


def _single(path: Path, kind: str, size: int, max_file_bytes: int, wanted: Callable[[str], bool]
            ) -> Iterator[Member]:
    """A .gz/.bz2/.xz file: one dump, or a tarball (``dumps.tar.gz``)."""
    open_inner = _opener(kind)
    with path.open("rb") as raw, open_inner(raw) as inner:
        head = inner.read(_TAR_BLOCK)
        if sniff(head) == "tar":
            raw.seek(0)
            with open_inner(raw) as again:
                yield from _tar(path, again, size, max_file_bytes, wanted)
            return
        limit = allowance(size, max_file_bytes)
        data = head + _read_bounded(inner, limit - len(head), lambda: _over(path.name, size, limit, kind))
    mtime = _gzip_mtime(path) if kind == "gzip" else None
    yield Member(str(path), _strip_suffix(path.name), data, mtime)


def _zip(path: Path, size: int, max_file_bytes: int, wanted: Callable[[str], bool]) -> Iterator[Member]:
    import zipfile

    # Two bounds: what unpacking may cost (bytes inflated, kept or not: a bomb's are not) and what the
    # members handed on may hold together (one file's worth).
    work_limit, work = max(DECOMPRESSION_FLOOR, DECOMPRESSION_RATIO * size), 0
    total_limit, total = _archive_limit(size, max_file_bytes), 0
    with zipfile.ZipFile(path) as zf:
        infos = [i for i in zf.infolist() if not i.is_dir() and wanted(i.filename)]
        for n, info in enumerate(infos):
            display = f"{path}!/{info.filename}"
            name = info.filename.rsplit("/", 1)[-1]
            limit = min(allowance(info.compress_size, max_file_bytes), work_limit - work, total_limit - total)
            if limit <= 0:
                why = (_over(path.name, size, work_limit, "zip").args[0] if work >= work_limit
                       else _archive_over(path.name, total_limit, "zip"))
                for rest in infos[n:]:  # say which dumps were left unread (their ranks matter)
                    yield Member(f"{path}!/{rest.filename}", rest.filename.rsplit("/", 1)[-1], None,
                                 error=f"not read: {why}")
                return
            if total and info.file_size > total_limit - total:  # as declared (a lie is caught while reading)
                yield Member(display, name, None, error=f"not read: {_archive_over(path.name, total_limit, 'zip')}")
                continue
            try:
                with zf.open(info) as f:
                    data = _read_bounded(f, limit, functools.partial(_member_over, info.filename, limit,
                                                                     work_limit, work))
            except ArchiveError as exc:
                yield Member(display, name, None, error=str(exc))
                work += limit  # what unpacking it cost counts against the archive
                continue
            except Exception as exc:  # an encrypted member, an unknown method, a bad CRC…
                yield Member(display, name, None, error=f"cannot unpack from the zip: {type(exc).__name__}: {exc}")
                continue
            work += len(data)
            member = _inner(display, name, data, _zip_mtime(info), min(max_file_bytes, total_limit - total))
            del data
            total += len(member.data) if member.data is not None else 0
            yield member


def _tar(path: Path, stream: _Reader, size: int, max_file_bytes: int, wanted: Callable[[str], bool]
         ) -> Iterator[Member]:
    import tarfile

    stream_limit = max(DECOMPRESSION_FLOOR, DECOMPRESSION_RATIO * size)
    total_limit, total = _archive_limit(size, max_file_bytes), 0
    bounded = _Bounded(stream, stream_limit, lambda: _over(path.name, size, stream_limit, "tar"))
    with tarfile.open(fileobj=cast(IO[bytes], bounded), mode="r|") as tf:
        for ti in tf:
            if not ti.isfile() or not wanted(ti.name):
                continue
            display = f"{path}!/{ti.name}"
            name = ti.name.rsplit("/", 1)[-1]
            if total and total + ti.size > total_limit:
                yield Member(display, name, None, error=f"not read: {_archive_over(path.name, total_limit, 'tar')}")
                continue
            if ti.size > max_file_bytes:
                yield Member(display, name, None, error=f"unpacks to {ti.size / 2**20:.0f} MiB, over the "
                                                        f"{max_file_bytes / 2**20:.0f} MiB limit for one dump")
                continue
            f = tf.extractfile(ti)
            try:  # in chunks: one read(size) would reserve the declared size up front
                data = _read_bounded(f, ti.size, lambda: ArchiveError("more data than the tar header says")) \
                    if f is not None else b""
            except ArchiveError as exc:  # the stream is spent: nothing after this member can be read
                yield Member(display, name, None, error=str(exc))
                return
            member = _inner(display, name, data, int(ti.mtime * 1e9) if ti.mtime else None,
                            min(max_file_bytes, total_limit - total))
            del data
            total += len(member.data) if member.data is not None else 0
            yield member


def _inner(display: str, name: str, data: bytes, mtime_ns: int | None, max_file_bytes: int) -> Member:
    """A member that is itself compressed (rank3.json.gz in a zip) is unpacked once more."""
    kind = sniff(data[:_TAR_BLOCK])
    if kind in COMPRESSED:
        limit = allowance(len(data), max_file_bytes)
        try:
            with _opener(kind)(io.BytesIO(data)) as inner:
                data = _read_bounded(inner, limit, lambda: ArchiveError(
                    f"unpacks to more than {limit / 2**20:.0f} MiB (over {DECOMPRESSION_RATIO}× its "
                    f"{len(data) / 2**20:.1f} MiB; a zip bomb?)"))
        except ArchiveError as exc:
            return Member(display, name, None, error=str(exc))
        except Exception as exc:
            return Member(display, name, None, error=f"damaged {kind} data: {type(exc).__name__}: {exc}")
        return Member(display, _strip_suffix(name), data, mtime_ns)
    if is_packed(kind):
        return Member(display, name, None, error=f"a {kind} inside an archive is not unpacked: unpack the outer "
                                                 "archive first")
    return Member(display, name, data, mtime_ns)


def _archive_limit(packed: int, max_file_bytes: int) -> int:
    """What all the members of one archive may unpack to together: one file's worth."""
    return min(max_file_bytes, max(DECOMPRESSION_FLOOR, DECOMPRESSION_RATIO * packed))


def _archive_over(name: str, limit: int, kind: str) -> str:
    return (f"the {kind} {name}'s members unpack to more than {limit / 2**20:.0f} MiB together, the limit for one "
            "input file (an archive is read as one file); unpack it and pass its folder")


def _read_bounded(f: _Reader, limit: int, over: Callable[[], ArchiveError]) -> bytes:
    """At most ``limit`` bytes of ``f``; over() is raised when there are more. Read in chunks: a
    single read(limit) would reserve the whole limit up front."""
    parts: list[bytes] = []
    got = 0
    while True:
        chunk = f.read(min(_CHUNK, limit - got + 1))
        if not chunk:
            return b"".join(parts)
        got += len(chunk)
        if got > limit:
            raise over()
        parts.append(chunk)


class _Bounded:
    """A read-only stream that fails once more than ``limit`` bytes have come out of it."""

    def __init__(self, inner: _Reader, limit: int, over: Callable[[], ArchiveError]) -> None:
        self.inner, self.left, self.over = inner, limit, over

    def read(self, size: int = -1) -> bytes:
        data = self.inner.read(self.left + 1 if size < 0 else min(size, self.left + 1))
        self.left -= len(data)
        if self.left < 0:
            raise self.over()
        return data


def _over(name: str, size: int, limit: int, kind: str) -> ArchiveError:
    return ArchiveError(f"{name} unpacks to more than {limit / 2**20:.0f} MiB (over {DECOMPRESSION_RATIO}× its "
                        f"{size / 2**20:.1f} MiB {kind}; a zip bomb?): not unpacked further")


def _member_over(name: str, limit: int, total_limit: int, total: int) -> ArchiveError:
    if limit >= total_limit - total:
        return ArchiveError(f"the archive unpacks to more than {total_limit / 2**20:.0f} MiB (over "
                            f"{DECOMPRESSION_RATIO}× its size; a zip bomb?): {name} and later members not read")
    return ArchiveError(f"{name} unpacks to more than {limit / 2**20:.0f} MiB (over {DECOMPRESSION_RATIO}× its "
                        "packed size or the per-file limit; a zip bomb?): not read")


def _strip_suffix(name: str) -> str:
    for suffix in (".gz", ".bz2", ".xz"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def _gzip_mtime(path: Path) -> int | None:
    """The original file's mtime from the gzip header (0: not stored), else the .gz file's."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
        stamp = int.from_bytes(head[4:8], "little") if len(head) == 8 else 0
        return stamp * 1_000_000_000 if stamp else path.stat().st_mtime_ns
    except OSError:
        return None


def _zip_mtime(info: zipfile.ZipInfo) -> int | None:
    """The UTC mtime of the extended-timestamp field when the zip has one, else the local
    date_time (what ``unzip`` would give the extracted file)."""
    extra = info.extra
    i = 0
    while i + 4 <= len(extra):
        tag, n = int.from_bytes(extra[i : i + 2], "little"), int.from_bytes(extra[i + 2 : i + 4], "little")
        body = extra[i + 4 : i + 4 + n]
        if tag == 0x5455 and len(body) >= 5 and body[0] & 1:
            return int.from_bytes(body[1:5], "little") * 1_000_000_000
        i += 4 + n
    try:
        return int(time.mktime((*info.date_time, 0, 0, -1)) * 1_000_000_000)
    except (OverflowError, ValueError):
        return None

