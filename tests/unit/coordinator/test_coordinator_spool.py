"""The agent's disk spool: seqs survive restarts, acks remove, bounds drop oldest steps first."""

from __future__ import annotations

from pathlib import Path

from gpuhealth.agent.spool import Spool


def test_seq_and_unacked_records_survive_a_restart(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "s.db")
    inc = sp.incarnation
    for i in range(5):
        assert sp.append("steps", 1.0, lambda seq, i=i: f"{seq}:{i}".encode()) == i + 1
    assert sp.ack(3) == 3
    sp.close()
    sp = Spool(tmp_path / "s.db")
    assert sp.incarnation == inc and sp.acked == 3
    assert sp.pending(0, 10) == [(4, b"4:3"), (5, b"5:4")]
    assert sp.append("steps", 1.0, lambda seq: b"x") == 6  # never reuses a seq
    assert sp.ack(2) == 0  # an old ack changes nothing


def test_bounds_drop_oldest_steps_and_findings_supersede(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "s.db", max_records=4)
    sp.append("findings", 1.0, lambda seq: b"f-old")
    sp.append("ranks", 1.0, lambda seq: b"ranks")
    for _ in range(4):
        sp.append("steps", 1.0, lambda seq: b"s%d" % seq)
    sp.append("findings", 1.0, lambda seq: b"f-new")  # replaces f-old
    kept = [p for _, p in sp.pending(0, 100)]
    assert kept == [b"ranks", b"s5", b"s6", b"f-new"]
    st = sp.stats()
    assert (st.depth, st.dropped) == (4, 2)
