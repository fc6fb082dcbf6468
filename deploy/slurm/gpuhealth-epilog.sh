#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/gpuhealth-epilog.sh). Runs as root on each node
# after a job:
#   1. removes this job's GPU -> job files from $GPUHEALTH_SLURM_JOB_DIR (only files that name
#      this job, so a later job's files are never touched);
#   2. a post-job check (default `gpuhealth status --exit-codes slurm --json`, cheap: it catches
#      XIDs, ECC and fallen-off GPUs the job left behind); not fit -> drain with reason
#      "gpuhealth: <codes>". The epilog itself exits 0: the drain is ours, so the health check
#      can resume the node once it is fit again (an epilog failure would drain as "Epilog error").
# GPUHEALTH_EPILOG_ARGS replaces the check's arguments; set it to "" to skip the check.
set -u
. "$(dirname "$(readlink -f "$0")")/gpuhealth-slurm-lib.sh"

GPUHEALTH_EPILOG_ARGS=${GPUHEALTH_EPILOG_ARGS-status --exit-codes slurm --json}

remove_job_map() {
    local job=$1 f first
    [ -d "$GPUHEALTH_SLURM_JOB_DIR" ] || return 0
    for f in "$GPUHEALTH_SLURM_JOB_DIR"/* "$GPUHEALTH_SLURM_JOB_DIR"/.*.tmp; do
        [ -f "$f" ] || continue
        first=$(head -n 1 "$f" 2>/dev/null)
        if [ "$first" = "$job" ]; then
            rm -f "$f"
        fi
    done
}

main() {
    local node
    node=$(gh_node_name)
    if [ -n "${SLURM_JOB_ID:-}" ]; then
        remove_job_map "$SLURM_JOB_ID"
    fi
    if [ -n "$GPUHEALTH_EPILOG_ARGS" ]; then
        # shellcheck disable=SC2086
        gh_run_check $GPUHEALTH_EPILOG_ARGS
        gh_handle_result "$node" epilog
        gh_cleanup
    fi
    return 0
}

main "$@"
