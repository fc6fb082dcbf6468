"""Pre-job node qualification: one collector sweep + diagnostics → one verdict per GPU and node.

Levels (the SDC shapes are the same at every level, so golden digests compare across levels):

- ``quick``    SDC (every datapath, one run), all_reduce + all_gather at 1 MiB, 64 MiB and 1 GiB, short
               bandwidth probes — all in ONE warm process per GPU (``diag/quick.py``: torch, CUDA
               contexts and the process group made once; SDC and device copies on every GPU at once,
               host copies one GPU at a time, then the collectives). Target: ≤ 10 s on an 8-GPU node.
- ``standard`` SDC with every case repeated twice, all six collectives up to 1 GiB, full bandwidth.
- ``full``     SDC repeated three times plus the fault-injection self-test, collectives up to 4 GiB.

A diagnostic that cannot run (simulated backend, no torch, no CUDA, busy or out-of-budget GPUs) is reported
as skipped with its reason, and the node is **not judged** (``unknown``) unless what did run already found it
unhealthy: a level is a promise of what was tested. Only a diagnostic that does not apply to the node (busbw on
one GPU) leaves the verdict to the rest. A GPU left out of a diagnostic is not judged either, and an SDC run whose
digests met no golden and no peer (one GPU, no golden: ``sdc.reference_of``) did not test for SDC. One that
fails or times out makes an otherwise healthy node ``unknown`` too: the check did not happen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhealth.config import Config
from gpuhealth.diag.runner import DiagOutcome, DiagRunner
from gpuhealth.model import (
    EntityKind,
    Finding,
    Health,
    Severity,
    could_not_check,
    health_of,
    takes_node_out,
    worst_action,
)
from gpuhealth.node import NodeReport

MiB = 1 << 20
LEVELS = ("quick", "standard", "full")


@dataclass(frozen=True, slots=True)
class Step:
    diag: str
    args: tuple[str, ...]
    min_gpus: int = 1
    label: str = ""


def plan(level: str, config: Config) -> list[Step]:
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; choose one of {', '.join(LEVELS)}")
    d = config.diag
    sdc_common = ("--node", config.node_name)
    busbw_common = ("--node", config.node_name, "--min-fraction", str(d.busbw_min_fraction),
                    "--judge-min-bytes", str(d.busbw_judge_min_bytes),
                    *(("--thresholds-file", d.busbw_thresholds_file) if d.busbw_thresholds_file else ()))
    bw_common = ("--hbm-fraction", str(d.bandwidth_hbm_fraction), "--pcie-fraction", str(d.bandwidth_pcie_fraction),
                 "--sysfs-root", config.collectors.sysfs_root)
    if level == "quick":
        # the same probes as the three separate children would run, in one warm process per GPU
        return [Step("quick", (*sdc_common, "--repeats", "1", "--min-fraction", str(d.busbw_min_fraction),
                               "--judge-min-bytes", str(d.busbw_judge_min_bytes),
                               *(("--thresholds-file", d.busbw_thresholds_file) if d.busbw_thresholds_file else ()),
                               "--collectives", "all_reduce,all_gather",
                               # 1 GiB: the plateau, judged even at rank counts without a curve of their own
                               "--sizes", f"{MiB},{64 * MiB},{1024 * MiB}", "--iters", "10",
                               "--hbm-fraction", str(d.bandwidth_hbm_fraction),
                               "--pcie-fraction", str(d.bandwidth_pcie_fraction),
                               "--sysfs-root", config.collectors.sysfs_root,
                               "--d2d-mib", "512", "--host-mib", "128", "--reps", "3"),
                     label="SDC, memory and bus bandwidth (one warm process per GPU)")]
    top = 1 << 30 if level == "standard" else 4 << 30
    return [
        Step("sdc", (*sdc_common, "--repeats", "2" if level == "standard" else "3",
                     *(("--selftest",) if level == "full" else ())), label="SDC matmul hashes"),
        Step("busbw", (*busbw_common, "--min-bytes", str(MiB), "--max-bytes", str(top)), 2, "NCCL bus bandwidth"),
        Step("bandwidth", bw_common, label="memory bandwidth"),
    ]


@dataclass(slots=True)
class GpuVerdict:
    index: int
    uuid: str
    name: str
    health: Health
    reasons: list[str]
    findings: list[Finding]

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name, "health": str(self.health),
                "action": str(worst_action(self.findings)), "reasons": self.reasons,
                "findings": [f.to_dict() for f in self.findings]}


@dataclass(slots=True)
class QualifyReport:
    node: str
    level: str
    health: Health
    reasons: list[str]
    gpus: list[GpuVerdict]
    node_findings: list[Finding]
    diagnostics: list[DiagOutcome]
    collectors: dict[str, Any]
    simulated: bool
    wall_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # quick: wall seconds per phase
    not_judged: list[str] = field(default_factory=list)  # what the level promised and did not test, in words

    @property
    def takes_node_out(self) -> bool:
        """A finding asks for a reset, reboot or drain (``model.takes_node_out``), whatever its severity."""
        return takes_node_out([*self.node_findings, *(f for g in self.gpus for f in g.findings)])

    @property
    def fit(self) -> bool:
        return self.health in (Health.HEALTHY, Health.DEGRADED) and not self.takes_node_out

    def to_dict(self) -> dict[str, Any]:
        all_findings = [*self.node_findings, *(f for g in self.gpus for f in g.findings)]
        return {
            "node": {"name": self.node, "level": self.level, "health": str(self.health), "fit": self.fit,
                     "judged": self.health is not Health.UNKNOWN, "not_judged": self.not_judged,
                     "action": str(worst_action(all_findings)), "reasons": self.reasons,
                     "simulated": self.simulated, "wall_s": round(self.wall_s, 2)},
            "gpus": [g.to_dict() for g in self.gpus],
            "findings": [f.to_dict() for f in self.node_findings],
            "diagnostics": [_diag_summary(d) for d in self.diagnostics],
            "collectors": self.collectors,
            **({"phases": self.phases} if self.phases else {}),
        }


def _diag_summary(d: DiagOutcome) -> dict[str, Any]:
    out = d.to_dict()
    out.pop("findings")  # they are listed under their GPU / the node
    return out


def _reason(f: Finding) -> str:
    return f"{f.code}: {f.message}"


def verdict(report: NodeReport, diagnostics: Sequence[DiagOutcome], level: str, wall_s: float = 0.0
            ) -> QualifyReport:
    """Pure: merge the collector report with the diagnostics' findings and judge."""
    gpu_findings: dict[int, list[Finding]] = {g.identity.index: list(g.findings) for g in report.gpus}
    by_uuid = {g.identity.uuid: g.identity.index for g in report.gpus}
    node_findings = list(report.findings)
    reasons: list[str] = []
    unchecked = False
    not_judged: list[str] = []  # what the level promised and did not test
    gpus_left_out: dict[int, list[str]] = {}
    for d in diagnostics:
        for f in d.findings:
            idx = f.entity.gpu_index if f.entity.kind is EntityKind.GPU else None
            if f.entity.kind is EntityKind.GPU and f.entity.id in by_uuid:
                idx = by_uuid[f.entity.id]
            if idx is not None and idx in gpu_findings:
                gpu_findings[idx].append(f)
            else:
                node_findings.append(f)
        if d.status == "skipped":
            reasons.append(f"{d.diag} skipped: {d.reason}")
            if not _not_applicable(d, len(report.gpus)):
                not_judged.append(f"{d.diag} did not run: {d.reason}")
        elif d.status in ("failed", "timeout"):
            unchecked = True
            reasons.append(f"{d.diag} {d.status}: {d.reason}")
        elif d.diag == "sdc" and _not_cross_checked(d):
            not_judged.append(f"sdc compared {d.result['reference'].get('compared', 'nothing outside the GPU')}: no "
                              "golden digests and no peer GPU confirmed the results")
        for uuid, why in sorted(d.skipped_gpus.items()):
            if d.status != "skipped":
                reasons.append(f"{d.diag} left out GPU {by_uuid.get(uuid, uuid)}: {why}")
                if uuid in by_uuid:
                    gpus_left_out.setdefault(by_uuid[uuid], []).append(f"{d.diag} left it out: {why}")
    gpus: list[GpuVerdict] = []
    for rep in report.gpus:
        fs = sorted(gpu_findings[rep.identity.index], key=lambda f: (-int(f.severity), f.code))
        gpu_health = health_of(fs)
        left_out = gpus_left_out.get(rep.identity.index, [])
        if (left_out or not_judged) and gpu_health is not Health.UNHEALTHY:
            gpu_health = Health.UNKNOWN  # a GPU the level did not test (this one, or every one) is not qualified
        notes = [f"not judged: {why}" for why in left_out]
        if not left_out and gpu_health is Health.UNKNOWN and not_judged:
            notes.append("not judged: the level's diagnostics did not all run (the node's reasons say which)")
        gpus.append(GpuVerdict(rep.identity.index, rep.identity.uuid, rep.identity.name, gpu_health,
                               [_reason(f) for f in fs if f.severity >= Severity.WARNING] + notes, fs))
    everything = [*node_findings, *(f for g in gpus for f in g.findings)]
    health = health_of(everything)
    if not report.gpus and not everything:
        health = Health.UNKNOWN
        reasons.insert(0, "no GPU found")
    if (unchecked or could_not_check(everything)) and health is not Health.UNHEALTHY:
        health = Health.UNKNOWN  # a diagnostic, or a check asked for (a named kernel log), could not be made
    not_judged += [f"GPU {i}: {why}" for i, whys in sorted(gpus_left_out.items()) for why in whys]
    if not_judged and health is not Health.UNHEALTHY:
        health = Health.UNKNOWN  # the level's diagnostics did not all run: the collectors alone are not this level
    failed_collectors = [r.name for r in report.runs if not r.success]
    if failed_collectors:
        reasons.append(f"collectors that failed: {', '.join(failed_collectors)}")
    reasons[0:0] = [_reason(f) for f in sorted(node_findings, key=lambda f: -int(f.severity))
                    if f.severity >= Severity.WARNING]
    for v in gpus:
        reasons.extend(f"GPU {v.index}: {r}" for r in v.reasons)
    collectors = {"health": str(report.health), "backend": report.backend,
                  "runs": [r.summary() for r in report.runs]}
    return QualifyReport(report.node, level, health, reasons, gpus, node_findings, list(diagnostics), collectors,
                         report.simulated, wall_s, not_judged=not_judged)


