#!/usr/bin/env bash
# Quick start: the embedded default cluster (1 prefill + 1 decode worker on this machine's CPU,
# the built-in default model, a private Redis, gRPC on 127.0.0.1:50051), in the foreground
# until Ctrl-C. The first run builds the environment and trains the small default model (a few
# minutes). Extra arguments go to `tandem up` (e.g. --topology examples/local-cpu.yaml).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/bootstrap.sh" ""
exec tandem up "$@"
