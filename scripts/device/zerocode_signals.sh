#!/usr/bin/env bash
# Issues 25 and 27 on 2 GPUs: see scripts/device/zerocode_signals.py. Output in $OUT.
# Device call used: carry .whl (grpcio, protobuf, nvidia-ml-py, ... for the machine's Python); kind nvidia-h200-x2.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
timeout 560 python3 scripts/device/zerocode_signals.py "$@" 2>&1 | tee "$OUT/run_log.txt"
ls -la "$OUT"
