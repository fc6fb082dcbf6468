"""Diagnostics on demand: ``gpuhealth diag`` (a person asked) and the coordinator's ``RunDiagnostic``
(through an agent) run the same child with the same arguments, through ``DiagRunner`` as periodic
diagnostics do: per-GPU locks, the GPU-time budget, GPUs with user processes left out. Torch-free:
the agent calls this in its own process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpuhealth.backends.errors import BackendUnavailable, NvmlError
from gpuhealth.collectors.base import GpuIdentity
from gpuhealth.config import Config
from gpuhealth.diag.qualify import default_golden_dir, default_state_dir
from gpuhealth.diag.runner import DiagOutcome, DiagRunner

DIAGNOSTICS = ("sdc", "busbw", "bandwidth")
MIN_GPUS = {"busbw": 2}  # a collective needs two ranks


class DiagRequestError(Exception):
    """The run cannot start here: no driver, a malformed device, a GPU the node does not have."""


def sdc_args(config: Config, *, cpu: bool, golden_dir: str | None = None, repeats: int = 1, selftest: bool = False,
             record_golden: bool = False, peers: int = 1) -> list[str]:
    args = ["--golden-dir", golden_dir or str(default_golden_dir(config)), "--repeats", str(repeats),
            "--node", config.node_name]
    if selftest:
        args.append("--selftest")
    if record_golden:
        args.append("--record-golden")
    if cpu:
        args += ["--cpu-peers", str(peers)]
    return args


def busbw_args(config: Config, *, cpu: bool, collectives: str | None = None, min_bytes: int = 1 << 20,
               max_bytes: int = 1 << 30, ranks: int = 2) -> list[str]:
    d = config.diag
    args = ["--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes), "--node", config.node_name,
            "--min-fraction", str(d.busbw_min_fraction), "--judge-min-bytes", str(d.busbw_judge_min_bytes)]
    if d.busbw_thresholds_file:
        args += ["--thresholds-file", d.busbw_thresholds_file]
    if collectives:
        args += ["--collectives", collectives]
    if cpu:
        args += ["--world", str(ranks)]
    return args


def bandwidth_args(config: Config, *, cpu: bool) -> list[str]:
    d = config.diag
    args = ["--hbm-fraction", str(d.bandwidth_hbm_fraction), "--pcie-fraction", str(d.bandwidth_pcie_fraction),
            "--sysfs-root", config.collectors.sysfs_root]
    if cpu:
        args += ["--d2d-mib", "256"]
    return args


def default_args(diag: str, config: Config, *, cpu: bool) -> list[str]:
    """What ``gpuhealth diag NAME`` runs without options (and what a remote request runs)."""
    if diag == "sdc":
        return sdc_args(config, cpu=cpu)
    if diag == "busbw":
        return busbw_args(config, cpu=cpu)
    if diag == "bandwidth":
        return bandwidth_args(config, cpu=cpu)
    raise DiagRequestError(f"unknown diagnostic {diag!r} (known: {', '.join(DIAGNOSTICS)})")


def run_on_demand(diag: str, args: Sequence[str], config: Config, *, device: str = "cuda", force: bool = False,
                  budgeted: bool = False, timeout_s: float | None = None) -> DiagOutcome:
    """Run ``diag`` now on ``device`` (``cpu``, ``cuda`` = every GPU, ``cuda:N[,cuda:M]``).

    ``budgeted`` (an automated request): the GPU-time budget may refuse GPUs and ``force`` is
    ignored; otherwise (a person asked) the run is charged but never refused by the budget.
    Raises ``DiagRequestError`` when the run cannot start at all."""
    timeout = config.diag.timeout_s if timeout_s is None else timeout_s
    if device == "cpu":
        runner = DiagRunner(config.diag, state_dir=default_state_dir(config))
        return runner.run(diag, [*args, "--device", "cpu"], gpus=None, timeout_s=timeout)
    backend, gpus = _live_gpus(device)
    try:
        runner = DiagRunner(config.diag, state_dir=default_state_dir(config), backend=backend)
        return runner.run(diag, args, gpus=gpus, force=force and not budgeted, timeout_s=timeout,
                          min_gpus=MIN_GPUS.get(diag, 1), enforce_budget=budgeted)
    finally:
        backend.shutdown()


def _live_gpus(device: str) -> tuple[Any, list[GpuIdentity]]:
    """The live NVML backend and the GPUs a CUDA device spec names."""
    from gpuhealth.collectors.runner import enumerate_gpus
    from gpuhealth.node import open_backend

    wanted: set[int] = set()
    if device != "cuda":
        for part in device.split(","):
            if not part.startswith("cuda:") or not part[5:].isdigit():
                raise DiagRequestError(f"bad --device {part!r}: expected cpu, cuda or cuda:N[,cuda:M]")
            wanted.add(int(part[5:]))
    try:
        backend = open_backend(None)
    except (BackendUnavailable, NvmlError) as exc:
        raise DiagRequestError(f"{exc} — no GPU here (use --device cpu to exercise the logic on the CPU)") from exc
    try:
        gpus = enumerate_gpus(backend)
    except NvmlError as exc:
        backend.shutdown()
        raise DiagRequestError(f"NVML cannot list the GPUs: {exc.message}") from exc
    if wanted:
        missing = wanted - {g.index for g in gpus}
        if missing:
            backend.shutdown()
            raise DiagRequestError(f"no GPU {sorted(missing)} on this node ({len(gpus)} GPUs)")
        gpus = [g for g in gpus if g.index in wanted]
    return backend, gpus


__all__ = ["DIAGNOSTICS", "DiagRequestError", "bandwidth_args", "busbw_args", "default_args", "run_on_demand",
           "sdc_args"]
