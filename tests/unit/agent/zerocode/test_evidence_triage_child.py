"""The zero-code triage child (issue 30): tenants' dumps are parsed in a child under the rank process's sandbox —
no capabilities, no_new_privs, address space and CPU time capped — and it still judges."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from gpuhealth.agent.zerocode.evidence import _CHILD, run_triage

FIXTURE = Path(__file__).parents[3] / "fixtures" / "flightrec" / "gloo_4rank_hang_skip"


def test_the_triage_child_still_names_the_hung_rank(tmp_path: Path) -> None:
    folder = tmp_path / "ev"
    shutil.copytree(FIXTURE, folder / "fr", ignore=shutil.ignore_patterns("*.pkl"))
    report, error = run_triage(folder, world_size=4, timeout_s=120)
    assert error == "" and report is not None
    assert report["verdict"] == "hang" and report["culprits"] == [3], report.get("summary")


def test_the_triage_child_is_sandboxed_before_it_reads_a_dump() -> None:
    """The same child code, with a command that only prints what the kernel says of the process."""
    probe = _CHILD.replace("runpy.run_module('gpuhealth.cli.main', run_name='__main__')",
                           "print(open('/proc/self/status').read()); print(open('/proc/self/limits').read())")
    out = subprocess.run([sys.executable, "-c", probe, str(512 << 20), "7"], capture_output=True, text=True,
                         check=True).stdout
    status = dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)
    assert status["NoNewPrivs"].strip() == "1"
    assert status["CapEff"].strip() == status["CapPrm"].strip() == "0000000000000000"
    limits = {line[:26].strip(): line[26:].split()[0] for line in out.splitlines() if line.startswith("Max ")}
    assert limits["Max address space"] == str(512 << 20)
    assert limits["Max cpu time"] == "7"
