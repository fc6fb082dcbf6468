#!/bin/bash
# Slurm HealthCheckProgram (slurm.conf: HealthCheckProgram=/etc/slurm/gpuhealth-healthcheck.sh,
# HealthCheckInterval=300, HealthCheckNodeState=ANY). Runs as root, periodically, on every node:
#   fit      -> if the node is drained with a "gpuhealth:" reason (ours), resume it;
#               any other drain (an admin's, Slurm's own) is left alone;
#   not fit  -> drain it with reason "gpuhealth: <finding codes>" (unless already drained by
#               someone else);
#   no check -> log; the node stays as it is (GPUHEALTH_ON_ERROR=drain changes that).
# The default check reads the node's state without loading the GPUs (safe while jobs run);
# GPUHEALTH_HEALTHCHECK_ARGS replaces its arguments ("" skips the check: the node is left as it is,
# as the other hooks' *_ARGS do).
set -u
. "$(dirname "$(readlink -f "$0")")/gpuhealth-slurm-lib.sh"

GPUHEALTH_HEALTHCHECK_ARGS=${GPUHEALTH_HEALTHCHECK_ARGS-status --exit-codes slurm --json}

main() {
    local node rc
    node=$(gh_node_name)
    [ -n "$GPUHEALTH_HEALTHCHECK_ARGS" ] || return 0
    # shellcheck disable=SC2086
    gh_run_check $GPUHEALTH_HEALTHCHECK_ARGS
    gh_handle_result "$node" healthcheck
    rc=$?
    gh_cleanup
    if [ "$rc" -eq 0 ]; then
        gh_resume_if_ours "$node"
    fi
    return 0
}

main "$@"
