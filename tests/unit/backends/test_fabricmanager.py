"""Is nv-fabricmanager running, read from /proc — and "unknown" where /proc hides other users' processes.

An unprivileged agent (the systemd unit's DynamicUser) under /proc mounted hidepid=1/2 (noaccess/invisible)
sees only its own processes: root's nv-fabricmanager is invisible, so "not found" must not read as "stopped"
(audit 2026-11-28, item 5: it drained healthy bare-metal HGX nodes).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuhealth.backends import errors
from gpuhealth.backends.environment import Environment
from gpuhealth.backends.errors import NvmlError
from gpuhealth.backends.fabricmanager import RUNNING, STOPPED, fabric_manager_state
from gpuhealth.backends.nvml_fake import FakeNvml
from gpuhealth.collectors.base import CollectContext, History
from gpuhealth.collectors.nvlink import NvlinkCollector
from gpuhealth.collectors.runner import CollectorRunner, enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.model import Action, Severity

BARE_METAL_HGX = Environment(virtualization="none", container=False, host_pid_namespace=True,
                             host_network_namespace=True, nvswitches_visible=4)


def _process(proc: Path, pid: int, comm: str, argv0: str) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "comm").write_text(comm + "\n")
    (proc / str(pid) / "cmdline").write_bytes(argv0.encode() + b"\0")


def _own_process_only(proc: Path) -> Path:
    """/proc as hidepid=2 (invisible) shows it to an unprivileged reader: its own process, no PID 1."""
    _process(proc, 4242, "gpuhealth", "/usr/bin/python3")
    return proc


def test_a_full_proc_without_the_manager_is_stopped(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 1, "systemd", "/sbin/init")
    _process(proc, 4242, "gpuhealth", "/usr/bin/python3")
    assert fabric_manager_state(proc) == STOPPED
    _process(proc, 977, "nv-fabricmanage", "/usr/bin/nv-fabricmanager")
    assert fabric_manager_state(proc) == RUNNING


def test_hidepid_invisible_is_unknown_not_stopped(tmp_path: Path) -> None:
    assert fabric_manager_state(_own_process_only(tmp_path / "proc")) is None


def test_hidepid_noaccess_is_unknown_not_stopped(tmp_path: Path) -> None:
    # hidepid=1: every PID is listed but other users' entries cannot be read (EACCES on their files; here the
    # files are absent, which reads the same: an OSError), PID 1's included.
    proc = _own_process_only(tmp_path / "proc")
    for pid in (1, 2, 977):
        (proc / str(pid)).mkdir()
    assert fabric_manager_state(proc) is None


def test_the_manager_seen_under_hidepid_is_still_running(tmp_path: Path) -> None:
    proc = _own_process_only(tmp_path / "proc")
    _process(proc, 977, "nv-fabricmanage", "/usr/bin/nv-fabricmanager")  # an agent that runs as its user
    assert fabric_manager_state(proc) == RUNNING


class _LiveHost:
    """The recording's GPUs as a live driver answers them: not simulated, and NVML says nothing about the
    Fabric Manager, so the collector reads this host's /proc (under ``collectors.sysfs_root``)."""

    def __init__(self, fake: FakeNvml) -> None:
        self.fake = fake

    simulated = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)

    def system(self, key: str) -> Any:
        if key == "fabric_manager":
            raise NvmlError(errors.NOT_SUPPORTED, "not an NVML reading")
        return self.fake.system(key)


def _fabric_manager_findings(root: Path) -> list[Any]:
    fake = FakeNvml.bundled("nvml_h200x2.json")
    fake.init()
    backend = _LiveHost(fake)
    config = Config()
    config.collectors.sysfs_root = str(root)
    ctx = CollectContext(backend=backend, config=config, gpus=enumerate_gpus(backend), node_name="n1",
                         now=time.time(), environment=BARE_METAL_HGX)
    run = CollectorRunner(timeout_s=None).run(NvlinkCollector(None), ctx, History())
    assert run.success, run.error
    return [f for f in run.findings if f.code.startswith("fabric.manager")]


def test_an_unprivileged_agent_under_hidepid_never_drains_for_the_manager(tmp_path: Path) -> None:
    _own_process_only(tmp_path / "proc")
    [f] = _fabric_manager_findings(tmp_path)
    assert (f.code, f.severity, f.action) == ("fabric.manager_unobserved", Severity.INFO, Action.NONE)
    assert "hidepid" in f.evidence["reason"] and f.evidence["fabric_manager_seen"] is None


def test_bare_metal_with_a_full_proc_and_no_manager_still_drains(tmp_path: Path) -> None:
    proc = _own_process_only(tmp_path / "proc")
    _process(proc, 1, "systemd", "/sbin/init")
    [f] = _fabric_manager_findings(tmp_path)
    assert (f.code, f.severity, f.action) == ("fabric.manager_down", Severity.CRITICAL, Action.DRAIN)
