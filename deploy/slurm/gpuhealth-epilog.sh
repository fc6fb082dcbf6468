#!/bin/bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/gpuhealth-epilog.sh). Runs as root on each node
# after a job:
#   1. removes this job's GPU -> job files from $GPUHEALTH_SLURM_JOB_DIR (only files that name
#      this job, so a later job's files are never touched);
#   2. a post-job check (default `gpuhealth status --exit-codes slurm --json`, cheap: it catches
#      XIDs, ECC and fallen-off GPUs the job left behind); not fit -> drain with reason
#      "gpuhealth: <codes>". The epilog itself exits 0: the drain is ours, so the health check
#      can resume the node once it is fit again (an epilog failure would drain as "Epilog error").
#   3. releases this job's screen lock (the prolog took it) and hands the idle node to a screen: it
#      asks the running agent (POST $GPUHEALTH_AGENT_URL/screen?level=quick&trigger=epilog, 2 s at
#      most), which runs it on idle GPUs within its budget and aborts it when the next job's prolog
#      takes the lock. An SDC or bandwidth fault it finds becomes an agent finding, so the next
#      health check or prolog drains the node. The agent down: no screen, only a log line.
# GPUHEALTH_EPILOG_ARGS replaces the check's arguments; set it to "" to skip the check.
# GPUHEALTH_EPILOG_SCREEN: the screen's level (quick, periodic; "" = none).
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
    gh_screen_release "${SLURM_JOB_ID:-}"
    gh_request_screen "$GPUHEALTH_EPILOG_SCREEN"
    return 0
}

main "$@"
