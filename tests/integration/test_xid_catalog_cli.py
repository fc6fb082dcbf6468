"""NVIDIA's XID catalog through the shipped command: ``gpuhealth status --kmsg FILE --json`` on a kernel log
holding an XID no catalog edition knows and NVLink XIDs 145 (NVLink5), judged as their lines say."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from commands import CLI

UNKNOWN = ("Dec 08 01:02:03 node7 kernel: NVRM: Xid (PCI:0000:00:06): 250, pid=77, name=train, "
           "A future driver's error gpuhealth has never heard of")
RLW = "Dec 08 01:02:0{s} node7 kernel: NVRM: Xid (PCI:0000:00:07): 145, RLW_REMAP {word} XC0 i0 Link {link} " \
      "(0x00000004 0x{status:08x} 0x00000000 0x00000000 0x00000000 0x00000000)"


def _status(tmp_path: Path, lines: list[str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    log = tmp_path / "kern.log"
    log.write_text("\n".join(lines) + "\n")
    config = tmp_path / "gpuhealth.yaml"
    config.write_text("agent: {node_name: node7, state_dir: %s}\ncollectors: {disabled: [host]}\n" % (tmp_path / "s"))
    out = subprocess.run([*CLI, "status", "--json", "--config", str(config), "--nvml-snapshot", "nvml_h200x2.json",
                          "--kmsg", str(log)], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def _xids(doc: dict) -> dict[str, dict]:  # type: ignore[type-arg]
    return {f["code"]: f for g in doc["gpus"] for f in g["findings"] if f["code"].startswith("xid.")}


def test_unknown_xid_is_a_warning_with_the_kernel_line_and_nvlink_145_is_decoded(tmp_path: Path) -> None:
    rc, doc = _status(tmp_path, [UNKNOWN, RLW.format(s=4, word="Nonfatal", link="03", status=0x100),
                                 RLW.format(s=5, word="Fatal", link="05", status=0x40),
                                 RLW.format(s=6, word="Nonfatal", link="03", status=0x100)])
    found = _xids(doc)
    unknown = found["xid.250"]
    assert (unknown["severity"], unknown["action"], unknown["entity"]["gpu_index"]) == ("warning", "monitor", 0)
    assert unknown["evidence"]["raw"] == UNKNOWN and unknown["evidence"]["known"] is False
    assert UNKNOWN in unknown["message"] and "not in NVIDIA's Xid catalog" in unknown["message"]
    nvlink = found["xid.145"]  # the fatal RLW_REMAP on link 5 is kept over the harmless ones around it
    assert (nvlink["severity"], nvlink["action"], nvlink["entity"]["gpu_index"]) == ("critical", "reset_gpu", 1)
    decoded = nvlink["evidence"]["nvlink"]
    assert (decoded["unit"], decoded["link"], decoded["error_status"]) == ("RLW_REMAP", 5, "0x00000040")
    assert (decoded["nvidia_severity"], decoded["resolution"], decoded["documented"]) == ("Fatal", "RESET_GPU", True)
    assert nvlink["evidence"]["mnemonic"] == "NVLINK_RLW_ERROR" and "Link 05" in nvlink["evidence"]["raw"]
    assert rc == 2 and doc["node"]["health"] == "unhealthy"


def test_a_harmless_nvlink_145_alone_leaves_the_gpu_healthy(tmp_path: Path) -> None:
    rc, doc = _status(tmp_path, [RLW.format(s=4, word="Nonfatal", link="03", status=0x100)])
    nvlink = _xids(doc)["xid.145"]
    assert (nvlink["severity"], nvlink["action"]) == ("info", "none")
    assert nvlink["evidence"]["nvlink"]["investigatory"] == "IGNORE" and "link 3" in nvlink["message"]
    assert rc == 0 and doc["gpus"][1]["health"] == "healthy"