def _not_applicable(d: DiagOutcome, gpu_count: int) -> bool:
    """A diagnostic skipped because it has nothing to measure on this node (no verdict withheld): bus bandwidth on
    a node of one GPU."""
    return d.diag == "busbw" and gpu_count < 2


def _not_cross_checked(d: DiagOutcome) -> bool:
    """An SDC run whose digests met no golden and no peer (``sdc.reference_of``)."""
    reference = d.result.get("reference")
    return isinstance(reference, dict) and reference.get("cross_checked") is False


QUICK_PARTS = ("sdc", "busbw", "bandwidth")


def split_quick(outcome: DiagOutcome) -> tuple[list[DiagOutcome], dict[str, float]]:
    """The quick run's one outcome → the three diagnostics' outcomes (as their own children would
    have reported them) and the wall seconds of each phase."""
    if outcome.status != "ok":
        return [DiagOutcome(name, outcome.status, outcome.reason, skipped_gpus=dict(outcome.skipped_gpus),
                            gpus=list(outcome.gpus), wall_s=outcome.wall_s) for name in QUICK_PARTS], {}
    out = []
    for name in QUICK_PARTS:
        doc = outcome.result.get(name) or {}
        findings = []
        for f in doc.get("findings") or []:
            try:
                findings.append(Finding.from_dict(f))
            except (KeyError, ValueError):
                continue
        out.append(DiagOutcome(name, str(doc.get("status", "failed")), str(doc.get("reason", "no result")),
                               findings, dict(doc.get("result") or {}),
                               {str(k): float(v) for k, v in (doc.get("gpu_seconds") or {}).items()},
                               skipped_gpus=dict(outcome.skipped_gpus), gpus=list(outcome.gpus),
                               wall_s=outcome.wall_s))
    phases = outcome.result.get("phases") or {}
    return out, {str(k): float(v) for k, v in phases.items() if isinstance(v, (int, float))}


