# shellcheck shell=bash
# Shared by the gpuhealth Slurm prolog, epilog and health check. Sourced, never run.
#
# Settings (environment, or /etc/gpuhealth/slurm.env, which is sourced if present):
#   GPUHEALTH_BIN            gpuhealth executable            (default: gpuhealth on PATH)
#   SCONTROL                 scontrol executable             (default: scontrol on PATH)
#   GPUHEALTH_SLURM_JOB_DIR  GPU -> job map for the agent    (default: /run/gpuhealth/slurm-jobs;
#                            must equal agent.slurm_job_dir in /etc/gpuhealth/agent.yaml)
#   GPUHEALTH_TIMEOUT_S      limit for one check             (default: 120)
#   GPUHEALTH_AGENT_URL      the node's running agent        (default: http://127.0.0.1:9502; "" = never ask)
#                            `gpuhealth status` asks it first: it has the history one sweep lacks
#                            (NVLink/SBE/PCIe-replay rates, XIDs that came and went). Only when it
#                            does not answer does status check once itself, and the drain reason
#                            says "agent down, one-shot check".
#   GPUHEALTH_AGENT_TIMEOUT_S  how long to wait for the agent (default: 5)
#   GPUHEALTH_ON_ERROR       what a check that could not run (crash, timeout, missing binary)
#                            does: "ignore" (log, node stays in service; default) or "drain"
#
# Only the reason prefix "gpuhealth:" marks a drain as ours: we resume only those, and never
# overwrite a drain (or down) someone else set.

GPUHEALTH_SLURM_ENV=${GPUHEALTH_SLURM_ENV:-/etc/gpuhealth/slurm.env}
if [ -r "$GPUHEALTH_SLURM_ENV" ]; then
    # shellcheck disable=SC1090
    . "$GPUHEALTH_SLURM_ENV"
fi
GPUHEALTH_BIN=${GPUHEALTH_BIN:-gpuhealth}
SCONTROL=${SCONTROL:-scontrol}
GPUHEALTH_SLURM_JOB_DIR=${GPUHEALTH_SLURM_JOB_DIR:-/run/gpuhealth/slurm-jobs}
GPUHEALTH_TIMEOUT_S=${GPUHEALTH_TIMEOUT_S:-120}
GPUHEALTH_ON_ERROR=${GPUHEALTH_ON_ERROR:-ignore}
GPUHEALTH_AGENT_URL=${GPUHEALTH_AGENT_URL-http://127.0.0.1:9502}
GPUHEALTH_AGENT_TIMEOUT_S=${GPUHEALTH_AGENT_TIMEOUT_S:-5}
# `gpuhealth status` reads these (an empty URL: never ask the agent)
if [ -n "$GPUHEALTH_AGENT_URL" ]; then
    export GPUHEALTH_AGENT_URL GPUHEALTH_AGENT_TIMEOUT_S
else
    unset GPUHEALTH_AGENT_URL
fi
GPUHEALTH_REASON_PREFIX="gpuhealth:"
# Slurm keeps reasons short; ours name the finding codes.
GPUHEALTH_REASON_MAX=120

gh_log() {
    # syslog when available (slurmd discards our stderr for the health check), stderr always
    if command -v logger >/dev/null 2>&1; then
        logger -t "gpuhealth-slurm" -- "$*" 2>/dev/null || true
    fi
    printf 'gpuhealth-slurm: %s\n' "$*" >&2
}

gh_node_name() {
    if [ -n "${SLURMD_NODENAME:-}" ]; then
        printf '%s\n' "$SLURMD_NODENAME"
    else
        hostname -s
    fi
}

# gh_run_check ARGS... : run gpuhealth with ARGS; sets GH_RC (exit code) and GH_OUT (stdout file).
gh_run_check() {
    GH_OUT=$(mktemp "${TMPDIR:-/tmp}/gpuhealth-slurm.XXXXXX")
    local errfile
    errfile=$(mktemp "${TMPDIR:-/tmp}/gpuhealth-slurm.XXXXXX")
    if command -v timeout >/dev/null 2>&1; then
        timeout --kill-after=10 "$GPUHEALTH_TIMEOUT_S" "$GPUHEALTH_BIN" "$@" >"$GH_OUT" 2>"$errfile"
    else
        "$GPUHEALTH_BIN" "$@" >"$GH_OUT" 2>"$errfile"
    fi
    GH_RC=$?
    if [ "$GH_RC" -ne 0 ] && [ -s "$errfile" ]; then
        gh_log "gpuhealth $* exited $GH_RC: $(tail -n 3 "$errfile" | tr '\n' ' ')"
    fi
    rm -f "$errfile"
}

gh_cleanup() {
    [ -n "${GH_OUT:-}" ] && rm -f "$GH_OUT"
    return 0
}

# gh_reason FILE RC : "gpuhealth: <codes of warning/critical findings>" from the JSON report
# ("gpuhealth: agent down, one-shot check: <codes>" when the agent did not answer), "gpuhealth: could
# not check: <why>" from a report that says so, or a generic reason when it cannot be read. Any JSON
# shape works: we collect every object that has a "code" and a non-info "severity".
gh_reason() {
    local file=$1 rc=$2 reason=""
    if command -v python3 >/dev/null 2>&1; then
        reason=$(python3 - "$file" <<'PY' 2>/dev/null
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except Exception:
    sys.exit(0)
seen = []
def walk(x):
    if isinstance(x, dict):
        code, sev = x.get("code"), str(x.get("severity", "")).lower()
        if isinstance(code, str) and sev in ("warning", "critical") and code not in seen:
            seen.append(code)
        for v in x.values():
            walk(v)
    elif isinstance(x, list):
        for v in x:
            walk(v)
walk(data)
node = data.get("node") if isinstance(data, dict) else None
prefix = "agent down, one-shot check: " if isinstance(data, dict) and data.get("source") == "one-shot" else ""
if seen:
    print(prefix + ",".join(seen))
elif isinstance(node, dict) and node.get("error"):
    print(prefix + "could not check: " + " ".join(str(node["error"]).split()))
PY
        )
    fi
    if [ -n "$reason" ]; then
        printf '%s %s\n' "$GPUHEALTH_REASON_PREFIX" "$reason" | cut -c "1-$GPUHEALTH_REASON_MAX"
    else
        printf '%s not fit (check exited %s)\n' "$GPUHEALTH_REASON_PREFIX" "$rc"
    fi
}

# gh_node_state NODE : prints "STATE<TAB>REASON" from `scontrol show node`
gh_node_state() {
    local show state reason
    show=$("$SCONTROL" show node "$1" 2>/dev/null) || return 1
    state=$(printf '%s\n' "$show" | tr ' ' '\n' | sed -n 's/^State=//p' | head -n 1)
    reason=$(printf '%s\n' "$show" | sed -n 's/^[[:space:]]*Reason=//p' | head -n 1)
    printf '%s\t%s\n' "$state" "$reason"
}

gh_is_ours() {
    case "$1" in
        "$GPUHEALTH_REASON_PREFIX"*) return 0 ;;
        *) return 1 ;;
    esac
}

