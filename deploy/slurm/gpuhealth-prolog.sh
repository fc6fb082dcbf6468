#!/bin/bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/gpuhealth-prolog.sh, PrologFlags=Alloc recommended).
# Runs as root on each node of a job before it starts:
#   0. takes the screen lock for this job (GPUHEALTH_SCREEN_BLOCK_DIR/job-<id>): a screen the agent is
#      running between jobs is aborted and its GPUs are free within ~0.5 s; waits up to
#      GPUHEALTH_SCREEN_WAIT_S (2 s) for the per-GPU diagnostic locks to say so. The epilog releases it;
#   1. what the running agent knows (`gpuhealth status` asks it: rates over its history, XIDs),
#      then a quick qualification (`gpuhealth qualify --exit-codes slurm`: 0 fit, 1 not fit);
#      not fit -> drain the node with reason "gpuhealth: <finding codes>" and exit 1, so Slurm
#      requeues the job elsewhere;
#   2. fit -> record which GPUs belong to this job in $GPUHEALTH_SLURM_JOB_DIR, one file per GPU
#      (named by GPU UUID when nvidia-smi can tell, else by index; content: the job id), so the
#      agent labels GPU metrics with slurm_job_id.
# Settings: see gpuhealth-slurm-lib.sh. GPUHEALTH_PROLOG_STATUS_ARGS and GPUHEALTH_PROLOG_ARGS replace
# the two checks' arguments ("" skips one).
set -u
. "$(dirname "$(readlink -f "$0")")/gpuhealth-slurm-lib.sh"

GPUHEALTH_PROLOG_STATUS_ARGS=${GPUHEALTH_PROLOG_STATUS_ARGS-status --exit-codes slurm --json}
GPUHEALTH_PROLOG_ARGS=${GPUHEALTH_PROLOG_ARGS-qualify --level quick --exit-codes slurm --json}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}

# gh_gpu_uuid INDEX : the GPU's UUID, or nothing
gh_gpu_uuid() {
    [ -n "${GH_UUIDS:-}" ] || return 0
    printf '%s\n' "$GH_UUIDS" | awk -F', *' -v i="$1" '$1 == i { print $2; exit }'
}

write_job_map() {
    local job=$1 gpus=$2 idx name
    [ -n "$gpus" ] || return 0
    if [ ! -d "$GPUHEALTH_SLURM_JOB_DIR" ]; then  # an existing one (another owner's) is used as it is
        # shellcheck disable=SC2015  # either failing is the same failure
        mkdir -p "$GPUHEALTH_SLURM_JOB_DIR" && chmod 0755 "$GPUHEALTH_SLURM_JOB_DIR" || {
            gh_log "cannot create $GPUHEALTH_SLURM_JOB_DIR; GPU metrics will lack slurm_job_id"
            return 0
        }
    fi
    GH_UUIDS=""
    if command -v "$NVIDIA_SMI" >/dev/null 2>&1; then
        GH_UUIDS=$("$NVIDIA_SMI" --query-gpu=index,uuid --format=csv,noheader 2>/dev/null || true)
    fi
    for idx in ${gpus//,/ }; do
        case "$idx" in *[!0-9]*|'') continue ;; esac  # SLURM_JOB_GPUS holds GPU indices
        name=$(gh_gpu_uuid "$idx")
        name=${name:-$idx}
        # write then rename: the agent never reads a half-written file
        printf '%s\n' "$job" > "$GPUHEALTH_SLURM_JOB_DIR/.$name.tmp" &&
            mv -f "$GPUHEALTH_SLURM_JOB_DIR/.$name.tmp" "$GPUHEALTH_SLURM_JOB_DIR/$name"
    done
    return 0
}

main() {
    local node job rc args
    node=$(gh_node_name)
    job=${SLURM_JOB_ID:-}
    gh_screen_block "$job"
    gh_wait_gpus_free || true  # a run we cannot stop (an operator's) is logged; the job still starts
    for args in "$GPUHEALTH_PROLOG_STATUS_ARGS" "$GPUHEALTH_PROLOG_ARGS"; do
        [ -n "$args" ] || continue
        # shellcheck disable=SC2086  # the arguments are a word list on purpose
        gh_run_check $args
        gh_handle_result "$node" prolog
        rc=$?
        gh_cleanup
        if [ "$rc" -eq 1 ]; then
            gh_screen_release "$job"  # no job runs here: the drained node may be screened
            return 1
        fi
    done
    if [ -n "$job" ]; then
        write_job_map "$job" "${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}"
    fi
    return 0
}

main "$@"
