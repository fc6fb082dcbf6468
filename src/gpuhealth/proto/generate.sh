#!/usr/bin/env bash
# Regenerate the committed gRPC/protobuf code from gpuhealth_v1.proto.
# Usage (from the repository root): src/gpuhealth/proto/generate.sh [python]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
src="$(cd "$here/../.." && pwd)"
python="${1:-$src/../.venv/bin/python}"
cd "$src"
"$python" -m grpc_tools.protoc -I. \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  gpuhealth/proto/gpuhealth_v1.proto
echo "generated in $here"
