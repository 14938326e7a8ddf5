"""Tensor parallelism on the CPU with gloo: ranks 1..N-1 are Ray actors, rank 0 is this process.

Greedy tokens with TP 2 (and 4) must equal TP 1's and match ``transformers``; every block must
be free afterwards; a degree that cannot split the model is refused before any process starts;
and a rank reads only its own shard of each tensor.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cluster.engine.config import EngineConfigError
from cluster.offline.llm import LLM
from cluster.engine.models.read_config import load_model_config
from cluster.engine.models.layers import ParallelGroup
from cluster.engine.models.loader import build_model
from cluster.runtime.ray_runtime import ensure_ray
from conftest import ARCHITECTURES
from reference_checks import assert_batch_matches_reference, run_batch

pytestmark = pytest.mark.integration

CLUSTER = "tandem-tp-tests"
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray = ensure_ray(CLUSTER, num_cpus=4)
    yield ray
    ray.shutdown()


def tp_args(tp: int) -> dict:
    return {"tensor_parallel_size": tp, "cluster_name": CLUSTER, "engine_name": f"tp-test-{next(_names)}"}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tp2_matches_tp1_and_transformers(architecture, checkpoint, reference_model):
    model_dir = checkpoint(architecture)
    tp2 = assert_batch_matches_reference(model_dir, reference_model(model_dir), f"{architecture} TP 2", **tp_args(2))
    assert tp2 == run_batch(model_dir).tokens


def test_tp4_replicates_kv_heads(checkpoint):
    """4 query heads and 2 KV heads over 4 ranks: each KV head lives on two ranks."""
    model_dir = checkpoint("qwen2")
    assert run_batch(model_dir, **tp_args(4)).tokens == run_batch(model_dir).tokens


def test_tp2_under_preemption_without_chunked_prefill(checkpoint):
    model_dir = checkpoint("llama")
    squeezed = {"num_kv_blocks": 14, "enable_chunked_prefill": False, "max_num_batched_tokens": 256}
    squeezed_run = run_batch(model_dir, **squeezed, **tp_args(2))
    assert squeezed_run.preemptions > 0
    assert squeezed_run.tokens == run_batch(model_dir).tokens


def test_degree_that_does_not_divide_the_model_is_refused(checkpoint):
    with pytest.raises(EngineConfigError, match=r"tensor-parallel size 3 does not divide this model's 4 attention heads"):
        LLM(str(checkpoint("llama")), verbose=False, num_kv_blocks=8, tensor_parallel_size=3, cluster_name=CLUSTER)


def test_each_rank_reads_only_its_shard(checkpoint, monkeypatch):
    """The loader hands each parameter a safetensors slice; count what a rank actually reads."""
    import cluster.engine.models.hf_checkpoint as checkpoint_module

    read: dict[str, int] = {}
    real_safe_open = checkpoint_module.safe_open

    class CountingSlice:
        def __init__(self, name, inner):
            self.name, self.inner = name, inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            out = self.inner[index]
            read[self.name] = read.get(self.name, 0) + out.numel()
            return out

    class CountingFile:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return CountingSlice(name, self.file.get_slice(name))

    monkeypatch.setattr(checkpoint_module, "safe_open", CountingFile)
    model_dir = checkpoint("qwen2")
    config = load_model_config(model_dir, None)
    build_model(config, model_dir, group=ParallelGroup(rank=1, size=2))
    full = {name: torch.Size(shape).numel() for name, shape in _shapes(model_dir).items()}
    for name in ("q_proj.weight", "k_proj.weight", "o_proj.weight", "gate_proj.weight", "down_proj.weight", "embed_tokens"):
        for tensor, count in read.items():
            if name in tensor:
                assert count == full[tensor] // 2, f"{tensor}: read {count} of {full[tensor]} elements"
    assert read["model.norm.weight"] == full["model.norm.weight"], "replicated tensors are read whole"


def _shapes(model_dir) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {name: f.get_slice(name).get_shape() for name in f.keys()}


def test_gguf_tp2_equals_tp1(checkpoint, tmp_path):
    """A quantized GGUF split over two ranks gives TP 1's tokens."""
    from gguf import GGMLQuantizationType

    from gguf_files import write_gguf

    path = write_gguf(checkpoint("qwen2"), tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0)
    assert run_batch(path, **tp_args(2)).tokens == run_batch(path).tokens


@pytest.mark.parametrize("method,options", [("awq", {}), ("fp8", {"block": (128, 128)})], ids=["awq", "fp8"])
def test_quantized_hf_checkpoint_tp2_equals_tp1(checkpoint, tmp_path, method, options):
    """A Hugging Face AWQ or FP8 checkpoint split over two ranks, each repacking only its rows or
    columns, gives TP 1's tokens."""
    from hf_quantized_files import write_quantized

    path = tmp_path / method
    write_quantized(checkpoint("llama", hidden_size=256, intermediate_size=512), path, method, **options)
    assert run_batch(path, **tp_args(2)).tokens == run_batch(path).tokens


def test_gguf_rank_dequantizes_only_the_rows_it_keeps(checkpoint, tmp_path, monkeypatch):
    """Rank 1 of 2 dequantizes half the rows of each column-parallel weight (whole rows of a
    row-parallel one, whose columns it then keeps half of), and keeps half of each."""
    import gguf.quants
    from gguf import GGMLQuantizationType

    from gguf_files import write_gguf

    path = write_gguf(checkpoint("llama"), tmp_path / "tiny.gguf", GGMLQuantizationType.Q4_0)
    rows: dict[int, int] = {}
    real = gguf.quants.dequantize

    def counting(data, qtype):
        out = real(data, qtype)
        if out.ndim == 2:  # norms are vectors, read whole
            rows[out.shape[1]] = rows.get(out.shape[1], 0) + out.shape[0]
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    config = load_model_config(path)
    model = build_model(config, path, group=ParallelGroup(rank=1, size=2))
    layers = config.num_layers
    # Rows of hidden-size width: q, k, v, gate and up (half each), the embedding and the output
    # head (half each), and o_proj's rows (all of them: its columns are split).
    q, kv, mlp = config.q_size, config.kv_size, config.intermediate_size
    assert not config.tie_word_embeddings
    assert rows[config.hidden_size] == layers * ((q + 2 * kv + 2 * mlp) // 2 + config.hidden_size) + config.vocab_size
    assert rows[config.intermediate_size] == layers * config.hidden_size  # down_proj: whole rows
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.weight.shape[0] == (q + 2 * kv) // 2
    assert attention.o_proj.weight.shape[1] == q // 2
    assert model.model.embed_tokens.weight.shape[0] == config.vocab_size // 2


def test_tp2_partial_prefix_hits_copy_every_ranks_kv(checkpoint):
    """A partial hit's block copy travels in the step's plan: each rank copies its own shard, so
    a repeated prompt (all of it but its last token from the cache) gives TP 1's tokens."""
    from cluster.engine.sampling_params import SamplingParams
    from conftest import random_prompts

    model_dir = str(checkpoint("llama"))
    prompt = random_prompts([45], seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(model_dir, verbose=False, num_kv_blocks=64, enable_prefix_caching=False) as alone:
        expected = alone.generate([prompt], params)[0].token_ids
    with LLM(model_dir, verbose=False, num_kv_blocks=64, **tp_args(2)) as llm:
        first = llm.generate([prompt], params)[0]
        again = llm.generate([prompt], params)[0]
    assert (first.usage.cached_tokens, again.usage.cached_tokens) == (0, 44)
    assert first.token_ids == again.token_ids == expected
