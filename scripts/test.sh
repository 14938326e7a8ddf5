#!/usr/bin/env bash
# The test suite: builds the environment with test extras, then runs every tier.
# Tests that need a GPU skip themselves on machines without CUDA.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/bootstrap.sh" test
cd "$root"
exec python -m pytest "$@"
