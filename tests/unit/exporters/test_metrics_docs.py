"""docs/metrics.md lists every metric the agent exposes (a new or renamed metric must be documented)."""

from __future__ import annotations

from pathlib import Path

from exporter_testing import real_snapshot

from gpuhealth.exporters.dcgm import FIELDS
from gpuhealth.exporters.prometheus import build_families

ROOT = Path(__file__).parents[3]


def test_every_exposed_metric_is_documented() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    snap = real_snapshot(ROOT / "tests" / "fixtures" / "scenarios" / "agent_faulty_node.yaml")
    names = {f.sample_name for f in build_families(snap, dcgm_compat=True) if f.series}
    names |= {f.name for f in FIELDS}
    missing = sorted(n for n in names if f"`{n}" not in doc)
    assert not missing, f"not in docs/metrics.md: {missing}"
