"""Kernel-log reader for NVIDIA ``NVRM: Xid`` lines.

Sources (all offer ``read_new() -> list[KmsgRecord]``, never blocking):
- ``DevKmsg``: ``/dev/kmsg`` opened non-blocking; each ``read`` returns one record
  ``"<prio>,<seq>,<usec since boot>,<flags>;<text>"`` (continuation lines start with a space).
- ``KmsgFile``: a saved log (``dmesg``, ``journalctl -k`` or raw ``/dev/kmsg`` records); lines
  appended later are picked up on the next call.
- ``KmsgLines``: lines held in memory (scenario files of the fake backend).

``parse_xid`` turns ``NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python, GPU has fallen off the
bus.`` into a ``ParsedXid``; ``xid_events`` maps the PCI address to a GPU index.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gpuhealth.backends.base import XidEvent

DEV_KMSG = "/dev/kmsg"
_MAX_RECORD = 8192  # /dev/kmsg records are at most ~1 KiB; a larger buffer never truncates

# "6,1234,5678,-;text" (fields after the flags, such as caller ids, are optional)
_KMSG_PREFIX = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;")
# NVRM: Xid (PCI:0000:18:00): 79, pid=..., name=..., message   (older drivers omit "PCI:")
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})(?:\.[0-7])?\): "
                  r"(?P<xid>\d+)(?:, (?P<rest>.*))?$")
# nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)
_SXID = re.compile(r"nvidia-nvswitch(?P<switch>\d+): SXid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:"
                   r"[0-9A-Fa-f]{2}(?:\.[0-7])?)\): (?P<code>\d+), (?P<severity>Fatal|Non-fatal)(?:, (?P<msg>.*))?$",
                   re.IGNORECASE)
# What a kernel-log record looks like in a text log, besides /dev/kmsg's own "<prio>,<seq>,<usec>,…;":
# dmesg ("[   12.345678] …", dmesg -T "[Tue Dec  8 02:10:03 2026] …"), syslog and journalctl -k
# ("Dec  8 02:10:03 host kernel: …", ISO "2026-12-08T02:10:03.123+00:00 host kernel: …"), and a bare NVIDIA
# driver line ("NVRM: …", "nvidia-nvswitch3: …", as saved by hand or in a scenario).
_TEXT_RECORD = re.compile(
    r"^(?:\[\s*\d+\.\d+\]"
    r"|\[[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}\]"
    r"|(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d\S*) \S+ kernel: "
    r"|\s*(?:NVRM|nvidia-nvswitch\d*|nvidia-modeset|nvidia-uvm|nvidia):)")
_PID = re.compile(r"^pid=(?P<pid>'?<unknown>'?|\d+)(?:, name=(?P<name>[^,]*))?(?:, (?P<msg>.*))?$")


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    text: str
    seq: int | None = None
    usec_since_boot: int | None = None


@dataclass(frozen=True, slots=True)
class ParsedXid:
    pci: str  # "0000:18:00": domain:bus:device, lower case, 4-digit domain
    xid: int
    pid: int | None
    process: str
    message: str


@dataclass(frozen=True, slots=True)
class SxidEvent:
    """An NVSwitch SXid from the kernel log (the NVSwitch driver's counterpart of an XID)."""

    switch: int  # nvidia-nvswitch<N>
    pci: str  # the switch's PCI address, lower case
    sxid: int
    fatal: bool  # the driver's own word: "Fatal" or "Non-fatal"
    message: str
    timestamp: float
    seq: int | None = None


class KmsgSource(Protocol):
    @property
    def description(self) -> str: ...

    @property
    def named(self) -> bool:
        """A log someone named to be read (``--kmsg``, ``collectors.kmsg_path``): one that cannot be read, or
        holds no kernel record, leaves the XID check undone. Not so for /dev/kmsg, whose absence or refusal
        is the environment's (a container, no CAP_SYSLOG): NVML events still count."""
        ...

    def read_new(self) -> list[KmsgRecord]:
        """Records that appeared since the last call (everything kept, on the first call)."""
        ...


class KmsgUnavailable(OSError):
    """The kernel log cannot be read here (no /dev/kmsg, or not permitted): XIDs come from NVML only."""


def parse_record(raw: str) -> KmsgRecord:
    """One line of ``/dev/kmsg`` (or of a text log) → text plus sequence and boot-relative time."""
    line = raw.rstrip("\n")
    m = _KMSG_PREFIX.match(line)
    if m is None:
        return KmsgRecord(text=line)
    text = line[m.end():].split("\n", 1)[0]  # drop " KEY=value" continuation lines
    return KmsgRecord(text=text, seq=int(m.group(2)), usec_since_boot=int(m.group(3)))


def is_kernel_record(rec: KmsgRecord) -> bool:
    """Whether a line of a log reads as a kernel-log record (a /dev/kmsg record, a dmesg, syslog or journal
    line, or a bare NVIDIA driver line): a log with none is no kernel log, however many lines it holds."""
    return rec.seq is not None or _TEXT_RECORD.match(rec.text) is not None


def parse_xid(text: str) -> ParsedXid | None:
    m = _XID.search(text)
    if m is None:
        return None
    pci = m.group("pci").lower()
    domain, bus, dev = pci.split(":")
    pci = f"{domain[-4:].zfill(4)}:{bus}:{dev}"
    rest = (m.group("rest") or "").strip()
    pid: int | None = None
    process = ""
    message = rest
    pm = _PID.match(rest)
    if pm is not None:
        raw_pid = pm.group("pid")
        pid = int(raw_pid) if raw_pid.isdigit() else None
        process = (pm.group("name") or "").strip().strip("'")
        message = (pm.group("msg") or "").strip()
    return ParsedXid(pci=pci, xid=int(m.group("xid")), pid=pid, process=process, message=message)


def pci_to_gpu(pci: str, bus_ids: Iterable[tuple[int, str]]) -> int | None:
    """GPU index whose bus id (NVML ``00000000:18:00.0`` or sysfs ``0000:18:00.0``) is at ``pci``."""
    want = pci.lower()
    for index, bus_id in bus_ids:
        b = bus_id.lower()
        if b.count(":") == 2 and len(b.split(":")[0]) == 8:
            b = b[4:]
        if b.rsplit(".", 1)[0] == want:
            return index
    return None


def boot_time() -> float:
    """Wall-clock time of boot, to turn kmsg's microseconds-since-boot into epoch seconds."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def sxid_events(records: Iterable[KmsgRecord], *, booted_at: float | None = None,
                now: float | None = None) -> list[SxidEvent]:
    """NVSwitch SXids found in kernel-log records. Records without a kernel timestamp get ``now``."""
    out: list[SxidEvent] = []
    at_boot: float | None = booted_at
    wall_now = time.time() if now is None else now
    for rec in records:
        m = _SXID.search(rec.text)
        if m is None:
            continue
        if rec.usec_since_boot is None:
            ts = wall_now
        else:
            at_boot = boot_time() if at_boot is None else at_boot
            ts = at_boot + rec.usec_since_boot / 1e6
        out.append(SxidEvent(int(m["switch"]), m["pci"].lower(), int(m["code"]), m["severity"].lower() == "fatal",
                             (m["msg"] or "").strip(), ts, rec.seq))
    return out


def xid_events(
    records: Iterable[KmsgRecord],
    bus_ids: Sequence[tuple[int, str]],
    *,
    booted_at: float | None = None,
    now: float | None = None,
) -> list[XidEvent]:
    """XID events found in kernel-log records. Records without a kernel timestamp get ``now``."""
    out: list[XidEvent] = []
    at_boot = boot_time() if booted_at is None else booted_at
    wall_now = time.time() if now is None else now
    for rec in records:
        parsed = parse_xid(rec.text)
        if parsed is None:
            continue
        ts = wall_now if rec.usec_since_boot is None else at_boot + rec.usec_since_boot / 1e6
        detail = parsed.message
        if parsed.pid or parsed.process:  # pid 0 without a name: the kernel itself, nothing to add
            detail = f"pid={parsed.pid if parsed.pid is not None else '?'} name={parsed.process or '?'}: {detail}"
        out.append(
            XidEvent(
                gpu_index=pci_to_gpu(parsed.pci, bus_ids),
                xid=parsed.xid,
                timestamp=ts,
                source="kmsg",
                pci_bus_id=parsed.pci,
                detail=detail,
                seq=rec.seq,
                raw=rec.text.strip(),
            )
        )
    return out


class DevKmsg:
    """``/dev/kmsg``, non-blocking. The first call returns the whole ring buffer; later calls only new
    records. Records overwritten before we read them (EPIPE) are skipped, not fatal."""

    def __init__(self, path: str = DEV_KMSG) -> None:
        self._path = path
        self._fd: int | None = None
        self.missed = 0  # times the kernel overwrote records we had not read yet

    @property
    def description(self) -> str:
        return self._path

    named = False

    def _open(self) -> int:
        if self._fd is None:
            try:
                self._fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                raise KmsgUnavailable(exc.errno, f"cannot read {self._path}: {exc.strerror}") from exc
        return self._fd

    def read_new(self) -> list[KmsgRecord]:
        fd = self._open()
        out: list[KmsgRecord] = []
        size = _MAX_RECORD
        while True:
            try:
                chunk = os.read(fd, size)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    self.missed += 1
                    continue
                if exc.errno == errno.EINVAL:  # the record does not fit (and is not consumed): grow once
                    if size < 1 << 20:
                        size = 1 << 20
                        continue
                    self.missed += 1
                    break
                raise KmsgUnavailable(exc.errno, f"reading {self._path}: {exc.strerror}") from exc
            if not chunk:
                break
            out.append(parse_record(chunk.decode("utf-8", errors="replace")))
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class KmsgFile:
    """A saved kernel log. Reads what is there, then follows appended lines on later calls."""

    def __init__(self, path: str | Path) -> None:
        self._path = Path(path)
        self._offset = 0

    @property
    def description(self) -> str:
        return str(self._path)

    named = True

    def read_new(self) -> list[KmsgRecord]:
        try:
            with self._path.open("rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self._offset:  # truncated or rotated: start over
                    self._offset = 0
                fh.seek(self._offset)
                data = fh.read()
        except OSError as exc:
            raise KmsgUnavailable(exc.errno, f"cannot read {self._path}: {exc.strerror}") from exc
        end = data.rfind(b"\n") + 1  # keep a half-written last line for the next call
        self._offset += end
        text = data[:end].decode("utf-8", errors="replace")
        return [parse_record(line) for line in text.splitlines() if line.strip()]


class KmsgLines:
    """Lines in memory (the fake backend's scenario ``kmsg``); each line is returned once. A ``list``
    is shared, not copied, so lines appended to it later are seen on the next call."""

    def __init__(self, lines: Sequence[str], description: str = "scenario kmsg") -> None:
        self._lines: list[str] = lines if isinstance(lines, list) else list(lines)
        self._pos = 0
        self._description = description

    @property
    def description(self) -> str:
        return self._description

    named = False

    def extend(self, lines: Iterable[str]) -> None:
        self._lines.extend(lines)

    def read_new(self) -> list[KmsgRecord]:
        new = self._lines[self._pos:]
        self._pos = len(self._lines)
        return [parse_record(line) for line in new]
