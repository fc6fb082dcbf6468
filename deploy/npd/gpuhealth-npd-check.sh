#!/bin/bash
# node-problem-detector custom plugin: the GPU verdict of the gpuhealth agent on this node, from its /health.
#
#   gpuhealth-npd-check.sh AGENT_URL [TIMEOUT_S]     e.g. http://gpuhealth-local-agent.gpuhealth.svc:9502 10
#
# NPD's image has no Python, so this asks the running agent instead of running gpuhealth: with curl or wget
# when the image has one, else with bash alone (/dev/tcp; the upstream image has bash, coreutils, grep, sed).
# GPUHEALTH_NPD_HTTP=curl|wget|bash picks one. Plain HTTP only (the node-local Service).
#
# Exit codes are NPD's: 0 OK, 1 problem (condition GPUProblem True), 2 unknown (the agent did not answer, or
# could not judge). One line on stdout: NPD keeps it as the condition's message. The verdict is the one
# `gpuhealth status --exit-codes npd` gives: degraded or unhealthy is a problem, and so is any finding whose
# action takes the node out (reset_gpu, reboot, drain) whatever its severity.
set -u

OK=0 PROBLEM=1 UNKNOWN=2
url=${1:-}
timeout_s=${2:-10}

unknown() { echo "gpuhealth: unknown: $*"; exit "$UNKNOWN"; }

[[ $url =~ ^http://([^/:]+|\[[0-9a-fA-F:]+\])(:([0-9]+))?/?$ ]] ||
  unknown "usage: $0 http://HOST[:PORT] [TIMEOUT_S] (got '${url}')"
host=${BASH_REMATCH[1]} port=${BASH_REMATCH[3]:-80}
[[ $timeout_s =~ ^[0-9]+$ ]] && ((timeout_s > 0)) || unknown "timeout must be a whole number of seconds, got '$timeout_s'"
health_url="${url%/}/health"

fetch_bash() {
  # HTTP/1.0 by hand: the server closes the connection after the body, so reading to the end is the body.
  local h=${host#[} && h=${h%]}
  timeout "$timeout_s" bash -c '
    exec 3<>"/dev/tcp/$1/$2" || exit 7
    printf "GET /health HTTP/1.0\r\nHost: %s\r\nConnection: close\r\n\r\n" "$1" >&3
    cat <&3' _ "$h" "$port" | {
    IFS= read -r status || exit 7
    [[ $status =~ ^HTTP/1\.[01]\ 200 ]] || { echo "HTTP status: ${status%$'\r'}" >&2; exit 22; }
    while IFS= read -r line && [[ ${line%$'\r'} != "" ]]; do :; done  # the headers
    cat
  }
}

fetch() {
  local how=${GPUHEALTH_NPD_HTTP:-auto}
  if [[ $how == auto ]]; then
    if command -v curl >/dev/null; then how=curl; elif command -v wget >/dev/null; then how=wget; else how=bash; fi
  fi
  case $how in
    curl) curl -fsS --max-time "$timeout_s" "$health_url" ;;
    wget) wget -q -T "$timeout_s" -t 1 -O - "$health_url" ;;
    bash) fetch_bash ;;
    *) echo "GPUHEALTH_NPD_HTTP must be curl, wget or bash, not '$how'" >&2; return 2 ;;
  esac
}

err=$(mktemp) || unknown "cannot create a temporary file"
trap 'rm -f "$err"' EXIT
body=$(fetch 2>"$err") || unknown "the agent at $url did not answer ($(head -c 120 "$err" | tr '\n' ' '))"
# /health is indented JSON: one line, runs of blanks squeezed, so that each key and its value sit together.
flat=$(printf '%s' "$body" | tr -d '\r\n' | tr -s ' \t' ' ')
# node comes first in the document, so the first "health" is the node's (gpus and findings follow)
health=$(printf '%s' "$flat" | grep -o '"health": "[a-z]*"' | head -n 1 | sed 's/.*: "\(.*\)"/\1/')
[[ -n $health ]] || unknown "no node health in the agent's /health at $url"
codes=$(printf '%s' "$flat" | grep -o '"code": "[^"]*", "severity": "\(warning\|critical\)"' |
  sed 's/"code": "\([^"]*\)".*/\1/' | sort -u | tr '\n' ' ')
codes=${codes% }
takes_out=$(printf '%s' "$flat" | grep -o '"action": "\(reset_gpu\|reboot\|drain\)"' | head -n 1 | sed 's/.*: "\(.*\)"/\1/')

case $health in
  healthy)
    if [[ -n $takes_out ]]; then
      echo "gpuhealth: healthy but a finding asks to $takes_out: ${codes:-see gpuhealth status}"
      exit "$PROBLEM"
    fi
    echo "gpuhealth: no GPU problem found"
    exit "$OK"
    ;;
  degraded | unhealthy) echo "gpuhealth: $health: ${codes:-see gpuhealth status}"; exit "$PROBLEM" ;;
  *) unknown "the agent could not judge the GPUs ($health): ${codes:-see gpuhealth status}" ;;
esac
