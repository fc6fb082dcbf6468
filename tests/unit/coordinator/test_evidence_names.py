"""Job ids come from the network: the evidence folder named after one must stay inside the root."""

from __future__ import annotations

from pathlib import Path

from gpuhealth.coordinator.hangs import safe_name


def test_job_ids_never_escape_or_collide(tmp_path: Path) -> None:
    hostile = ["..", ".", "../../etc", "/abs/path", "a/../../b", "", "x" * 500, "job a", "job_a", "job.a"]
    names = [safe_name(j) for j in hostile]
    for n in names:
        assert "/" not in n and n not in (".", "..") and not n.startswith(".")
        assert (tmp_path / n).resolve().parent == tmp_path.resolve()
    assert len(set(names)) == len(names)  # "job a", "job_a", "job.a" stay apart
    assert safe_name("train-42").startswith("train-42-")  # still readable
