#!/usr/bin/env bash
# Quick check of the GPU-side straggler hint on 2 GPUs (issue 25 item 3): the agent (as shipped, screening off), one
# unmodified 2-rank job whose rank 1 computes 1.3x; every 5 s the agent's SM activity and utilisation per GPU and
# its zero-code findings. Output in $OUT/hint_log.txt.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONPATH=$PWD/src:$PYTHONPATH
W=$(mktemp -d); L=$OUT/hint_log.txt
printf 'agent: {listen: "127.0.0.1:9502", socket_path: "%s/a.sock", state_dir: "%s/st"}\ndiag: {enabled: false}\n' "$W" "$W" >"$W/a.yaml"
python3 -m gpuhealth.cli.main agent --config "$W/a.yaml" >"$W/agent.log" 2>&1 &
A=$!
sleep 4
setsid python3 -m torch.distributed.run --nproc-per-node=2 --master-port=29577 --rdzv-id=gs tests/integration/zerocode_job/train.py --backend nccl --steps 0 --compute-s 0.03 --slow-rank 1 --slow-factor 1.3 >"$W/job.log" 2>&1 &
J=$!
for i in $(seq 1 13); do
  sleep 5
  { echo "== $((i*5)) s"; curl -s http://127.0.0.1:9502/metrics | grep -E '^gpuhealth_(gpu_sm_active_ratio|gpu_utilization_ratio|agent_gpu_processes)'; 
    curl -s http://127.0.0.1:9502/health | python3 -c "import json,sys; d=json.load(sys.stdin); print([(f['code'],f['severity'],f['message'][:160]) for f in d['findings']+[x for g in d['gpus'] for x in g['findings']] if f['code'].startswith(('rank.','ras.','collective.'))])"; } >>"$L" 2>&1
done
nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv >>"$L" 2>&1
pkill -9 -f train.py; kill $A; wait
tail -5 "$W/agent.log" >>"$L"
cat "$L" | tail -60
