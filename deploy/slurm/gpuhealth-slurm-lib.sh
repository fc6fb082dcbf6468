# shellcheck shell=bash
# Shared by the gpuhealth Slurm prolog, epilog and health check. Sourced, never run.
#
# Settings (environment, or /etc/gpuhealth/slurm.env, which is sourced if present):
#   GPUHEALTH_BIN            gpuhealth executable            (default: gpuhealth on PATH)
#   SCONTROL                 scontrol executable             (default: scontrol on PATH)
#   GPUHEALTH_SLURM_JOB_DIR  GPU -> job map for the agent    (default: /run/gpuhealth/slurm-jobs;
#                            must equal agent.slurm_job_dir in /etc/gpuhealth/agent.yaml)
#   GPUHEALTH_CONFIG         the agent's config file, given to every check as --config when it exists
#                            (default: /etc/gpuhealth/agent.yaml; "" = none): a check that runs here
#                            (qualify, status with the agent down) judges by the node's own
#                            collectors.expected_gpus, thresholds_file, disabled and diag.* settings
#   GPUHEALTH_TIMEOUT_S      limit for one check             (default: 120)
#   GPUHEALTH_AGENT_URL      the node's running agent        (default: http://127.0.0.1:9502; "" = never ask;
#                            host:port means http://host:port)
#                            `gpuhealth status` asks it first: it has the history one sweep lacks
#                            (NVLink/SBE/PCIe-replay rates, XIDs that came and went). Only when it
#                            does not answer does status check once itself, and the drain reason
#                            says "agent down, one-shot check".
#   GPUHEALTH_AGENT_TIMEOUT_S  how long to wait for the agent (default: 5)
#   GPUHEALTH_ON_ERROR       what a check that could not run (crash, timeout, missing binary)
#                            does: "ignore" (log, node stays in service; default) or "drain"; any other
#                            value is logged and means ignore
#   Screening between jobs (docs/diagnostics.md):
#   GPUHEALTH_SCREEN_BLOCK_DIR  the agent's block directory   (default: /run/gpuhealth/screen-block;
#                            must equal diag.screen_block_dir): the prolog writes job-<id> there, which
#                            aborts a running screen and holds off new ones; the epilog removes it
#   GPUHEALTH_SCREEN_BLOCK_TTL_S  a block file stops counting this long after the prolog wrote it, in
#                            case its epilog never runs (default: 604800, a week; /run empties at boot)
#   GPUHEALTH_DIAG_LOCK_DIR  the per-GPU diagnostic locks    (default: /var/lib/gpuhealth/diag/locks;
#                            <diag.state_dir>/locks): the prolog waits on them for the GPUs to be free
#   GPUHEALTH_SCREEN_WAIT_S  how long the prolog waits for that (default: 2)
#   GPUHEALTH_EPILOG_SCREEN  the screen the epilog asks the agent for: quick (default), periodic, "" = none
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
GPUHEALTH_CONFIG=${GPUHEALTH_CONFIG-/etc/gpuhealth/agent.yaml}
GPUHEALTH_TIMEOUT_S=${GPUHEALTH_TIMEOUT_S:-120}
GPUHEALTH_ON_ERROR=${GPUHEALTH_ON_ERROR:-ignore}
GPUHEALTH_AGENT_URL=${GPUHEALTH_AGENT_URL-http://127.0.0.1:9502}
GPUHEALTH_AGENT_TIMEOUT_S=${GPUHEALTH_AGENT_TIMEOUT_S:-5}
GPUHEALTH_SCREEN_BLOCK_DIR=${GPUHEALTH_SCREEN_BLOCK_DIR:-/run/gpuhealth/screen-block}
GPUHEALTH_SCREEN_BLOCK_TTL_S=${GPUHEALTH_SCREEN_BLOCK_TTL_S:-604800}
GPUHEALTH_DIAG_LOCK_DIR=${GPUHEALTH_DIAG_LOCK_DIR:-/var/lib/gpuhealth/diag/locks}
GPUHEALTH_SCREEN_WAIT_S=${GPUHEALTH_SCREEN_WAIT_S:-2}
GPUHEALTH_EPILOG_SCREEN=${GPUHEALTH_EPILOG_SCREEN-quick}
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

# a typo must not pass unnoticed as "ignore"
case "$GPUHEALTH_ON_ERROR" in
    drain|ignore) ;;
    *) gh_log "GPUHEALTH_ON_ERROR=$GPUHEALTH_ON_ERROR is neither drain nor ignore; using ignore"
       GPUHEALTH_ON_ERROR=ignore ;;
