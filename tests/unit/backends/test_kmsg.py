"""Kernel-log XID parsing: /dev/kmsg records, dmesg/journal text, bus id → GPU index."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuhealth.backends.kmsg import (
    DevKmsg,
    KmsgFile,
    KmsgLines,
    KmsgUnavailable,
    parse_record,
    parse_xid,
    pci_to_gpu,
    xid_events,
)

BUS_IDS = [(0, "00000000:18:00.0"), (1, "00000000:2A:00.0")]


def test_dev_kmsg_record_prefix_and_continuation_lines() -> None:
    rec = parse_record("4,1234,5678901,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, "
                       "GPU has fallen off the bus.\n SUBSYSTEM=pci\n DEVICE=+pci:0000:18:00.0\n")
    assert (rec.seq, rec.usec_since_boot) == (1234, 5678901)
    assert rec.text.endswith("GPU has fallen off the bus.")
    x = parse_xid(rec.text)
    assert x is not None
    assert (x.pci, x.xid, x.pid, x.process, x.message) == ("0000:18:00", 79, 1234, "python3",
                                                          "GPU has fallen off the bus.")


@pytest.mark.parametrize(
    ("line", "pci", "xid", "pid", "process"),
    [
        ("[ 269.517039] NVRM: Xid (0000:01:00): 3, C 00000005 SC 00000007", "0000:01:00", 3, None, ""),
        ("Aug 30 11:43:09 h kernel: NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, "
         "Graphics SM Warp Exception", "0000:cb:00", 13, None, "<unknown>"),
        ("NVRM: Xid (PCI:0000:2A:00): 119, pid=0, Timeout after 45s of waiting for RPC response",
         "0000:2a:00", 119, 0, ""),
        ("NVRM: Xid (PCI:00000000:18:00.0): 48, DBE", "0000:18:00", 48, None, ""),
    ],
)
def test_xid_line_variants(line: str, pci: str, xid: int, pid: int | None, process: str) -> None:
    x = parse_xid(parse_record(line).text)
    assert x is not None and (x.pci, x.xid, x.pid, x.process) == (pci, xid, pid, process)


def test_non_xid_lines_are_ignored() -> None:
    assert parse_xid("NVRM: GPU at PCI:0000:18:00: GPU-0b11d014") is None
    assert parse_xid("usb 1-1: new high-speed USB device") is None


def test_bus_id_maps_to_gpu_index_and_times_come_from_boot() -> None:
    assert pci_to_gpu("0000:2a:00", BUS_IDS) == 1
    assert pci_to_gpu("0000:99:00", BUS_IDS) is None
    records = [parse_record("6,1,2500000,-;NVRM: Xid (PCI:0000:2a:00): 74, pid=1, name=x, NVLink error"),
               parse_record("NVRM: Xid (PCI:0000:18:00): 31, pid=2, name=y, MMU Fault")]
    a, b = xid_events(records, BUS_IDS, booted_at=1000.0, now=5000.0)
    assert (a.gpu_index, a.xid, a.timestamp, a.source, a.pci_bus_id) == (1, 74, 1002.5, "kmsg", "0000:2a:00")
    assert (b.gpu_index, b.xid, b.timestamp) == (0, 31, 5000.0)  # no kernel timestamp: "now"
    assert a.detail == "pid=1 name=x: NVLink error"


def test_file_source_follows_appended_lines_and_keeps_half_lines(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:18:00): 79, a\nNVRM: Xid (PCI:0000:18:00): 4")
    src = KmsgFile(log)
    assert [r.text for r in src.read_new()] == ["NVRM: Xid (PCI:0000:18:00): 79, a"]
    with log.open("a") as fh:
        fh.write("8, b\n")
    assert [r.text for r in src.read_new()] == ["NVRM: Xid (PCI:0000:18:00): 48, b"]
    assert src.read_new() == []
    log.write_text("NVRM: Xid (PCI:0000:18:00): 13, c\n")  # rotated (shorter): start over
    assert [parse_xid(r.text).xid for r in src.read_new()] == [13]  # type: ignore[union-attr]


def test_unreadable_sources_raise_kmsg_unavailable(tmp_path: Path) -> None:
    with pytest.raises(KmsgUnavailable, match="cannot read"):
        DevKmsg(str(tmp_path / "no-kmsg")).read_new()
    with pytest.raises(KmsgUnavailable):
        KmsgFile(tmp_path / "missing.log").read_new()


def test_in_memory_lines_are_returned_once_and_shared() -> None:
    lines = ["NVRM: Xid (PCI:0000:18:00): 79, x"]
    src = KmsgLines(lines)
    assert len(src.read_new()) == 1 and src.read_new() == []
    lines.append("NVRM: Xid (PCI:0000:18:00): 48, y")
    assert [parse_xid(r.text).xid for r in src.read_new()] == [48]  # type: ignore[union-attr]
