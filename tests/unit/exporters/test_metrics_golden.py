"""Golden /metrics text for the real H200 recording (what users' dashboards and alerts see).

Host-dependent families (``gpuhealth_host_*``: this machine's kernel, load, memory) and the Python
version label are masked; everything else must match byte for byte. Regenerate after a deliberate
change with ``GPUHEALTH_UPDATE_GOLDEN=1 pytest tests/unit/exporters/test_metrics_golden.py`` and
review the diff like code.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import pytest
from exporter_testing import real_snapshot

from gpuhealth.exporters.prometheus import build_families, encode_text

GOLDEN = Path(__file__).parents[2] / "golden"


def _render(recording: Path, dcgm: bool) -> str:
    fams = build_families(real_snapshot(recording, node_name="gpu-node-7"), dcgm_compat=dcgm)
    text = encode_text(f for f in fams if not f.name.startswith("gpuhealth_host_")).decode()
    return text.replace(f'python_version="{platform.python_version()}"', 'python_version="X"')


@pytest.mark.parametrize(("name", "dcgm"), [("metrics_h200x2.txt", False), ("metrics_h200x2_dcgm.txt", True)])
def test_metrics_text_matches_golden(h200_recording: Path, name: str, dcgm: bool) -> None:
    text = _render(h200_recording, dcgm)
    assert _render(h200_recording, dcgm) == text  # deterministic
    path = GOLDEN / name
    if os.environ.get("GPUHEALTH_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    expected = path.read_text()
    if text != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "now", n=1))
        pytest.fail(f"/metrics differs from {path.name}:\n{diff[:6000]}")
    assert re.search(r'^gpuhealth_gpu_health\{gpu="0",[^}]*\} 0\.0$', text, re.M)
