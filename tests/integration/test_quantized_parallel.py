"""Tensor parallelism over weights kept quantized (GGUF blocks repacked, ``quantization: auto``
on the CPU): greedy tokens of a TP 2 engine, and of prefill TP 2 -> decode TP 1, equal the same
file run colocated on one rank (whose decode steps take the fused CPU step, while TP ranks run
the torch path) — exactly, token ids. Each rank's packed shard is the same codes and scales as
its rows (column-parallel) or columns (row-parallel) of the whole weight; a row-parallel cut that
does not fall on the kernel's 32-column blocks widens that layer on the rank instead.

Three tiny files: Q8_0 (a vocabulary of 513 that splits unevenly, so the last rank's tables are
padded; an MLP of 96, so down_proj's cut at 48 columns is widened while o_proj's at 32 stays
packed), Q4_K (Qwen2: a tied, packed output head, QKV biases), and a Q4_K_M-like mix (Q6_K
embedding, V and down projections under Q4_K: q4 and q8 blocks in one fused layer). Weights
quantized at load (``int8``/``int4``) give TP 1's tokens too, also where a row-parallel cut runs
through a quantization group.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from cluster.engine.models.layers import ParallelGroup, ShardedLinear, VocabParallelEmbedding
from cluster.engine.models.loader import build_model
from cluster.engine.models.read_config import load_model_config
from cluster.engine.quantization.packed import PackedWeight
from cluster.engine.sampling_params import SamplingParams
from cluster.offline.disaggregated import DisaggregatedLLM
from cluster.runtime.ray_runtime import ensure_ray
from conftest import random_prompts
from gguf_files import write_gguf
from reference_checks import PROMPT_LENGTHS, MAX_TOKENS, run_batch

pytestmark = pytest.mark.integration

CLUSTER = "tandem-quantized-tp-tests"
TP = 2
WIDE = dict(hidden_size=256, intermediate_size=512)  # K-quant blocks hold 256 values: rows that long
Q4_K_M = dict(embedding_qtype=Q.Q6_K, leaf_qtypes=(("attn_v", Q.Q6_K), ("ffn_down", Q.Q6_K)))
MODELS = {
    "Q8_0": ("llama", dict(vocab_size=513, intermediate_size=96), Q.Q8_0, {}),
    "Q4_K": ("qwen2", WIDE, Q.Q4_K, {}),
    "Q4_K_M": ("llama", WIDE, Q.Q4_K, Q4_K_M),
}
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray = ensure_ray(CLUSTER, num_cpus=8)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    """``quantized("Q8_0")`` -> (the GGUF file, the colocated TP 1 run's greedy tokens), each built once."""
    built: dict[str, tuple] = {}

    def make(name: str):
        if name not in built:
            architecture, sizes, qtype, options = MODELS[name]
            path = write_gguf(checkpoint(architecture, **sizes), tmp_path_factory.mktemp(f"tp-{name}") / f"{name}.gguf",
                              qtype, **options)
            built[name] = path, run_batch(path).tokens
        return built[name]

    return make


@pytest.mark.parametrize("name", MODELS)
def test_tp2_tokens_equal_colocated(quantized, name):
    path, colocated = quantized(name)
    tp2 = run_batch(path, tensor_parallel_size=TP, cluster_name=CLUSTER, engine_name=f"qtp-{next(_names)}")
    assert tp2.tokens == colocated


@pytest.mark.parametrize("name", MODELS)
def test_prefill_tp2_to_decode_tp1_equals_colocated(quantized, name):
    path, colocated = quantized(name)
    with DisaggregatedLLM.from_args(str(path), cluster_name=CLUSTER, prefill_tp=TP, decode_tp=1, num_kv_blocks=64,
                                    max_num_batched_tokens=96, local_prefill_max_tokens=0, verbose=False) as llm:
        outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=1),
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(PROMPT_LENGTHS)
        assert [o.token_ids for o in outputs] == colocated
        assert len(llm.transfers) == len(PROMPT_LENGTHS)  # every prompt's KV came from the TP 2 prefill group


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_an_8bit_kv_cache_travels_8bit_from_prefill_tp2_to_decode_tp1(quantized, kv_cache_dtype):
    """The KV moves as the cache holds it (codes with their scales, re-sharded by head from two
    prefill ranks to one decode rank): 68 bytes a 64-wide head row, against 256 in float32. The
    decode worker continues exactly as one engine with the same cache does: every attention path
    attends to keys and values as the cache holds them (a prompt chunk to its own keys too), so
    where the two runs cut a prompt into chunks does not change its tokens."""
    path, _ = quantized("Q8_0")
    config = load_model_config(path)
    row_bytes = config.head_dim + 4
    block_bytes = 2 * config.num_layers * 16 * config.num_kv_heads * row_bytes
    with DisaggregatedLLM.from_args(str(path), cluster_name=CLUSTER, prefill_tp=TP, decode_tp=1, num_kv_blocks=64,
                                    max_num_batched_tokens=96, local_prefill_max_tokens=0, verbose=False,
                                    kv_cache_dtype=kv_cache_dtype) as llm:
        outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=1),
                               SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [(o.finish_reason, o.error) for o in outputs] == [("length", None)] * len(PROMPT_LENGTHS)
        transfers = list(llm.transfers)
    assert len(transfers) == len(PROMPT_LENGTHS)
    assert all(t.blocks_sent > 0 and t.bytes == t.blocks_sent * block_bytes for t in transfers)
    assert [o.token_ids for o in outputs] == run_batch(path, kv_cache_dtype=kv_cache_dtype).tokens


