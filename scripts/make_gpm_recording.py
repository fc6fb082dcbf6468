"""Build tests/fixtures/recordings/h200x2_gpm.json: the recorded 2 x H200 (VM guest, 2026-11-28) with the GPM
readings in the form ``gpuhealth record`` writes today, so replays reach the profiling series (dashboard 12239's
Tensor Core panel) without a GPU.

What is measured and what is not (also written into the file, key ``synthesized``):
- GPU 0: the GPM ratios and PCIe rates NVML measured on that machine (idle GPUs), which the recorder of the time
  stored as a Python repr; parsed back into the dict the recorder writes now. NVLink rates: 0 (synthesized; that
  recorder did not ask GPM for them; the GPUs were idle).
- GPU 1: synthesized "under load" GPM readings (not measured), so ratios and rates are non-zero and their units
  can be checked.
- Both: ``GridLicensableFeatures`` synthesized as a GPU without vGPU licensing answers (not measured).

Run: python scripts/make_gpm_recording.py (rewrites the fixture; deterministic).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "fixtures" / "recordings" / "h200x2_vm_guest.json"
TARGET = ROOT / "tests" / "fixtures" / "recordings" / "h200x2_gpm.json"
UNDER_LOAD = {"SM_UTIL": 91.5, "SM_OCCUPANCY": 47.5, "ANY_TENSOR_UTIL": 63.0, "DRAM_BW_UTIL": 71.0,
              "GRAPHICS_UTIL": 98.0, "PCIE_TX_PER_SEC": 2048.0, "PCIE_RX_PER_SEC": 512.5,
              "NVLINK_TOTAL_TX_PER_SEC": 40960.0, "NVLINK_TOTAL_RX_PER_SEC": 40448.0}
NO_VGPU_LICENSING = {"isGridLicenseSupported": 0, "licensableFeaturesCount": 0, "gridLicensableFeatures": []}
NOTE = ("Synthesized from tests/fixtures/recordings/h200x2_vm_guest.json by scripts/make_gpm_recording.py, not "
        "recorded as a whole: GPU 0's GpmMetrics are that recording's measured values (idle), its NVLink rates 0; "
        "GPU 1's GpmMetrics are synthesized under-load values; GridLicensableFeatures is synthesized on both.")


def build() -> dict:
    rec = json.loads(SOURCE.read_text())
    rec["synthesized"] = NOTE
    for i, dev in enumerate(rec["devices"]):
        entry = dev["GpmMetrics"]
        if i == 0:
            measured = entry["value"]
            measured = ast.literal_eval(measured) if isinstance(measured, str) else dict(measured)
            measured.update(NVLINK_TOTAL_TX_PER_SEC=0.0, NVLINK_TOTAL_RX_PER_SEC=0.0)
            dev["GpmMetrics"] = {"value": measured, "median_us": entry.get("median_us")}
        else:
            dev["GpmMetrics"] = {"value": dict(UNDER_LOAD), "median_us": entry.get("median_us")}
        dev["GridLicensableFeatures"] = {"value": dict(NO_VGPU_LICENSING), "median_us": 1.0}
    return rec


if __name__ == "__main__":
    TARGET.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {TARGET.relative_to(ROOT)}")
