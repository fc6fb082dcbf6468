#!/bin/bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/gpuhealth-taskprolog.sh). Runs as the job's user
# before each task; the "export NAME=value" lines it prints go into the task's environment.
#
# They let the gpuhealth agent take flight-recorder dumps from the job's live NCCL ranks through a FIFO
# (on a hang, and for `gpuhealth triage --job`) — the job imports nothing of ours. Hang detection through
# NCCL's RAS service needs none of this. The same lines as `gpuhealth env --format slurm --tag $SLURM_JOB_ID`
# (tests/unit/agent/zerocode/test_zc_deploy.py keeps them equal), written out here so a task start costs no
# Python. Set GPUHEALTH_ZEROCODE=0 in the job to leave its environment alone.
[ "${GPUHEALTH_ZEROCODE:-1}" = 0 ] && exit 0
tag=$(printf '%s' "${GPUHEALTH_JOB_ID:-${SLURM_JOB_ID:-job}}" | tr -c 'A-Za-z0-9._-' '_' | cut -c1-64)
base="${GPUHEALTH_ZEROCODE_DIR:-/tmp}/gpuhealth-${tag}-"
echo "export TORCH_NCCL_DEBUG_INFO_PIPE_FILE=${base}pipe-"
echo "export TORCH_FR_DEBUG_INFO_PIPE_FILE=${base}pipe-"
echo "export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${base}fr-"
echo "export TORCH_FR_DUMP_TEMP_FILE=${base}fr-"
echo "export TORCH_FR_BUFFER_SIZE=${GPUHEALTH_FR_BUFFER_SIZE:-2000}"
echo "export TORCH_NCCL_ENABLE_TIMING=1"
