#!/usr/bin/env bash
# Runs the fault harness with NCCL on WORLD GPUs (default: all) and packs each mode's dumps, step records
# and launcher verdict into $OUT/nccl_<mode>.tar.gz. EXTRA is passed to every job (e.g. "--tp-size 2
# --straggler-factor 1.5"). Used on GPU machines to produce tests/fixtures/flightrec/nccl_*gpu/.
#     WORLD=4 EXTRA="--tp-size 2 --straggler-factor 1.5" tests/integration/fr_jobs/run_nccl.sh straggler subgroup_skip
set -o pipefail
OUT=${OUT:-/tmp/nccl_out}
WORLD=${WORLD:-$(nvidia-smi -L | wc -l)}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  echo "world $WORLD extra: $EXTRA"
  for mode in "$@"; do
    echo "== $mode"
    SECONDS=0
    # shellcheck disable=SC2086  # EXTRA is a list of options
    python3 "$HERE/job.py" --backend nccl --world-size "$WORLD" --mode "$mode" --out "$WORK/$mode" \
      --steps 30 --fault-step 10 --compute-s 0.02 --stall-s 2.0 --dump-wait 20 --job-timeout 90 --pg-timeout 60 $EXTRA
    echo "rc=$? seconds=$SECONDS"
    cat "$WORK/$mode/launcher.json"; echo
    ls -la "$WORK/$mode/dumps"
    for f in "$WORK/$mode"/log_rank*.txt; do tail -n 3 "$f"; done
    tar -C "$WORK" -czf "$OUT/nccl_$mode.tar.gz" "$mode/dumps" "$mode/launcher.json" $(cd "$WORK" && ls "$mode"/steps_rank*.jsonl 2>/dev/null)
  done
} 2>&1 | tee "$OUT/fr_log.txt"
