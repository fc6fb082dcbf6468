#!/usr/bin/env bash
# Issue 18 on real GPUs (2-4 H100/H200).
# A quick screen (one warm rank per GPU, NCCL) is running when a job starts on the node; the screen's
# watch (live NVML, the same ScreenWatch the agent uses) sees the job's compute process and kills the
# screen ("alone" times the screen once, without a job). Measured, per trial, against the same job started on idle GPUs:
#   seen_to_free_s  the job's first CUDA context in NVML's lists -> no screen process left there (GPUs free)
#   delay_s    the job's first all_reduce completing, minus the same on idle GPUs (goal: <= 1 s)
# Usage (repository root, torch with CUDA installed): OUT=/tmp/out bash scripts/device/screen_abort_gpu.sh [TRIALS]
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$(mktemp -d)}
TRIALS=${1:-5}
W=$(mktemp -d)
cat > "$W/job.py" <<'PY'
# the "job": one rank per GPU; prints the seconds from its launch to its first all_reduce completing
import os, sys, time
t0 = float(os.environ["JOB_T0"])
import torch, torch.distributed as dist
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
x = torch.ones(64 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
if rank == 0:
    print(f"FIRST_COLLECTIVE_S {time.time() - t0:.3f}", flush=True)
dist.destroy_process_group()
PY
cat > "$W/trial.py" <<'PY'
import json, os, subprocess, sys, threading, time
from gpuhealth.collectors.runner import enumerate_gpus
from gpuhealth.config import Config
from gpuhealth.diag.qualify import plan
from gpuhealth.diag.runner import DiagRunner
from gpuhealth.diag.screen import ScreenWatch, gpu_pids
from gpuhealth.node import open_backend

mode, work = sys.argv[1], sys.argv[2]
backend = open_backend(None)
gpus = enumerate_gpus(backend)
world = len(gpus)

job_pids: set[int] = set()

def job() -> tuple[float, float]:
    env = {**os.environ, "JOB_T0": repr(time.time()), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517",
           "WORLD_SIZE": str(world)}
    t0 = time.time()
    procs = [subprocess.Popen([sys.executable, f"{work}/job.py"], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, text=True) for r in range(world)]
    job_pids.update(p.pid for p in procs)
    out = procs[0].communicate(timeout=300)[0]
    for p in procs[1:]:
        p.wait(timeout=300)
    return t0, float(out.split("FIRST_COLLECTIVE_S")[1].split()[0])

if mode == "idle":
    print(json.dumps({"mode": "idle", "first_collective_s": job()[1]}))
    sys.exit(0)
cfg = Config()
cfg.diag.state_dir = f"{work}/diag"
runner = DiagRunner(cfg.diag, state_dir=cfg.diag.state_dir, backend=backend)
box = []
# "alone": the agent's quick screen as it is, no job (wall 9.7 s on 2 x H200, 10.9 s on 2 x H100; its CUDA
# contexts after ~4-5 s). "screen": the same screen; the job starts 2-4.5 s after it, so that the job's own
# contexts (3-4 s after its start) land among the screen's work. Started later, they came after the screen
# had ended (2 x H100, 6 of 7 trials).
def screen() -> None:
    step = plan("quick", cfg)[0]
    box.append(runner.run("quick", [*step.args, "--golden-dir", f"{work}/gold"], gpus=gpus, timeout_s=300,
                          enforce_budget=False, watch=ScreenWatch(None, backend, also=gpus)))
marks: dict[str, float] = {}
def watch_gpus() -> None:
    """NVML every 5 ms: when every GPU shows a screen rank, when the job's first context shows (and whether a
    screen rank was there then), and when only the job's processes are left."""
    while time.time() < deadline and not ("free" in marks or ("job_done" in marks and "job_seen" not in marks)
                                           or (mode == "alone" and box)):
        now_pids = {p for g in gpus for p in (gpu_pids(backend, g.index) or [])}
        if "screen_ctx" not in marks and all(set(gpu_pids(backend, g.index) or []) - job_pids for g in gpus):
            marks["screen_ctx"] = time.time()
        if "job_seen" not in marks and now_pids & job_pids:
            marks["job_seen"] = time.time()  # the job's first CUDA context, as NVML lists it
            marks["screen_running_at_seen"] = float(bool(now_pids - job_pids))
        if "job_seen" in marks and not now_pids - job_pids:
            marks["free"] = time.time()  # only the job's processes left on the GPUs
        if mode == "alone" and "screen_ctx" in marks and not now_pids:
            marks["free"] = time.time()
        time.sleep(0.005)
t_screen = time.time()
deadline = t_screen + 120
th = threading.Thread(target=screen)
th.start()
w = threading.Thread(target=watch_gpus)
w.start()
if mode == "alone":
    th.join(); w.join()
    print(json.dumps({"mode": "alone", "screen": box[0].status, "reason": box[0].reason, "wall_s": box[0].wall_s,
                      "contexts_after_s": round(marks["screen_ctx"] - t_screen, 3) if "screen_ctx" in marks else None,
                      "total_s": round(time.time() - t_screen, 3)}))
    sys.exit(0)
time.sleep(float(sys.argv[3]))  # the job starts this long after the screen (its contexts come seconds later)
t0, first = job()
marks["job_done"] = time.time()
th.join(); w.join()
print(json.dumps({"mode": "screen", "first_collective_s": first, "job_after_screen_s": round(t0 - t_screen, 3),
                  "screen_contexts_after_s": round(marks["screen_ctx"] - t_screen, 3) if "screen_ctx" in marks else None,
                  "job_seen_after_s": round(marks["job_seen"] - t_screen, 3) if "job_seen" in marks else None,
                  "seen_to_free_s": round(marks["free"] - marks["job_seen"], 3) if "free" in marks else None,
                  "screen_running_at_seen": bool(marks.get("screen_running_at_seen")),
                  "screen": box[0].status, "reason": box[0].reason, "wall_s": box[0].wall_s}))
PY
{
date -u; nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
timeout 200 python3 "$W/trial.py" alone "$W"
for i in $(seq "$TRIALS"); do
  timeout 200 python3 "$W/trial.py" idle "$W"
  timeout 200 python3 "$W/trial.py" screen "$W" "$(python3 -c "import random; print(round(random.uniform(2, 4.5), 2))")"
done
} 2>&1 | tee "$OUT/screen_abort_gpu.txt"
python3 - "$OUT/screen_abort_gpu.txt" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
idle = [r["first_collective_s"] for r in rows if r["mode"] == "idle"]
scr = [r for r in rows if r["mode"] == "screen" and "error" not in r]
base = statistics.median(idle)
print(json.dumps({"idle_first_collective_median_s": base,
                  "delay_s": [round(r["first_collective_s"] - base, 3) for r in scr],
                  "seen_to_free_s": [r["seen_to_free_s"] for r in scr],
                  "screen_running_at_seen": [r["screen_running_at_seen"] for r in scr],
                  "screens": [r["screen"] for r in scr], "alone": [r for r in rows if r["mode"] == "alone"]},
                 indent=1))
PY
