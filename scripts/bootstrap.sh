#!/usr/bin/env bash
# Creates (or refreshes) the virtual environment: torch==2.13.0 first, then Tandem itself.
# Usage: source scripts/bootstrap.sh [extras]   (extras: "test", "bench" or "test,bench")
set -euo pipefail
TANDEM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TANDEM_VENV="${TANDEM_VENV:-$TANDEM_ROOT/.venv}"
TORCH_VERSION="2.13.0"
extras="${1:-}"
python="${PYTHON:-python3}"

if [ ! -x "$TANDEM_VENV/bin/python" ]; then
    echo "[bootstrap] creating virtual environment in $TANDEM_VENV" >&2
    "$python" -m venv "$TANDEM_VENV"
fi
pip=("$TANDEM_VENV/bin/python" -m pip --disable-pip-version-check -q)
stamp="$TANDEM_VENV/.tandem-$(cat "$TANDEM_ROOT/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
    if ! "$TANDEM_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
        echo "[bootstrap] installing torch==$TORCH_VERSION" >&2
        "${pip[@]}" install "torch==$TORCH_VERSION"
    fi
    target="$TANDEM_ROOT"
    [ -n "$extras" ] && target="$TANDEM_ROOT[$extras]"
    echo "[bootstrap] installing tandem${extras:+ [$extras]}" >&2
    "${pip[@]}" install -e "$target"
    echo "[bootstrap] compiling the native CPU kernels (once per machine and source, ~25 s on 2 cores)" >&2
    "$TANDEM_VENV/bin/python" -m cluster.engine.kernels.prebuild
    touch "$stamp"
fi
export PATH="$TANDEM_VENV/bin:$PATH"