esac

gh_node_name() {
    if [ -n "${SLURMD_NODENAME:-}" ]; then
        printf '%s\n' "$SLURMD_NODENAME"
    else
        hostname -s
    fi
}

# gh_config_args ARGS... : "--config GPUHEALTH_CONFIG" (one per line) when that file exists and ARGS name no
# --config of their own. A node without the file is checked with the defaults, as before.
gh_config_args() {
    local a
    [ -n "$GPUHEALTH_CONFIG" ] && [ -f "$GPUHEALTH_CONFIG" ] || return 0
    for a in "$@"; do
        case "$a" in --config|--config=*) return 0 ;; esac
    done
    printf '%s\n' --config "$GPUHEALTH_CONFIG"
}

# gh_run_check ARGS... : run gpuhealth with ARGS (and the node's config file); sets GH_RC (exit code) and
# GH_OUT (stdout file).
gh_run_check() {
    GH_OUT=$(mktemp "${TMPDIR:-/tmp}/gpuhealth-slurm.XXXXXX")
    local errfile config=()
    errfile=$(mktemp "${TMPDIR:-/tmp}/gpuhealth-slurm.XXXXXX")
    mapfile -t config < <(gh_config_args "$@")
    set -- "$@" ${config[@]+"${config[@]}"}
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

# gh_verdict FILE RC : one line "unfit<TAB>REASON" or "unknown<TAB>REASON" for a check that exited non-zero.
#   unfit:   the report names what makes the node unfit: "gpuhealth: <codes>", the findings that take the node
#            out first (critical, or an action of reset_gpu/reboot/drain, whatever the severity: a power brake
#            is a warning that means drain), then the other warnings ("gpuhealth: agent down, one-shot check:
#            <codes>" when the agent did not answer).
#   unknown: the check could not judge (the report's health is "unknown": no NVML, a bad config), or left no
#            report at all; REASON says why ("gpuhealth: could not check: nvml.unavailable: ...").
# Any JSON shape works: every object that has a "code" and a "severity" counts.
gh_verdict() {
    local file=$1 rc=$2 verdict=""
    if command -v python3 >/dev/null 2>&1; then
        verdict=$(python3 - "$file" <<'PY' 2>/dev/null
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except Exception:
    sys.exit(0)
if not isinstance(data, dict):
    sys.exit(0)
OUT = {"reset_gpu", "reboot", "drain"}
first, rest = [], []
def walk(x):
    if isinstance(x, dict):
        code, sev = x.get("code"), str(x.get("severity", "")).lower()
        if isinstance(code, str) and sev in ("warning", "critical", "info"):
            takes_out = sev == "critical" or str(x.get("action", "")).lower() in OUT
            if sev != "info" or takes_out:
                bucket = first if takes_out else rest
                if code not in first and code not in rest:
                    bucket.append(code)
        for v in x.values():
            walk(v)
    elif isinstance(x, list):
        for v in x:
            walk(v)
walk(data)
node = data.get("node") if isinstance(data.get("node"), dict) else {}
prefix = "agent down, one-shot check: " if data.get("source") == "one-shot" else ""
if str(node.get("health", "")).lower() == "unknown":
    why = " ".join(str(node.get("error") or "no health could be judged").split())
    print("unknown\t" + prefix + "could not check: " + ",".join(first + rest + [why]))
elif first or rest:
    print("unfit\t" + prefix + ",".join(first + rest))
PY
        )
    fi
    if [ -n "$verdict" ]; then
        printf '%s\t%s %s\n' "${verdict%%$'\t'*}" "$GPUHEALTH_REASON_PREFIX" "${verdict#*$'\t'}" |
            cut -c "1-$((GPUHEALTH_REASON_MAX + 8))"
    else
        printf 'unknown\t%s could not check: no report (check exited %s)\n' "$GPUHEALTH_REASON_PREFIX" "$rc"
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
# A check that could not judge (no driver, no report) is "could not check" even when its exit code is the
# profile's 1: GPUHEALTH_ON_ERROR decides, and the reason says why.
gh_handle_result() {
    local node=$1 what=$2 verdict kind reason why=""
    case "$GH_RC" in
        0) return 0 ;;
        1)
            verdict=$(gh_verdict "$GH_OUT" "$GH_RC")
            kind=${verdict%%$'\t'*}
            reason=$(printf '%s\n' "${verdict#*$'\t'}" | cut -c "1-$GPUHEALTH_REASON_MAX")
            if [ "$kind" = unfit ]; then
                gh_drain "$node" "$reason"
                return 1
            fi
            why=": ${verdict#*$'\t'$GPUHEALTH_REASON_PREFIX }"
            ;;
        *) reason="$GPUHEALTH_REASON_PREFIX $what could not check (exit $GH_RC)" ;;
    esac
    gh_log "$what could not check $node (exit $GH_RC)$why; on-error policy: $GPUHEALTH_ON_ERROR"
    if [ "$GPUHEALTH_ON_ERROR" = "drain" ]; then
        gh_drain "$node" "$(printf '%s\n' "$reason" | cut -c "1-$GPUHEALTH_REASON_MAX")"
        return 1
    fi
    return 2
}

