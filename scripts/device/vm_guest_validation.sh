#!/usr/bin/env bash
# Issue 22 on a real cloud VM guest holding 2 GPUs of an 8-GPU NVSwitch board (the host runs the fabric): the
# shipped commands must call it healthy and fit. Run from the repository root on a device machine, carrying .whl
# (grpcio, protobuf, nvidia-ml-py, ... for the machine's Python: BENCHMARKS.md, "Cloud VM guests").
#   1. gpuhealth record --anonymize            -> $OUT/h200x2_vm_guest.json (tests/fixtures/recordings/)
#   2. gpuhealth status --json / text           -> exit code, health, environment
#   3. gpuhealth coordinator + gpuhealth agent (reporting to it; screening off so qualify owns the GPUs)
#      -> the agent's /health and /metrics; gpuhealth status --agent --exit-codes slurm
#   4. gpuhealth qualify --level quick --json, three times (the first on a cold page cache) -> wall seconds
#   5. gpuhealth fleet --json against the coordinator -> the node's health there
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
GH="python3 -m gpuhealth.cli.main"
W=$(mktemp -d)
now() { date +%s.%N; }
{
date -u; nvidia-smi -L; uname -r
echo "== 1. record"; $GH record --anonymize "$OUT/h200x2_vm_guest.json"; echo "rc=$?"
echo "== 2. status"; $GH status --json >"$OUT/status.json"; echo "rc=$?"; $GH status; echo "rc=$?"
echo "== 3. coordinator + agent"
$GH coordinator --listen 127.0.0.1:9500 --metrics-listen 127.0.0.1:9501 --db "$W/c.db" >"$W/coordinator.log" 2>&1 &
CPID=$!
cat >"$W/agent.yaml" <<YAML
agent: {listen: "127.0.0.1:9502", socket_path: "$W/agent.sock", state_dir: "$W/state", coordinator: "127.0.0.1:9500"}
diag: {enabled: false}
YAML
$GH agent --config "$W/agent.yaml" >"$W/agent.log" 2>&1 &
APID=$!
for _ in $(seq 1 60); do curl -sf http://127.0.0.1:9502/ready >/dev/null && break; sleep 0.5; done
curl -s http://127.0.0.1:9502/health >"$OUT/health.json"; echo "health: $(python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['node']; print(d['health'], d['action'], d['environment']['kind'])" "$OUT/health.json")"
curl -s http://127.0.0.1:9502/metrics | grep -E "^gpuhealth_(node_environment_info|node_health|findings)"
$GH status --agent http://127.0.0.1:9502 --exit-codes slurm >/dev/null; echo "status --agent --exit-codes slurm rc=$?"
echo "== 4. qualify --level quick (cold, then warm)"
for run in 1 2 3; do
  t0=$(now); $GH qualify --level quick --json >"$OUT/qualify_$run.json"; rc=$?; t1=$(now)
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['node']; print('run', sys.argv[2], 'rc', sys.argv[3], 'fit', d['fit'], d['health'], 'wall_s', d['wall_s'], 'process_s', round(float(sys.argv[5])-float(sys.argv[4]),2))" "$OUT/qualify_$run.json" "$run" "$rc" "$t0" "$t1"
done
python3 -c "import json; d=json.load(open('$OUT/qualify_3.json')); print('phases', d.get('phases'))"
echo "== 5. fleet"
sleep 6
$GH fleet --coordinator 127.0.0.1:9500 --json >"$OUT/fleet.json"; echo "fleet rc=$?"
$GH fleet --coordinator 127.0.0.1:9500; echo "fleet text rc=$?"
kill "$APID" "$CPID"; wait
echo "== agent log"; tail -n 30 "$W/agent.log"
echo "== coordinator log"; tail -n 15 "$W/coordinator.log"
} 2>&1 | tee "$OUT/run_log.txt"
ls -la "$OUT"
