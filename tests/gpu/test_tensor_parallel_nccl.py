"""Tensor parallelism over NCCL: the CPU tier's equivalence on GPUs. Needs two CUDA devices
(NCCL puts one rank on each); skipped otherwise."""

from __future__ import annotations

import itertools

import pytest
import torch

from cluster.runtime.ray_runtime import ensure_ray
from reference_checks import run_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

CLUSTER = "tandem-nccl-tests"
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray = ensure_ray(CLUSTER)
    yield
    ray.shutdown()


@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2", "qwen3"])
def test_tp2_on_nccl_matches_tp1_on_cuda(architecture, checkpoint):
    model_dir = checkpoint(architecture)
    one = run_batch(model_dir, device="cuda").tokens
    two = run_batch(model_dir, device="cuda", tensor_parallel_size=2, cluster_name=CLUSTER,
                    engine_name=f"nccl-{next(_names)}").tokens
    assert two == one
