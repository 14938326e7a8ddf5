"""The Triton quantized matmul on a real GPU: every layout at Llama-like widths with the tile and
split-K plans the device gets (the interpreter never splits by itself), FP8 activations where the
GPU has FP8 tensor cores (asked for: not the default), capture in a CUDA graph, and bfloat16 engines quantized at load whose
decode graphs give the tokens of their eager steps. Tolerances as in
tests/unit/test_triton_quantized_matmul.py. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    # Before the kernel's import: Triton fixes compiled-or-interpreted when a kernel is defined,
    # and the interpreter tests collected after this module set TRITON_INTERPRET=1 first.
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from cluster.engine.kernels import triton_quantized_matmul as kernel  # noqa: E402
from cluster.engine.sampling_params import SamplingParams  # noqa: E402
from cluster.offline.llm import LLM  # noqa: E402
from conftest import random_prompts  # noqa: E402
from packed_weights import KINDS, fp8_rounding_bound, packed  # noqa: E402
from packed_weights import activations as random_activations  # noqa: E402
from packed_weights import assert_close_to_dequantized as assert_close  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = torch.device("cuda")


def activations(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return random_activations(rows, cols, dtype, DEVICE)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_each_layout_at_llama_widths(kind, rows):
    """1001 weight rows by 4096 columns: decode batches split K (a few programs per SM)."""
    weight = packed(kind, 1001, 4096, seed=rows).to(DEVICE)
    if rows <= kernel.DECODE_ROWS:
        assert kernel.plan_tiles(rows, 1001, 4096, kernel._sm_count(DEVICE)).splits > 1
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = activations(rows, 4096, dtype)
        assert_close(kernel.packed_linear(x, ((0, weight),), 1001, fp8_activations=False), x, weight)


@pytest.mark.skipif(not torch.cuda.is_available() or not kernel.fp8_activations_run_on(DEVICE),
                    reason="needs FP8 tensor cores (compute capability >= 8.9)")
@pytest.mark.parametrize("rows", [1, 8, 64, 300])
def test_fp8_activations_on_fp8_tensor_cores(rows):
    weight = packed("f8", 1001, 4096, seed=rows).to(DEVICE)
    for dtype in (torch.bfloat16, torch.float16):
        x = activations(rows, 4096, dtype)
        out = kernel.packed_linear(x, ((0, weight),), 1001, fp8_activations=True)
        assert_close(out, x, weight, extra=fp8_rounding_bound(x, weight))


@pytest.mark.parametrize("kind", ["q4", "f8"])
def test_a_captured_graph_replays_new_inputs(kind):
    weight = packed(kind, 1001, 4096).to(DEVICE)
    x = torch.zeros(8, 4096, dtype=torch.bfloat16, device=DEVICE)
    kernel.packed_linear(x, ((0, weight),), 1001)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.packed_linear(x, ((0, weight),), 1001)
    x.copy_(activations(8, 4096, torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernel.packed_linear(x, ((0, weight),), 1001))


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_engines_quantized_at_load_give_the_cpu_paths_tokens_with_decode_graphs(quantization, checkpoint):
    """float32: the kernel's products are exact IEEE float32, as the CPU kernel's are."""
    model_dir = str(checkpoint("llama"))
    prompts = random_prompts([1, 9, 40, 130], seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = dict(dtype="float32", verbose=False, num_kv_blocks=128, quantization=quantization)
    cpu = LLM(model_dir, **engine).generate(prompts, params)
    gpu = LLM(model_dir, device="cuda", **engine)
    assert gpu.engine.runner.graphs.graphs, "decode graphs captured with packed layers"
    assert [o.token_ids for o in gpu.generate(prompts, params)] == [o.token_ids for o in cpu]


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_bfloat16_decode_graphs_agree_with_eager_steps(quantization, checkpoint):
    """In bfloat16 graphs and eager steps split attention differently: their first tokens'
    log-probabilities must agree closely."""
    model_dir = str(checkpoint("llama"))
    prompts = random_prompts([40, 7], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    engine = dict(device="cuda", dtype="bfloat16", verbose=False, num_kv_blocks=128, quantization=quantization)
    graphs = LLM(model_dir, **engine).generate(prompts, params)
    eager = LLM(model_dir, enforce_eager=True, **engine).generate(prompts, params)
    for a, b in zip(graphs, eager):
        torch.testing.assert_close(torch.tensor(a.logprobs[0]), torch.tensor(b.logprobs[0]), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_bfloat16_engines_multiply_through_torchs_kernels_in_their_graphs(quantization, checkpoint):
    """Wide enough for tinygemm (K a multiple of 128): every packed layer carries the torch
    kernel's form (tinygemm from compute capability 8.0, _scaled_mm from 8.9), and decode graphs,
    which take it at their batches, give the eager steps' first-token log-probabilities."""
    from cluster.engine.models.layers import ShardedLinear

    needs = (8, 0) if quantization == "int4" else (8, 9)
    if torch.cuda.get_device_capability() < needs:
        pytest.skip(f"{quantization}'s torch kernel needs compute capability {needs}")
    model_dir = str(checkpoint("llama", hidden_size=128, intermediate_size=256))
    prompts = random_prompts([40, 7], seed=5)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    engine = dict(device="cuda", dtype="bfloat16", verbose=False, num_kv_blocks=128, quantization=quantization)
    llm = LLM(model_dir, **engine)
    parts = [part for module in llm.engine.runner.model.modules() if isinstance(module, ShardedLinear)
             for _, part in module.packed]
    assert parts and all(part.kernel_form is not None for part in parts)
    graphs = llm.generate(prompts, params)
    eager = LLM(model_dir, enforce_eager=True, **engine).generate(prompts, params)
    for a, b in zip(graphs, eager):
        torch.testing.assert_close(torch.tensor(a.logprobs[0]), torch.tensor(b.logprobs[0]), atol=0.05, rtol=0.05)
