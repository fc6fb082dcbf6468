"""Runs the fault harness (job.py) with Gloo on CPU, one job at a time, and commits each run as a fixture:
``tests/fixtures/flightrec/gloo_<W>rank/<name>/`` with ``dumps/rank<R>.json`` + ``rank<R>.pkl``,
``steps_rank<R>.jsonl``, ``launcher.json`` and ``expected.json`` — the answer triage must give, from the fault
injected (faults.expected), never from what gpuhealth prints.

    .venv/bin/python tests/integration/fr_jobs/make_fixtures.py [NAME ...] [--dest DIR] [--list]

Before writing, each run is checked against what the mode means (every rank dumped unless the mode kills one;
a hang stalled, a healthy job finished without errors): a run that did not do what its mode says is refused
with one line, so a fixture never silently records something else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import faults  # a sibling module

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEST = REPO / "tests" / "fixtures" / "flightrec"
# Short runs: 2 CPU cores host 4-8 ranks (compute is a sleep), a stall is called after 1.5 s.
HANG_RUN = ["--steps", "8", "--fault-step", "3", "--compute-s", "0.02", "--buffer", "200", "--stall-s", "1.5",
            "--pg-timeout", "30", "--dump-wait", "40", "--job-timeout", "60"]
# Timing runs: enough steps for a straggler to show through ±15 % jitter; the FR buffer keeps the last 32 ops.
TIMING_RUN = ["--steps", "30", "--fault-step", "8", "--compute-s", "0.04", "--buffer", "32", "--stall-s", "2",
              "--pg-timeout", "30", "--dump-wait", "40", "--job-timeout", "60"]
SIGABRT = -6


@dataclass(frozen=True)
class Spec:
    mode: str
    world: int = 4
    extra: tuple[str, ...] = ()
    timing: bool = False

    def options(self) -> list[str]:
        return ["--mode", self.mode, "--world-size", str(self.world), *(TIMING_RUN if self.timing else HANG_RUN),
                *self.extra]


SPECS: dict[str, Spec] = {
    **{f"gloo_4rank/{m}": Spec(m) for m in (
        "healthy", "hang_skip", "hang_sleep", "subgroup_hang", "subgroup_skip", "type_mismatch", "size_mismatch",
        "dtype_mismatch", "pipeline_healthy", "pipeline_hang", "pipeline_batch_hang", "pipeline_batch_healthy",
        "coalesced_mismatch", "coalesced_allreduce_mismatch", "coalesced_hang", "fsdp_healthy", "gather_healthy",
        "scatter_healthy", "alltoall_uneven_healthy", "alltoall_split_mismatch", "broadcast_then_stall",
        "recv_any_source", "rank_exit")},
    "gloo_4rank/healthy_jitter": Spec("healthy", extra=("--jitter", "0.15", "--seed", "1"), timing=True),
    **{f"gloo_4rank/straggler_{f}": Spec("straggler", extra=("--straggler-factor", f, "--jitter", "0.15",
                                                              "--seed", "2"), timing=True)
       for f in ("1.1", "1.2", "1.3")},
    "gloo_8rank/tp_pp_dp_skip": Spec("tp_pp_dp_skip", world=8),
    "gloo_8rank/pipeline_hang": Spec("pipeline_hang", world=8, extra=("--culprit", "3")),
    "gloo_8rank/subgroup_hang": Spec("subgroup_hang", world=8, extra=("--culprit", "5")),
    "gloo_8rank/alltoall_split_mismatch": Spec("alltoall_split_mismatch", world=8, extra=("--culprit", "6")),
}
# Not made on Gloo: send_recv_size_mismatch completes silently and Gloo records no send/recv, so its dumps
# are those of a healthy job — no analyser could find the fault in them (run it on NCCL: run_nccl_corpus.sh).


def _torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip().split("+")[0]


def _value(options: list[str], flag: str, default: str) -> str:
    return options[options.index(flag) + 1] if flag in options else default


def make(name: str, spec: Spec, dest: Path, torch_version: str) -> dict[str, Any]:
    """Run one Gloo job and write it as fixture ``name``."""
    options = spec.options()
    with tempfile.TemporaryDirectory(prefix="frfix-") as tmp:
        out = Path(tmp) / name.replace("/", "_")
        cmd = [sys.executable, str(HERE / "job.py"), *options, "--out", str(out)]
        subprocess.run(cmd, check=True, timeout=180, capture_output=True)
        rel_cmd = " ".join(["python", "tests/integration/fr_jobs/job.py", *options, "--out", f"OUT/{name}"])
        return write_fixture(out, dest / name, made_by=rel_cmd, torch_version=torch_version,
                             made_with=f"python tests/integration/fr_jobs/make_fixtures.py {name}")


def import_packed(tarball: Path, dest: Path, force: bool) -> list[str]:
    """Turn a run_nccl_corpus.sh tarball into fixtures ``<backend>_<W>gpu/<mode>``; existing folders are kept
    unless ``force``. The log beside the tarball gives the torch version and the GPUs."""
    log = tarball.with_name(tarball.name.removesuffix(".tar.gz") + ".log")
    header = log.read_text(errors="replace").splitlines()[:8] if log.exists() else []
    torch_line = next((x for x in header if x.startswith("torch ")), "torch ?")
    gpus = [x.split(" (UUID")[0] for x in header if x.startswith("GPU ")]
    parallel = next((int(x.split()[3]) for x in header if x.startswith("world ") and x.split()[2] == "parallel"), 1)
    hardware = f"{len(gpus)} x {gpus[0].split(': ', 1)[1]}" if gpus else "GPUs not recorded"
    written = []
    with tempfile.TemporaryDirectory(prefix="frimport-") as tmp:
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter="data")
        for launcher_file in sorted(Path(tmp).glob("*/launcher.json")):
            launcher = json.loads(launcher_file.read_text())
            name = f"{launcher['backend']}_{launcher['world_size']}gpu/{launcher['mode']}"
            if (dest / name).exists() and not force:
                print(f"{name}: exists, kept (--force replaces it)")
                continue
            made_by = (f"WORLD={launcher['world_size']} tests/integration/fr_jobs/run_nccl_corpus.sh {launcher['mode']}"
                       f"  (job.py {' '.join(launcher['options'])}; {hardware}, {torch_line})")
            try:
                write_fixture(launcher_file.parent, dest / name, made_by=made_by,
                              torch_version=torch_line.split()[1].split("+")[0] if " " in torch_line else "?",
                              made_with=f"make_fixtures.py --import-nccl {tarball.name}", strict=False,
                              keep_steps=parallel == 1)
            except RunError as exc:
                print(f"{name}: not imported: {exc}")
                continue
            written.append(name)
            print(f"{name}: written")
    return written


class RunError(Exception):
    """A run that did not do what its mode says."""


def write_fixture(out: Path, target: Path, *, made_by: str, made_with: str, torch_version: str,
                  strict: bool = True, keep_steps: bool = True) -> dict[str, Any]:
    """Check the run in ``out`` and write it to ``target`` with its expected.json. ``keep_steps``: False when
    jobs shared the GPUs (their compute times measure the contention, not the job: no step records)."""
    launcher = json.loads((out / "launcher.json").read_text())
    options = list(launcher.get("options", []))
    mode, world, backend = str(launcher["mode"]), int(launcher["world_size"]), str(launcher["backend"])
    culprit = int(launcher["culprit"])
    expected = faults.expected(mode, world=world, culprit=culprit, backend=backend,
                               tp_size=int(_value(options, "--tp-size", "2")),
                               pp_size=int(_value(options, "--pp-size", "2")),
                               straggler_factor=float(_value(options, "--straggler-factor", "2.0")))
    _check_run(out, mode, world, launcher, culprit, expected, strict)
    if target.exists():
        shutil.rmtree(target)
    (target / "dumps").mkdir(parents=True)
    for p in sorted((out / "dumps").glob("rank*")):
        if p.suffix in (".json", ".pkl"):
            shutil.copy(p, target / "dumps" / p.name)
    for p in sorted(out.glob("steps_rank*.jsonl")) if keep_steps else []:
        shutil.copy(p, target / p.name)
    shutil.copy(out / "launcher.json", target / "launcher.json")
    expected.update(made_by=made_by, made_with=made_with, torch=torch_version, backend=backend, world_size=world,
                    seen={"launcher": launcher["reason"], "exit_codes": launcher["exit_codes"],
                          "errors_before_dump": _errors_before_dump(out)})
    if not keep_steps:
        expected["no_step_records"] = "jobs ran side by side on the same GPUs: their compute times measure that"
    (target / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")
    return expected


def _errors_before_dump(out: Path) -> dict[str, str]:
    """Errors the ranks raised before the dump was asked for (later ones come from the launcher's kill)."""
    trigger = out / "dump_now"
    t = trigger.stat().st_mtime if trigger.exists() else float("inf")
    return {p.stem.removeprefix("error_rank"): (p.read_text().splitlines() or [""])[0][:200]
            for p in sorted(out.glob("error_rank*.txt")) if p.stat().st_mtime < t}


def _last_line(log: Path) -> str:
    lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()] if log.exists() else []
    return lines[-1][:300] if lines else "(nothing)"


