#!/usr/bin/env bash
# Runs the fault harness with NCCL on 2 GPUs and packs the dumps (one tarball per mode) into $OUT.
# Used once on a GPU machine to produce tests/fixtures/flightrec/nccl_2gpu/.
set -o pipefail
OUT=${OUT:-/tmp/nccl_out}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=$(mktemp -d)
{
  date -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  for mode in "$@"; do
    echo "== $mode"
    SECONDS=0
    python3 "$HERE/job.py" --backend nccl --world-size 2 --mode "$mode" --out "$WORK/$mode" \
      --steps 30 --fault-step 10 --compute-s 0.02 --stall-s 2.0 --dump-wait 20 --job-timeout 90 --pg-timeout 60
    echo "rc=$? seconds=$SECONDS"
    cat "$WORK/$mode/launcher.json"; echo
    ls -la "$WORK/$mode/dumps"
    tail -3 "$WORK/$mode"/log_rank*.txt
    tar -C "$WORK" -czf "$OUT/nccl_$mode.tar.gz" "$mode/dumps" "$mode/launcher.json" $(cd "$WORK" && ls "$mode"/steps_rank*.jsonl 2>/dev/null)
  done
} 2>&1 | tee "$OUT/log.txt"
