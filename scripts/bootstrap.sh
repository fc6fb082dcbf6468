#!/usr/bin/env bash
# Create .venv and install gpuhealth with every extra. Idempotent; quick when already done.
# torch is pinned first to the CPU build on this machine's disk (any other spec downloads GBs);
# the package's own `torch>=2.11` range is then already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.gpuhealth-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[all]"
  touch "$stamp"
fi
