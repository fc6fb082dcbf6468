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


def test_no_served_dcgm_field_is_listed_as_not_provided() -> None:
    """docs/metrics.md once listed DCGM_FI_PROF_PCIE_TX/RX_BYTES in its mapping table and as "not provided"."""
    import re

    doc = (ROOT / "docs" / "metrics.md").read_text()
    [not_provided] = re.findall(r"^Not provided.*?(?:\n\n|\Z)", doc, re.M | re.S)
    import itertools

    named: set[str] = set()
    for token in re.findall(r"DCGM_[A-Z0-9_/]+", not_provided):  # PCIE_TX/RX_BYTES: both names
        named |= {"_".join(p) for p in itertools.product(*(part.split("/") for part in token.split("_")))}
    served = {f.name for f in FIELDS}
    assert named and not named & served, sorted(named & served)
    for name in served:
        assert f"| `{name}" in doc, f"{name} has no row in the mapping table"
