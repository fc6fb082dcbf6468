"""The Slurm prolog, epilog and health check, run for real by bash with a stub ``scontrol`` on
PATH that records every call and keeps node state like slurmctld does (drain sets State and
Reason, resume clears them), and a stub ``gpuhealth`` whose verdict each test chooses."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SLURM = REPO / "deploy" / "slurm"
NODE = "gpu-node-07"

SCONTROL_STUB = """#!{python}
import json, os, sys
state_file = os.environ["STUB_STATE"]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(["scontrol", *sys.argv[1:]]) + "\\n")
state = json.load(open(state_file))
args = sys.argv[1:]
if args[:2] == ["show", "node"]:
    if state.get("fail_show"):
        sys.exit(1)
    print(f"NodeName={{args[2]}} Arch=x86_64 CoresPerSocket=32")
    print(f"   CPUAlloc=0 CPUEfctv=64 CPUTot=64 CPULoad=0.01")
    print(f"   State={{state['state']}} ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A")
    if state.get("reason"):
        print(f"   Reason={{state['reason']}} [root@2026-11-26T01:00:00]")
    sys.exit(0)
if args and args[0] == "update":
    kv = dict(a.split("=", 1) for a in args[1:])
    if kv.get("state") == "drain":
        base = state["state"].split("+")[0]
        state["state"] = base + "+DRAIN"
        state["reason"] = kv.get("reason", "")
    elif kv.get("state") == "resume":
        state["state"] = state["state"].split("+")[0]
        state["reason"] = ""
    json.dump(state, open(state_file, "w"))
    sys.exit(0)