# ------------------------------------------------------------------ screening between jobs

# gh_ms NAME VALUE DEFAULT_S : VALUE seconds ("2", "0.5", "08") as whole milliseconds. A value that is
# not a number of seconds is logged and DEFAULT_S used instead: a typo in slurm.env must not fail every
# prolog (Slurm drains a node whose prolog fails), and bash arithmetic must never see it (it would
# evaluate it as an expression).
gh_ms() {
    local name=$1 value=$2 default=$3 whole frac
    if [[ $value == *[0-9]* ]] && [[ $value =~ ^([0-9]{0,9})(\.([0-9]*))?$ ]]; then
        whole=${BASH_REMATCH[1]:-0}
        frac="${BASH_REMATCH[3]}000"
        printf '%s\n' "$((10#$whole * 1000 + 10#${frac:0:3}))"
        return 0
    fi
    gh_log "$name=$value is not a number of seconds; using $default"
    gh_ms "$name" "$default" 0
}

# gh_block_name JOB : the block file's name for a job (digits, letters, '_' and '.' only)
gh_block_name() {
    printf 'job-%s\n' "$(printf '%s' "${1:-unknown}" | tr -c 'A-Za-z0-9._' '_' | cut -c1-64)"
}

# gh_screen_block JOB : hold screening off for this job (aborts a running screen within ~0.5 s)
gh_screen_block() {
    local name now ttl_ms err
    name=$(gh_block_name "$1")
    now=$(date +%s)
    ttl_ms=$(gh_ms GPUHEALTH_SCREEN_BLOCK_TTL_S "$GPUHEALTH_SCREEN_BLOCK_TTL_S" 604800)
    if [ ! -d "$GPUHEALTH_SCREEN_BLOCK_DIR" ]; then
        # created here: world-readable, so an agent running as another user can read it
        mkdir -p "$GPUHEALTH_SCREEN_BLOCK_DIR" 2>/dev/null && chmod 0755 "$GPUHEALTH_SCREEN_BLOCK_DIR" 2>/dev/null
    fi
    # write then rename: the agent never reads a half-written file (it skips dot files)
    if ! err=$( { printf '{"holder": "prolog of job %s", "at": %s, "expires": %s}\n' "${name#job-}" "$now" \
            "$((now + ttl_ms / 1000))" > "$GPUHEALTH_SCREEN_BLOCK_DIR/.$name.tmp" &&
            mv -f "$GPUHEALTH_SCREEN_BLOCK_DIR/.$name.tmp" "$GPUHEALTH_SCREEN_BLOCK_DIR/$name"; } 2>&1 ); then
        rm -f "$GPUHEALTH_SCREEN_BLOCK_DIR/.$name.tmp" 2>/dev/null
        gh_log "cannot write the screen lock $GPUHEALTH_SCREEN_BLOCK_DIR/$name (${err:-unknown error});" \
            "a screen is then stopped only by the job's processes (NVML)"
    fi
    return 0
}