def default_state_dir(config: Config) -> Path:
    """Where budgets and locks live: configured, else under the agent's state dir, else the user cache."""
    if config.diag.state_dir:
        return Path(config.diag.state_dir)
    preferred = Path(config.agent.state_dir) / "diag"
    probe = preferred if preferred.exists() else preferred.parent
    if probe.exists() and os.access(probe, os.W_OK):
        return preferred
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpuhealth" / "diag"


def default_golden_dir(config: Config) -> Path:
    """The golden store by its one rule (``diag/golden_place.py``), the old places merged in."""
    from gpuhealth.diag.golden_place import resolve_golden_dir

    return resolve_golden_dir(config).path


def run_qualify(
    report: NodeReport,
    config: Config,
    level: str,
    runner: DiagRunner,
    *,
    force: bool = False,
    progress: Callable[[str, str], None] | None = None,
    t0: float | None = None,
) -> QualifyReport:
    """Run the level's diagnostics on the report's GPUs (each in a child process) and judge."""
    start = time.monotonic() if t0 is None else t0
    outcomes: list[DiagOutcome] = []
    phases: dict[str, float] = {}
    gpus = [g.identity for g in report.gpus]
    golden = str(default_golden_dir(config))
    for step in plan(level, config):
        if progress:
            progress(step.diag, f"{step.label or step.diag}…")
        if report.simulated:
            outcome = DiagOutcome(step.diag, "skipped", "simulated backend (a recording): no real GPU to test")
        elif len(gpus) < step.min_gpus:
            outcome = DiagOutcome(step.diag, "skipped", f"needs {step.min_gpus} GPUs, the node has {len(gpus)}")
        else:
            args = list(step.args)
            if step.diag in ("sdc", "quick"):
                args += ["--golden-dir", golden]
            outcome = runner.run(step.diag, args, gpus=gpus, force=force, timeout_s=config.diag.timeout_s,
                                 min_gpus=step.min_gpus, enforce_budget=False)
        if step.diag == "quick":
            parts, phases = split_quick(outcome)
            outcomes.extend(parts)
        else:
            outcomes.append(outcome)
        if progress:
            progress(step.diag, f"{step.label or step.diag}: {outcome.status}")
    result = verdict(report, outcomes, level, time.monotonic() - start)
    result.phases = phases
    return result


__all__ = ["LEVELS", "GpuVerdict", "QualifyReport", "Step", "default_golden_dir", "default_state_dir", "plan",
           "run_qualify", "split_quick", "verdict"]