sys.exit(2)
"""

GPUHEALTH_STUB = """#!/bin/bash
printf '%s\\n' "$(printf '%s\\x1f' gpuhealth "$@")" >> "$STUB_LOG"
[ -n "${STUB_GH_JSON:-}" ] && cat "$STUB_GH_JSON"
[ -n "${STUB_GH_SLEEP:-}" ] && sleep "$STUB_GH_SLEEP"
exit "${STUB_GH_RC:-0}"
"""

NVIDIA_SMI_STUB = """#!/bin/bash
echo "0, GPU-aaaaaaaa-0000-0000-0000-000000000000"
echo "1, GPU-bbbbbbbb-0000-0000-0000-000000000000"
echo "2, GPU-cccccccc-0000-0000-0000-000000000000"
"""

REPORT_XID = {
    "node": NODE,
    "verdict": "not_fit",
    "gpus": [{"index": 0, "findings": [
        {"code": "xid.79", "severity": "critical", "message": "GPU has fallen off the bus"},
        {"code": "thermal.gpu_temp", "severity": "info", "message": "warm"},
    ]}],
    "findings": [{"code": "ecc.dbe_volatile", "severity": "critical"}],
}


@dataclass
class Slurm:
    root: Path
    env: dict[str, str]

    def set_node(self, state: str, reason: str = "", fail_show: bool = False) -> None:
        (self.root / "state.json").write_text(json.dumps({"state": state, "reason": reason, "fail_show": fail_show}))

    def node(self) -> dict[str, str]:
        data: dict[str, str] = json.loads((self.root / "state.json").read_text())
        return data

    def verdict(self, rc: int, report: dict[str, object] | None = None) -> None:
        self.env["STUB_GH_RC"] = str(rc)
        if report is None:
            self.env.pop("STUB_GH_JSON", None)
        else:
            path = self.root / "report.json"
            path.write_text(json.dumps(report))
            self.env["STUB_GH_JSON"] = str(path)

    def calls(self) -> list[list[str]]:
        log = self.root / "calls.log"
        if not log.exists():
            return []
        out: list[list[str]] = []
        for line in log.read_text().splitlines():
            out.append(json.loads(line) if line.startswith("[") else line.rstrip("\x1f").split("\x1f"))
        return out

    def scontrol_updates(self) -> list[list[str]]:
        return [c[1:] for c in self.calls() if c[0] == "scontrol" and c[1] == "update"]

    def gpuhealth_calls(self) -> list[list[str]]:
        return [c[1:] for c in self.calls() if c[0] == "gpuhealth"]

    def run(self, script: str, **extra: str) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **extra}
        return subprocess.run(["bash", str(SLURM / script)], env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def slurm(tmp_path: Path) -> Slurm:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL_STUB.format(python=sys.executable)), ("gpuhealth", GPUHEALTH_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STUB_LOG": str(tmp_path / "calls.log"),
        "STUB_STATE": str(tmp_path / "state.json"),
        "SLURMD_NODENAME": NODE,
        "GPUHEALTH_SLURM_ENV": str(tmp_path / "absent.env"),
        "GPUHEALTH_SLURM_JOB_DIR": str(tmp_path / "jobs"),
        "GPUHEALTH_SCREEN_BLOCK_DIR": str(tmp_path / "screen-block"),
        "GPUHEALTH_DIAG_LOCK_DIR": str(tmp_path / "diag-locks"),
        "GPUHEALTH_AGENT_URL": "",  # the stub gpuhealth is the agent here: no screen to ask for
        "GPUHEALTH_CONFIG": str(tmp_path / "absent-agent.yaml"),  # the calls below do not depend on this host's /etc
        "TMPDIR": str(tmp_path),
        "NVIDIA_SMI": "nvidia-smi-not-installed",
    }
    s = Slurm(tmp_path, env)
    s.set_node("IDLE")
    s.verdict(0)
    return s


def _reason(update: list[str]) -> str:
    return dict(a.split("=", 1) for a in update[1:] if "=" in a).get("reason", "")


# --- prolog ------------------------------------------------------------------------------------

def test_prolog_fit_node_runs_quick_qualify_and_writes_the_gpu_job_map(slurm: Slurm) -> None:
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="1234", SLURM_JOB_GPUS="0,2")
    assert result.returncode == 0, result.stderr
    # first what the running agent knows (status asks it), then the quick qualification
    assert slurm.gpuhealth_calls() == [["status", "--exit-codes", "slurm", "--json"],
                                       ["qualify", "--level", "quick", "--exit-codes", "slurm", "--json"]]
    assert slurm.scontrol_updates() == []
    jobs = slurm.root / "jobs"
    assert sorted(p.name for p in jobs.iterdir()) == ["0", "2"]
    assert (jobs / "0").read_text() == "1234\n"


def test_prolog_names_map_files_by_uuid_when_nvidia_smi_answers(slurm: Slurm) -> None:
    smi = slurm.root / "bin" / "nvidia-smi"
    smi.write_text(NVIDIA_SMI_STUB)
    smi.chmod(0o755)
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="77", SLURM_JOB_GPUS="1", NVIDIA_SMI="nvidia-smi")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (slurm.root / "jobs").iterdir()] == ["GPU-bbbbbbbb-0000-0000-0000-000000000000"]


def test_prolog_not_fit_drains_with_finding_codes_and_fails_the_job_start(slurm: Slurm) -> None:
    slurm.verdict(1, REPORT_XID)
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="1234", SLURM_JOB_GPUS="0")
    assert result.returncode == 1
    (update,) = slurm.scontrol_updates()
    assert update[:3] == ["update", f"nodename={NODE}", "state=drain"]
    assert _reason(update) == "gpuhealth: xid.79,ecc.dbe_volatile"  # info findings are not reasons
    assert not (slurm.root / "jobs").exists()  # no attribution for a job that will not run here
    assert slurm.node()["state"] == "IDLE+DRAIN"


def test_prolog_exit_1_without_a_report_is_could_not_check_and_follows_on_error(slurm: Slurm) -> None:
    # Exit 1 is the slurm profile's "not fit" and its "could not check" alike: a verdict of not fit always comes
    # with a report naming the findings, so none at all means the check could not judge (GPUHEALTH_ON_ERROR).
    slurm.verdict(1, None)
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="1")
    assert result.returncode == 0 and slurm.scontrol_updates() == []
    assert "could not check: no report (check exited 1)" in result.stderr
    assert slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="1", GPUHEALTH_ON_ERROR="drain").returncode == 1
    (update,) = slurm.scontrol_updates()
    assert _reason(update) == "gpuhealth: could not check: no report (check exited 1)"


def test_prolog_does_not_overwrite_an_admins_drain(slurm: Slurm) -> None:
    slurm.set_node("MIXED+DRAIN", "bad DIMM, ticket 4711")
    slurm.verdict(1, REPORT_XID)
    assert slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="1").returncode == 1
    assert slurm.scontrol_updates() == []
    assert slurm.node()["reason"] == "bad DIMM, ticket 4711"


@pytest.mark.parametrize("rc", [2, 3, 127])
def test_prolog_check_that_cannot_run_keeps_node_in_service_by_default(slurm: Slurm, rc: int) -> None:
    slurm.verdict(rc)
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="9", SLURM_JOB_GPUS="0")
    assert result.returncode == 0
    assert slurm.scontrol_updates() == []
    assert f"could not check {NODE} (exit {rc})" in result.stderr
    assert (slurm.root / "jobs" / "0").exists()


def test_prolog_on_error_drain_policy(slurm: Slurm) -> None:
    slurm.verdict(3)
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="9", GPUHEALTH_ON_ERROR="drain")
    assert result.returncode == 1
    (update,) = slurm.scontrol_updates()
    assert _reason(update) == "gpuhealth: prolog could not check (exit 3)"


def test_prolog_check_past_its_timeout_counts_as_could_not_check(slurm: Slurm) -> None:
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="9", STUB_GH_SLEEP="30", GPUHEALTH_TIMEOUT_S="1")
    assert result.returncode == 0
    assert "exit 124" in result.stderr
    assert slurm.scontrol_updates() == []


def test_settings_file_is_sourced(slurm: Slurm) -> None:
    env_file = slurm.root / "slurm.env"
    env_file.write_text('GPUHEALTH_PROLOG_ARGS="qualify --level full --exit-codes slurm"\n')
    slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="1", GPUHEALTH_SLURM_ENV=str(env_file))
    assert slurm.gpuhealth_calls() == [["status", "--exit-codes", "slurm", "--json"],
                                       ["qualify", "--level", "full", "--exit-codes", "slurm"]]


# --- epilog ------------------------------------------------------------------------------------

def test_epilog_removes_only_this_jobs_map_files(slurm: Slurm) -> None:
    jobs = slurm.root / "jobs"
    jobs.mkdir()
    (jobs / "0").write_text("1234\n")
    (jobs / "1").write_text("5678\n")
    (jobs / "GPU-x").write_text("1234\n")
    result = slurm.run("gpuhealth-epilog.sh", SLURM_JOB_ID="1234")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in jobs.iterdir()) == ["1"]
    assert slurm.gpuhealth_calls() == [["status", "--exit-codes", "slurm", "--json"]]


def test_epilog_drains_a_node_the_job_left_broken_but_exits_zero(slurm: Slurm) -> None:
    slurm.verdict(1, REPORT_XID)
    result = slurm.run("gpuhealth-epilog.sh", SLURM_JOB_ID="1234")
    assert result.returncode == 0
    (update,) = slurm.scontrol_updates()
    assert _reason(update).startswith("gpuhealth: xid.79")


def test_epilog_check_can_be_switched_off(slurm: Slurm) -> None:
    slurm.verdict(1, REPORT_XID)
    assert slurm.run("gpuhealth-epilog.sh", SLURM_JOB_ID="1", GPUHEALTH_EPILOG_ARGS="").returncode == 0
    assert slurm.gpuhealth_calls() == [] and slurm.scontrol_updates() == []


# --- health check -------------------------------------------------------------------------------

def test_healthcheck_drains_then_resumes_only_its_own_drain(slurm: Slurm) -> None:
    slurm.verdict(1, REPORT_XID)
    assert slurm.run("gpuhealth-healthcheck.sh").returncode == 0
    assert slurm.node()["state"] == "IDLE+DRAIN"
    assert slurm.node()["reason"].startswith("gpuhealth: xid.79")

    slurm.verdict(0)
    assert slurm.run("gpuhealth-healthcheck.sh").returncode == 0
    assert slurm.node() == {"state": "IDLE", "reason": "", "fail_show": False}
    assert slurm.scontrol_updates()[-1] == ["update", f"nodename={NODE}", "state=resume"]


def test_healthcheck_never_resumes_someone_elses_drain(slurm: Slurm) -> None:
    slurm.set_node("IDLE+DRAIN", "Prolog error")
    slurm.verdict(0)
    slurm.run("gpuhealth-healthcheck.sh")
    assert slurm.scontrol_updates() == []
    assert slurm.node()["state"] == "IDLE+DRAIN"


def test_healthcheck_on_a_healthy_undrained_node_changes_nothing(slurm: Slurm) -> None:
    slurm.run("gpuhealth-healthcheck.sh")
    assert slurm.scontrol_updates() == []
    assert [c[:2] for c in slurm.calls() if c[0] == "scontrol"] == [["scontrol", "show"]]


def test_healthcheck_refreshes_its_own_reason_when_findings_change(slurm: Slurm) -> None:
    slurm.set_node("IDLE+DRAIN", "gpuhealth: thermal.gpu_temp")
    slurm.verdict(1, REPORT_XID)
    slurm.run("gpuhealth-healthcheck.sh")
    assert slurm.node()["reason"] == "gpuhealth: xid.79,ecc.dbe_volatile"


def test_healthcheck_that_cannot_run_leaves_a_drained_node_drained(slurm: Slurm) -> None:
    slurm.set_node("IDLE+DRAIN", "gpuhealth: xid.79")
    slurm.verdict(3)
    slurm.run("gpuhealth-healthcheck.sh")
    assert slurm.scontrol_updates() == []


def test_healthcheck_drains_when_node_state_cannot_be_read(slurm: Slurm) -> None:
    slurm.set_node("IDLE", fail_show=True)
    slurm.verdict(1, REPORT_XID)
    result = slurm.run("gpuhealth-healthcheck.sh")
    assert "draining anyway" in result.stderr
    assert len(slurm.scontrol_updates()) == 1


def test_node_name_falls_back_to_short_hostname(slurm: Slurm) -> None:
    env = dict(slurm.env)
    del env["SLURMD_NODENAME"]
    slurm.env = env
    slurm.verdict(1, REPORT_XID)
    slurm.run("gpuhealth-healthcheck.sh")
    short = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()
    assert slurm.scontrol_updates()[0][1] == f"nodename={short}"


def test_scripts_are_executable_and_bash_syntax_clean() -> None:
    for name in ("gpuhealth-prolog.sh", "gpuhealth-epilog.sh", "gpuhealth-healthcheck.sh"):
        path = SLURM / name
        assert os.access(path, os.X_OK), name
        assert path.read_text().startswith("#!/bin/bash\n")
        subprocess.run(["bash", "-n", str(path)], check=True)


# --- the screen lock (issue 18) ------------------------------------------------------------------

@pytest.mark.parametrize("wait", ["abc", "1m", "-1", "a[$(touch pwned)]"])
def test_prolog_survives_a_screen_setting_that_is_not_a_number(slurm: Slurm, wait: str) -> None:
    """A typo in slurm.env must not fail the prolog (Slurm would drain the node and requeue every job),
    nor reach bash arithmetic (which evaluates it): it is logged and the default used."""
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="41", SLURM_JOB_GPUS="0",
                       GPUHEALTH_SCREEN_WAIT_S=wait, GPUHEALTH_SCREEN_BLOCK_TTL_S="1d")
    assert result.returncode == 0, result.stderr
    assert f"GPUHEALTH_SCREEN_WAIT_S={wait} is not a number of seconds; using 2" in result.stderr
    assert "GPUHEALTH_SCREEN_BLOCK_TTL_S=1d is not a number of seconds; using 604800" in result.stderr
    block = json.loads((slurm.root / "screen-block" / "job-41").read_text())
    assert block["expires"] - block["at"] == 604800
    assert not (slurm.root / "pwned").exists() and not Path("pwned").exists()


def test_prolog_waits_a_fractional_screen_wait_for_a_held_diagnostic_lock(slurm: Slurm) -> None:
    locks = slurm.root / "diag-locks"
    locks.mkdir()
    with open(locks / "gpu-GPU-0.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # an operator's `gpuhealth diag` on GPU 0
        t0 = time.monotonic()
        result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="42", GPUHEALTH_SCREEN_WAIT_S="0.5",
                           GPUHEALTH_SCREEN_BLOCK_TTL_S="08")
        took = time.monotonic() - t0
    assert result.returncode == 0, result.stderr
    assert 0.4 <= took < 3.0, f"the prolog took {took:.2f} s"
    assert "GPUs still held by a diagnostic after 0.500s: gpu-GPU-0.lock" in result.stderr
    block = json.loads((slurm.root / "screen-block" / "job-42").read_text())
    assert block["expires"] - block["at"] == 8  # "08" is eight seconds, not an octal error


def test_prolog_that_cannot_write_the_screen_lock_says_so_and_lets_the_job_start(slurm: Slurm) -> None:
    (slurm.root / "screen-block").write_text("a file where the folder should be")
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="43", SLURM_JOB_GPUS="0")
    assert result.returncode == 0, result.stderr
    assert "cannot write the screen lock" in result.stderr and "job-43" in result.stderr
    assert "stopped only by the job's processes" in result.stderr
    assert (slurm.root / "jobs" / "0").read_text().strip() == "43"  # the job's map is still written


def test_prolog_writes_the_screen_lock_into_an_existing_folder_it_does_not_own(slurm: Slurm) -> None:
    """The folder exists (made by the agent or tmpfiles.d, maybe another owner): the prolog writes into it
    and never needs to chmod it."""
    folder = slurm.root / "screen-block with space"
    folder.mkdir()
    folder.chmod(0o1777)
    result = slurm.run("gpuhealth-prolog.sh", SLURM_JOB_ID="44", GPUHEALTH_SCREEN_BLOCK_DIR=str(folder))
    assert result.returncode == 0, result.stderr
    assert json.loads((folder / "job-44").read_text())["holder"] == "prolog of job 44"
    assert folder.stat().st_mode & 0o7777 == 0o1777
    result = slurm.run("gpuhealth-epilog.sh", SLURM_JOB_ID="44", GPUHEALTH_SCREEN_BLOCK_DIR=str(folder))
    assert result.returncode == 0 and not (folder / "job-44").exists()