def _check_run(out: Path, mode: str, world: int, launcher: dict[str, Any], culprit: int,
               expected: dict[str, Any], strict: bool) -> None:
    """Refuse a run that did not do what its mode says; note the consequences the backend adds (an aborted
    rank). ``strict``: also require the stall or finish the mode means (Gloo; NCCL may hang where Gloo passes)."""
    dumped = {int(p.stem.removeprefix("rank")) for p in (out / "dumps").glob("rank*.pkl")}
    missing = sorted(set(range(world)) - dumped)
    gone_by_design = [culprit] if mode == "rank_exit" else []
    codes = {int(k): v for k, v in dict(launcher["exit_codes"]).items()}
    aborted = [r for r in missing if r not in gone_by_design and codes.get(r) == SIGABRT]
    unexplained = [r for r in missing if r not in gone_by_design and r not in aborted]
    if unexplained or not set(gone_by_design) <= set(missing):
        raise RunError(f"rank(s) {unexplained or gone_by_design} left no dump unexpectedly; see {out}")
    if aborted:
        if expected["verdict"] != "mismatch":
            raise RunError(f"the backend aborted rank(s) {aborted} in a mode without a mismatch")
        said = "; ".join(_last_line(out / f"log_rank{r}.txt") for r in aborted)
        expected["allowed_consequences"] = aborted
        expected["consequences_why"] = (f"the backend aborted rank(s) {aborted} (SIGABRT) on the mismatched op, so "
                                        f"its dump is lost; it said: {said}")
    want = "stalled" if faults.MODES[mode].hangs else "finished"
    if strict and launcher["reason"] != want:
        raise RunError(f"the job {launcher['reason']}, but mode {mode} should have {want}")
    errors = _errors_before_dump(out)
    if expected["verdict"] == "healthy" and (errors or launcher["reason"] != "finished"):
        raise RunError(f"a healthy run {launcher['reason']} with errors {errors}")
    if mode == "rank_exit":
        expected["job"] = {"world_size": world}  # the dead rank is seen only against the job's size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="fixtures to (re)make (default: all)")
    p.add_argument("--dest", type=Path, default=DEST)
    p.add_argument("--list", action="store_true")
    p.add_argument("--import-nccl", type=Path, metavar="TARBALL",
                   help="turn a run_nccl_corpus.sh tarball into fixtures")
    p.add_argument("--force", action="store_true", help="with --import-nccl: replace existing fixture folders")
    args = p.parse_args(argv)
    if args.import_nccl:
        import_packed(args.import_nccl, args.dest, args.force)
        return 0
    if args.list:
        for name, spec in SPECS.items():
            print(f"{name:40s} {' '.join(spec.options())}")
        return 0
    unknown = [n for n in args.names if n not in SPECS]
    if unknown:
        p.error(f"unknown fixture(s): {', '.join(unknown)} (see --list)")
    version = _torch_version()
    for name in args.names or list(SPECS):
        try:
            exp = make(name, SPECS[name], args.dest, version)
        except RunError as exc:
            print(f"{name}: refused: {exc}", flush=True)
            return 1
        print(f"{name}: {exp['verdict']} root {exp['root_ranks']} ({exp['seen']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
