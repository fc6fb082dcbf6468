"""Periodic diagnostics beside the agent: budgeted child runs, never on a simulated backend."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import Config
from gpuhealth.diag.periodic import PeriodicDiagnostics
from gpuhealth.model import Finding

CHILD = """#!{python}
import json, sys
args = sys.argv[3:]
devs = args[args.index("--device") + 1].split(",")
uuids = {{"cuda:0": "GPU-00000000-1111-2222-3333-444444444440", "cuda:1": "GPU-00000001-1111-2222-3333-444444444441"}}
finding = {{"code": "sdc.mismatch", "severity": "critical", "entity": {{"kind": "gpu", "id": uuids["cuda:1"],
           "gpu_index": 1}}, "message": "bf16 square", "action": "drain", "evidence": {{}}, "source": "diag.sdc"}}
print(json.dumps({{"diag": args[0], "status": "ok", "reason": "", "gpu_seconds": {{uuids[d]: 3.0 for d in devs}},
                  "findings": [finding] if args[0] == "sdc" else [], "result": {{}}}}))
"""


class StubAgent:
    """What the extension seam offers: config, gpus, simulated."""

    def __init__(self, config: Config, simulated: bool = False) -> None:
        self.config = config
        self.simulated = simulated
        self.gpus = [GpuIdentity(0, "GPU-00000000-1111-2222-3333-444444444440", "NVIDIA H200", "00000000:00:06.0"),
                     GpuIdentity(1, "GPU-00000001-1111-2222-3333-444444444441", "NVIDIA H200", "00000000:00:07.0")]


def _setup(tmp_path: Path) -> tuple[Config, str]:
    child = tmp_path / "py"
    child.write_text(CHILD.format(python=sys.executable))
    child.chmod(0o755)
    cfg = Config()
    cfg.diag.enabled = True
    cfg.diag.interval_s = 3600
    cfg.diag.state_dir = str(tmp_path / "state")
    cfg.diag.golden_dir = str(tmp_path / "golden")
    cfg.diag.gpu_seconds_per_hour = 10.0
    return cfg, str(child)


def _backend() -> FakeNvml:
    b = FakeNvml.bundled()
    b.init()
    return b


def test_cycles_run_in_children_report_findings_and_respect_the_budget(tmp_path: Path) -> None:
    cfg, child = _setup(tmp_path)
    seen: list[list[Finding]] = []
    ext = PeriodicDiagnostics(python=child, backend_factory=_backend, on_findings=seen.append)
    agent = StubAgent(cfg)
    ext.run_cycle(agent, _backend())
    assert ext.latest()["sdc"].status == "ok" and ext.latest()["bandwidth"].status == "ok"
    assert [f.code for f in seen[-1]] == ["sdc.mismatch"]
    # 3 s (sdc) + 3 s (bandwidth) of the 10 s hourly budget are spent; sdc's next ~3 s still fit,
    # then bandwidth's do not
    ext.run_cycle(agent, _backend())
    assert ext.latest()["bandwidth"].status == "skipped" and "budget" in ext.latest()["bandwidth"].reason


def test_the_thread_runs_a_cycle_and_stops(tmp_path: Path) -> None:
    cfg, child = _setup(tmp_path)
    ext = PeriodicDiagnostics(python=child, backend_factory=_backend)
    ext.start(StubAgent(cfg))
    deadline = time.monotonic() + 30
    while ext.cycles == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    ext.stop()
    assert ext.cycles == 1 and ext.findings()[0].entity.gpu_index == 1


def test_never_on_a_simulated_backend_or_when_disabled(tmp_path: Path) -> None:
    cfg, child = _setup(tmp_path)
    ext = PeriodicDiagnostics(python=child, backend_factory=_backend)
    ext.start(StubAgent(cfg, simulated=True))
    assert ext._thread is None
    cfg.diag.enabled = False
    ext.start(StubAgent(cfg))
    assert ext._thread is None
    ext.stop()
