#!/usr/bin/env bash
# Runs the fault modes of job.py with NCCL on WORLD GPUs (default: all; 2-4 expected) and packs every mode's
# dumps, step records, launcher.json and logs into $OUT/nccl_corpus_<WORLD>gpu.tar.gz, with the run's log in
# $OUT/nccl_corpus_<WORLD>gpu.log. Unattended: no network, each job capped by `timeout`, short runs (8 steps,
# fault at step 3, a stall called after 2 s). PARALLEL jobs (default 3) share the GPUs at a time: most of a
# job is process, CUDA and NCCL start-up, and no mode here is timed (stragglers are not in the default list).
# Modes default to every mode that runs on NCCL at this world size (`job.py --list`), straggler excepted:
# run it alone, by name, with PARALLEL=1 EXTRA="--steps 30 --fault-step 10 --compute-s 0.2 --straggler-factor 1.5".
#     OUT=/tmp/out WORLD=4 tests/integration/fr_jobs/run_nccl_corpus.sh [MODE ...]
# Turn the tarball into fixtures (expected.json from the injected fault) on any machine:
#     .venv/bin/python tests/integration/fr_jobs/make_fixtures.py --import-nccl $OUT/nccl_corpus_4gpu.tar.gz
# BACKEND=gloo WORLD=4 PYTHON=.venv/bin/python runs the same script on a CPU machine (to try it).
set -o pipefail
OUT=${OUT:-/tmp/nccl_out}
PY=${PYTHON:-python3}
BACKEND=${BACKEND:-nccl}
PARALLEL=${PARALLEL:-3}
WORLD=${WORLD:-$(nvidia-smi -L | wc -l)}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
NAME=${BACKEND}_corpus_${WORLD}gpu
mkdir -p "$OUT"
# NVLink multicast stays off (shared hosts); the jobs inherit the environment.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}

modes=("$@")
if [ ${#modes[@]} -eq 0 ]; then
  mapfile -t modes < <("$PY" "$HERE/job.py" --list | awk -v b="$BACKEND" '$2 ~ b && $1 != "straggler" {print $1}')
fi

mode_options() {  # what a mode needs at this world size; SKIP when it cannot run
  case "$1" in
    tp_pp_dp_skip) if [ "$WORLD" -ge 8 ]; then echo "--tp-size 2 --pp-size 2"
                   elif [ "$WORLD" -ge 4 ]; then echo "--tp-size 1 --pp-size 2"; else echo "SKIP"; fi ;;
    pipeline_*) [ "$WORLD" -ge 3 ] || echo "SKIP" ;;
    *) echo "" ;;
  esac
}

run_one() {  # one job; its report goes to $WORK/<mode>.report
  local mode=$1 opts start
  opts=$(mode_options "$mode")
  {
    if [ "$opts" = "SKIP" ]; then echo "== $mode: skipped at world $WORLD"; return; fi
    echo "== $mode $opts"
    start=$SECONDS
    # shellcheck disable=SC2086  # option lists
    timeout 120 "$PY" "$HERE/job.py" --backend "$BACKEND" --world-size "$WORLD" --mode "$mode" \
      --out "$WORK/$mode" --steps 8 --fault-step 3 --compute-s 0.02 --buffer 200 --stall-s 2.0 --dump-wait 20 \
      --job-timeout 60 --pg-timeout 90 $opts $EXTRA
    echo "rc=$? seconds=$((SECONDS - start))"
    cat "$WORK/$mode/launcher.json" 2>/dev/null; echo
    echo "dumps: $(ls "$WORK/$mode/dumps" 2>/dev/null | tr '\n' ' ')"
    for f in "$WORK/$mode"/error_rank*.txt; do [ -e "$f" ] && echo "$(basename "$f"): $(head -c 300 "$f")"; done
  } > "$WORK/$mode.report" 2>&1
}

{
  date -u
  if [ "$BACKEND" = nccl ]; then
    nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  else
    "$PY" -c "import torch; print('torch', torch.__version__)"
  fi
  echo "world $WORLD parallel $PARALLEL extra: $EXTRA modes: ${modes[*]}"
  TOTAL=$SECONDS
  for mode in "${modes[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do wait -n; done
    run_one "$mode" &
  done
  wait
  for mode in "${modes[@]}"; do cat "$WORK/$mode.report"; done
  echo "total seconds=$((SECONDS - TOTAL))"
} 2>&1 | tee "$OUT/$NAME.log"
compgen -G "$WORK/*/" > /dev/null || { echo "no job ran: nothing to pack"; exit 1; }
(cd "$WORK" && tar -czf "$OUT/$NAME.tar.gz" --exclude='*.tmp' --exclude='*.report' --exclude='finished_rank*' --exclude=rendezvous ./*/)
echo "packed $OUT/$NAME.tar.gz"
