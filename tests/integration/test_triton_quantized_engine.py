"""An engine on the Triton backend multiplies packed weights with the Triton kernel and gives the
CPU path's greedy tokens (float32: both take exact float32 products of the same weights).

Without CUDA the kernels run under Triton's CPU interpreter (the decode "graphs" then run their
buffers eagerly); with CUDA, natively. Two models: a tiny GGUF whose layers mix Q8_0, Q4_1 (v)
and Q5_1 (down: a byte a weight with a min) and whose output head is packed, and the float
checkpoint quantized at load to fp8. Kept small: the interpreter is slow.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from cluster.engine.config import EngineConfigError  # noqa: E402
from cluster.engine.kernels import triton_quantized_matmul  # noqa: E402
from cluster.engine.models.layers import ShardedLinear  # noqa: E402
from cluster.engine.sampling_params import SamplingParams  # noqa: E402
from cluster.offline.llm import LLM  # noqa: E402
from conftest import random_prompts  # noqa: E402
from gguf_files import write_gguf  # noqa: E402

pytestmark = pytest.mark.integration

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 3, 4)]
ENGINE = dict(verbose=False, dtype="float32", num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=4)


@pytest.fixture(scope="module")
def mixed_gguf(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-mixed") / "tiny-llama.gguf"
    return write_gguf(checkpoint("llama"), out, Q.Q8_0, leaf_qtypes=(("attn_v", Q.Q4_1), ("ffn_down", Q.Q5_1)))


def greedy(path, **engine) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), **{**ENGINE, **engine})
    outputs = llm.generate(random_prompts([1, 9, 40], seed=5), PARAMS)
    return llm, [o.token_ids for o in outputs]


def count_kernel_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    original = triton_quantized_matmul.quantized_matmul_into
    monkeypatch.setattr(triton_quantized_matmul, "quantized_matmul_into",
                        lambda x, *args, **kwargs: calls.append(x.shape[0]) or original(x, *args, **kwargs))
    return calls


@pytest.mark.parametrize("model", ["gguf", "fp8"])
def test_the_triton_kernel_gives_the_cpu_paths_greedy_tokens(model, mixed_gguf, checkpoint, monkeypatch):
    path, quantization = (mixed_gguf, "auto") if model == "gguf" else (checkpoint("llama"), "fp8")
    _, expected = greedy(path, quantization=quantization, attention_backend="torch")
    calls = count_kernel_calls(monkeypatch)
    llm, tokens = greedy(path, quantization=quantization, attention_backend="triton", device=DEVICE)
    model_ = llm.engine.runner.model
    linears = [m for m in model_.modules() if isinstance(m, ShardedLinear)]
    assert linears and all(m.packed and m.triton_matmul for m in linears)
    assert all(part.codes.device.type == DEVICE for m in linears for _, part in m.packed)
    if model == "gguf":
        qkv = model_.model.layers[0].self_attn.qkv_proj
        assert [part.layout for _, part in qkv.packed] == ["q8", "q4"]
        assert model_.model.layers[0].mlp.down_proj.packed[0][1].mins is not None
        assert model_.lm_head.packed is not None and model_.lm_head.triton_matmul
    assert calls and min(calls) <= 4 and max(calls) == 32, "decode steps and prompt chunks take the Triton kernel"
    assert tokens == expected


def test_quantizing_at_load_on_cudas_torch_backend_is_refused_in_one_line(checkpoint):
    with pytest.raises(EngineConfigError, match=r"^quantization int8 on cuda runs on the Triton kernels: set "
                       r"attention_backend to auto or triton \(it is torch\), or quantization to none$"):
        LLM(str(checkpoint("llama")), verbose=False, device="cuda", attention_backend="torch", quantization="int8")


def test_the_warm_up_runs_the_prompt_tiles_and_writes_no_kv(mixed_gguf, monkeypatch):
    """On CUDA the runner compiles the kernels at start-up; with packed weights that includes a
    prompt chunk longer than a decode tile. Here under the interpreter: the cache stays untouched."""
    llm = LLM(str(mixed_gguf), attention_backend="triton", enforce_eager=True, device=DEVICE, **ENGINE)
    runner = llm.engine.runner
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=torch.Generator().manual_seed(0)))
    before = runner.kv_cache.clone()
    calls = count_kernel_calls(monkeypatch)
    runner.warm_up_kernels()
    assert torch.equal(runner.kv_cache, before)
    assert max(calls) == triton_quantized_matmul.DECODE_ROWS + 1