# gh_screen_release JOB : this job no longer holds screening off
gh_screen_release() {
    rm -f "$GPUHEALTH_SCREEN_BLOCK_DIR/$(gh_block_name "$1")"
    return 0
}

# gh_wait_gpus_free : wait up to GPUHEALTH_SCREEN_WAIT_S for every per-GPU diagnostic lock (a screen
# holds its GPUs' locks until its processes are gone). Returns 1 (and logs) when one is still held.
gh_wait_gpus_free() {
    local f start_ms left_ms now_ms wait_ms held=""
    command -v flock >/dev/null 2>&1 || { gh_log "no flock(1): not waiting for a screen to end"; return 0; }
    wait_ms=$(gh_ms GPUHEALTH_SCREEN_WAIT_S "$GPUHEALTH_SCREEN_WAIT_S" 2)
    start_ms=$(date +%s%3N)
    for f in "$GPUHEALTH_DIAG_LOCK_DIR"/gpu-*.lock; do
        [ -f "$f" ] || continue
        now_ms=$(date +%s%3N)
        left_ms=$((wait_ms - (now_ms - start_ms)))
        [ "$left_ms" -gt 0 ] || left_ms=0
        if ! flock -s -w "$((left_ms / 1000)).$(printf '%03d' $((left_ms % 1000)))" "$f" true 2>/dev/null; then
            held="$held ${f##*/}"
        fi
    done
    if [ -n "$held" ]; then
        gh_log "GPUs still held by a diagnostic after $((wait_ms / 1000)).$(printf '%03d' $((wait_ms % 1000)))s:$held (not a screen: an operator's run?)"
        return 1
    fi
    return 0
}

# gh_request_screen LEVEL : ask the running agent to screen the idle node now (it owns the run, the
# locks and the budget). Never blocks the caller for long; the agent being down is only logged.
gh_request_screen() {
    local level=$1 answer url
    [ -n "$level" ] && [ -n "${GPUHEALTH_AGENT_URL:-}" ] || return 0
    command -v python3 >/dev/null 2>&1 || { gh_log "no python3: no screen asked for"; return 0; }
    url=${GPUHEALTH_AGENT_URL%/}
    case "$url" in *://*) ;; *) url="http://$url" ;; esac  # host:port, as `gpuhealth status` takes it
    answer=$(timeout 5 python3 - "$url/screen?level=$level&trigger=epilog" <<'PY' 2>&1
import sys, urllib.error, urllib.request
req = urllib.request.Request(sys.argv[1], data=b"", method="POST")
try:
    with urllib.request.urlopen(req, timeout=2) as resp:
        print(resp.status, resp.read(300).decode(errors="replace").replace("\n", " "))
except urllib.error.HTTPError as exc:
    print(exc.code, exc.read(300).decode(errors="replace").replace("\n", " "))
except Exception as exc:
    print("agent down:", exc)
PY
    )
    gh_log "screen ($level) asked of the agent: ${answer:-no answer}"
    return 0
}
