#!/usr/bin/env bash
# Install everything the tests need (Python deps, Debian's prometheus/promtool) and run them all.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# Debian packages the tests drive for real: Prometheus + promtool, systemd-analyze, iproute2 (ip, tc).
missing=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || missing+=(prometheus)
command -v systemd-analyze >/dev/null || missing+=(systemd)
# ip and tc: the cluster in one box (tests/cluster.py) makes nodes of network namespaces and shapes their links.
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Debian's package starts a system Prometheus on :9090; tests start their own on free ports.
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