# -- each rank's packed shard against the whole weight ---------------------------------------------


def _rows_of(layer: ShardedLinear, rows: torch.Tensor) -> PackedWeight:
    """Rows ``rows`` of a whole packed layer (they lie in one of its row blocks)."""
    for first, part in layer.packed:
        if first <= int(rows.min()) and int(rows.max()) < first + part.rows:
            return part.take_rows(rows - first)
    raise AssertionError(f"rows {rows.tolist()} span row blocks of different kinds")


def _assert_same_packed(ours: PackedWeight, expected: PackedWeight, what: str) -> None:
    assert (ours.layout, ours.group, ours.shape) == (expected.layout, expected.group, expected.shape), what
    for field in ("codes", "scales", "mins"):
        a, b = getattr(ours, field), getattr(expected, field)
        assert (a is None and b is None) or torch.equal(a, b), f"{what}: {field}"


def _column_parallel_rows(name: str, config, rank: int) -> torch.Tensor:
    """The whole layer's output rows that rank ``rank`` of TP keeps (q, k, v or gate, up, each cut in TP)."""
    if name.endswith("qkv_proj"):
        parts = [(0, config.q_size), (config.q_size, config.kv_size), (config.q_size + config.kv_size, config.kv_size)]
    else:
        parts = [(0, config.intermediate_size), (config.intermediate_size, config.intermediate_size)]
    return torch.cat([torch.arange(start + rank * size // TP, start + (rank + 1) * size // TP)
                      for start, size in parts])


def _check_linear(name: str, whole: ShardedLinear, shard: ShardedLinear, config, rank: int) -> str:
    """Compares one layer's shard with the whole; returns "packed" or "widened"."""
    if name.endswith(("o_proj", "down_proj")):  # row-parallel: this rank's columns
        width = whole.packed[0][1].cols // TP
        start = rank * width
        dense = torch.cat([part.dequantize() for _, part in whole.packed])[:, start:start + width]
        if width % 32:
            assert shard.packed == () and torch.equal(shard.weight, dense), name
            x = torch.randn(2, width * TP, generator=torch.Generator().manual_seed(rank))
            torch.testing.assert_close(shard._matmul(x[:, start:start + width]), x[:, start:start + width] @ dense.T)
            return "widened"
        for first, part in shard.packed:
            expected = _rows_of(whole, torch.arange(first, first + part.rows)).col_slice(start, width)
            _assert_same_packed(part, expected, name)
        return "packed"
    rows = _column_parallel_rows(name, config, rank)
    assert sum(part.rows for _, part in shard.packed) == len(rows), name
    for first, part in shard.packed:
        _assert_same_packed(part, _rows_of(whole, rows[first:first + part.rows]), name)
    return "packed"


@pytest.mark.parametrize("name", MODELS)
def test_each_rank_keeps_its_slices_of_the_packed_weights(checkpoint, tmp_path, name):
    architecture, sizes, qtype, options = MODELS[name]
    path = write_gguf(checkpoint(architecture, **sizes), tmp_path / f"{name}.gguf", qtype, **options)
    config = replace(load_model_config(path), quantization="gguf")
    whole = build_model(config, path)
    linears: set[tuple[str, str]] = set()  # (leaf name, "packed" or "widened")
    tables: set[str] = set()
    for rank in range(TP):
        shard = build_model(config, path, group=ParallelGroup(rank=rank, size=TP))
        shards = dict(shard.named_modules())
        for module_name, module in whole.named_modules():
            if isinstance(module, ShardedLinear):
                how = _check_linear(module_name, module, shards[module_name], config, rank)
                linears.add((module_name.rsplit(".", 1)[-1], how))
            elif isinstance(module, VocabParallelEmbedding):
                table = shards[module_name]
                per_rank = -(-config.vocab_size // TP)
                rows = torch.arange(rank * per_rank, min((rank + 1) * per_rank, config.vocab_size))
                _assert_same_packed(table.packed.row_slice(0, len(rows)), module.packed.take_rows(rows), module_name)
                padding = table.packed.row_slice(len(rows), per_rank - len(rows))
                assert not padding.codes.any() and not padding.scales.any(), f"{module_name}: padding rows"
                tables.add(module_name)
    assert tables == {"model.embed_tokens", "lm_head"}
    down = "widened" if config.intermediate_size // TP % 32 else "packed"
    assert linears == {("qkv_proj", "packed"), ("o_proj", "packed"), ("gate_up_proj", "packed"), ("down_proj", down)}


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("sizes", [{}, dict(intermediate_size=96)], ids=["aligned", "down-cut-at-48"])
def test_load_time_quantization_tp2_equals_colocated(checkpoint, kind, sizes):
    """Where a rank's columns cut a weight's groups it keeps them widened (float32 products), so the
    cut case compares float32 kernels; the aligned one runs the default (bfloat16 dot products for
    int4 where the CPU has them) on both sides."""
    model_dir = checkpoint("llama", **sizes)
    kernel = {"cpu_matmul_dtype": "float32"} if sizes else {}
    tp2 = run_batch(model_dir, quantization=kind, tensor_parallel_size=TP, cluster_name=CLUSTER,
                    engine_name=f"qtp-{next(_names)}", **kernel)
    assert tp2.tokens == run_batch(model_dir, quantization=kind, **kernel).tokens


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("tp_size,packed", [(2, True), (4, False)])
def test_a_row_parallel_rank_of_a_load_time_quantized_weight_holds_the_whole_weights_values(kind, tp_size, packed):
    """Columns 64 / tp_size wide: 32 stay packed, 16 (a cut through a group of 32) are kept widened
    with the values quantizing the whole weight gives them, not quantized on their own (fp8: with
    the scale of each whole row)."""
    from cluster.engine.models.layers import RowParallelLinear
    from cluster.engine.quantization.quantize import quantize

    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    whole = quantize(weight, kind).dequantize()
    width = 64 // tp_size
    for rank in range(tp_size):
        layer = RowParallelLinear(64, 8, group=ParallelGroup(rank=rank, size=tp_size), quantization=kind)
        layer.weight_loader(layer.weight, weight)
        layer.finish_loading()
        ours = layer.packed[0][1].dequantize() if packed else layer.weight
        assert bool(layer.packed) == packed
        assert torch.equal(ours, whole[:, rank * width:(rank + 1) * width])
