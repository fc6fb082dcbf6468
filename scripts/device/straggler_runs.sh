#!/usr/bin/env bash
# Real NCCL straggler runs for issue 13: 1.1/1.2/1.3x on 4 GPUs, 1.2x on 2 GPUs, healthy with +-15 % jitter on 4.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
J=tests/integration/fr_jobs/job.py
W=$(mktemp -d)
{
date -u; nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
run() { name=$1; shift; echo "== $name $*"; s=$SECONDS
  timeout 150 python3 $J --backend nccl --out "$W/$name" --steps 60 --fault-step 10 --compute-s 0.02 --buffer 2000 \
    --stall-s 3 --dump-wait 30 --job-timeout 120 --pg-timeout 90 "$@"; echo "rc=$? s=$((SECONDS-s))"; cat "$W/$name/launcher.json"; echo; }
for f in 1.1 1.2 1.3; do run "straggler_$f" --world-size 4 --mode straggler --straggler-factor $f; done
run healthy_jitter --world-size 4 --mode healthy --jitter 0.15
CUDA_VISIBLE_DEVICES=0,1 run straggler_1.2_2gpu --world-size 2 --mode straggler --straggler-factor 1.2
} 2>&1 | tee "$OUT/run_log.txt"
cd "$W" && for d in */; do d=${d%/}; tar -czf "$OUT/$d.tar.gz" "$d/dumps" "$d/launcher.json" $(ls $d/steps_rank*.jsonl) ; done
ls -la $OUT
