#!/usr/bin/env bash
# Zero-code runs for issue 15 on >= 2 GPUs: see scripts/device/zero_code_runs.py. Output in $OUT.
# Device call used: carry .venv/bin/py-spy and .whl (grpcio 1.85 wheels, installed to /tmp/site first);
# kind nvidia-h200-x2 (or nvidia-h100-x2); timeout 300 s.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PATH="$PWD/.venv/bin:$PATH"
timeout 200 python3 scripts/device/zero_code_runs.py --budget-s 190 "$@" 2>&1 | tee "$OUT/run_log.txt"
ls -la "$OUT"
