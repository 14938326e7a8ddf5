#!/usr/bin/env bash
# Regenerates the Python code of the public API (tandem/v1/tandem_pb2.py, tandem_pb2.pyi,
# tandem_pb2_grpc.py) from proto/tandem/v1/tandem.proto with the virtual environment's grpc_tools.
# Usage: bash scripts/gen_proto.sh [OUT_DIR]   (OUT_DIR defaults to the repository root)
# The output depends only on the .proto files and the grpcio-tools version, so running it again
# with the same grpcio-tools gives the committed files byte for byte.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
out="${1:-$root}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$root"
"$python" -m grpc_tools.protoc -I proto \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/tandem/v1/tandem.proto
echo "[gen_proto] wrote $out/tandem/v1/{tandem_pb2.py,tandem_pb2.pyi,tandem_pb2_grpc.py}" >&2
