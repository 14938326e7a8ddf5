#!/usr/bin/env bash
# Quick start: offline generation with the built-in default model on this machine.
# The first run builds the environment and trains the small default model (a few minutes).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/scripts/bootstrap.sh" ""
out="${TANDEM_OUTPUT:-$root/quickstart.out.jsonl}"
tandem run --input "${1:-$root/examples/quickstart.jsonl}" --output "$out" "${@:2}"
python - "$out" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"--- {r['id']} ({r['finish_reason']}, {r['usage']['completion_tokens']} tokens)")
    print(r["error"] or r["text"])
PY