# gh_drain NODE REASON : drain, unless someone else already drained or downed the node
gh_drain() {
    local node=$1 reason=$2 info state current
    info=$(gh_node_state "$node") || { gh_log "cannot read state of $node; draining anyway"; info=""; }
    state=${info%%$'\t'*}
    current=${info#*$'\t'}
    case "$state" in
        *DRAIN*|*DOWN*|*FAIL*)
            if [ -n "$current" ] && ! gh_is_ours "$current"; then
                gh_log "$node is already $state (reason: $current); not replacing it with: $reason"
                return 0
            fi
            ;;
    esac
    gh_log "draining $node: $reason"
    "$SCONTROL" update nodename="$node" state=drain reason="$reason"
}

# gh_resume_if_ours NODE : resume a node only if its drain reason is ours
gh_resume_if_ours() {
    local node=$1 info state current
    info=$(gh_node_state "$node") || { gh_log "cannot read state of $node"; return 0; }
    state=${info%%$'\t'*}
    current=${info#*$'\t'}
    case "$state" in
        *DRAIN*)
            if gh_is_ours "$current"; then
                gh_log "resuming $node (checks pass; was: $current)"
                "$SCONTROL" update nodename="$node" state=resume
            fi
            ;;
    esac
    return 0
}

# gh_handle_result NODE WHAT : act on GH_RC after a check. Returns 0 fit, 1 not fit, 2 could not check.
gh_handle_result() {
    local node=$1 what=$2 reason
    case "$GH_RC" in
        0) return 0 ;;
        1)
            reason=$(gh_reason "$GH_OUT" "$GH_RC")
            gh_drain "$node" "$reason"
            return 1
            ;;
        *)
            gh_log "$what could not check $node (exit $GH_RC); on-error policy: $GPUHEALTH_ON_ERROR"
            if [ "$GPUHEALTH_ON_ERROR" = "drain" ]; then
                gh_drain "$node" "$GPUHEALTH_REASON_PREFIX $what could not check (exit $GH_RC)"
                return 1
            fi
            return 2
            ;;
    esac
}
