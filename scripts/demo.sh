#!/usr/bin/env bash
# Run the main job: a node agent and a coordinator. On a machine without an NVIDIA driver both run
# on the bundled real H200 recording and every output says SIMULATED.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/gpuhealth demo "$@"
