"""Disaggregated prefill and decode over NCCL: the CPU tier's equivalence on GPUs. The prefill
worker takes the first GPU(s), the decode worker the next, so this needs two CUDA devices
(three for prefill TP 2); skipped otherwise."""

from __future__ import annotations

import pytest
import torch

if torch.cuda.device_count() < 2:
    # Before the cluster's imports: cluster.offline.disaggregated needs redis (and Ray), which a
    # one-GPU machine running only the engine's tests may not have.
    pytest.skip("needs two CUDA devices", allow_module_level=True)

from cluster.offline.disaggregated import DisaggregatedLLM  # noqa: E402
from cluster.engine.sampling_params import SamplingParams  # noqa: E402
from cluster.runtime.ray_runtime import ensure_ray  # noqa: E402
from conftest import random_prompts  # noqa: E402
from reference_checks import MAX_TOKENS, PROMPT_LENGTHS, run_batch  # noqa: E402

pytestmark = [pytest.mark.gpu]

CLUSTER = "tandem-disagg-nccl-tests"


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray = ensure_ray(CLUSTER)
    yield
    ray.shutdown()


@pytest.mark.parametrize("architecture, prefill_tp", [
    ("llama", 1),
    pytest.param("qwen2", 2, marks=pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three CUDA devices")),
])
def test_disaggregated_on_nccl_matches_colocated_on_cuda(architecture, prefill_tp, checkpoint):
    model_dir = checkpoint(architecture)
    colocated = run_batch(model_dir, device="cuda").tokens
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with DisaggregatedLLM.from_args(str(model_dir), verbose=False, device="cuda", prefill_tp=prefill_tp,
                                    num_kv_blocks=128, max_num_batched_tokens=96, cluster_name=CLUSTER) as llm:
        outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=1), params)
    assert [o.token_ids for o in outputs] == colocated
