"""Step times by roofline, for hardware no cluster has run on yet: a GPU's FLOP/s and memory
bandwidth with a model's shape give the coefficients of the router's ``StepTimeModel``.

For a worker of TP degree ``t`` (each rank holds 1/t of the weights and of the KV heads):

    prefill step = overhead + weights/t / bandwidth            (read once per step)
                 + tokens x (2 x params / t / FLOP/s + all-reduces)
                 + attention units x 4 x layers x q heads x head dim / t / FLOP/s
    decode step  = overhead + weights/t / bandwidth
                 + sequences x (2 x params / t / FLOP/s + all-reduces)
                 + context tokens x KV bytes per token / t / bandwidth
    transfer     = per KV block, its last layer's share over the link (layers are streamed
                   while later ones compute, so only the last one is a tail)

FLOP/s and bandwidth are derated by ``mfu`` and ``mbu`` (what kernels reach in practice).
The KV blocks a worker holds: the GPUs' memory times ``memory_fraction``, less the weights.
KV bytes per token are those of the cache's dtype (``kv_cache_dtype``, the topology's
``kv.cache_dtype``): an 8-bit cache holds ``head_dim + 4`` bytes a token and head against
``2 x head_dim`` in 16 bits (:func:`cluster.engine.quantization.kv_format.row_bytes`), so it
holds about twice the blocks, reads about half the bytes a decode step and sends half a transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.quantization.kv_format import row_bytes
from cluster.plan.errors import RooflineError
from cluster.plan.simulator import WorkerSpec
from router.cost_model import StepTimeModel


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense 16-bit FLOP/s of one device
    bandwidth: float  # memory bytes/s of one device
    memory: float  # bytes of one device
    link: float = 400e9  # bytes/s between devices of a TP group (all-reduces)
    kv_link: float = 50e9  # bytes/s of a KV transfer between workers
    mfu: float = 0.55
    mbu: float = 0.8
    step_overhead_s: float = 0.004  # host work of one step: scheduling, sampling, launches


HARDWARE = {
    "h100": Hardware("h100", 989e12, 3.35e12, 80e9),
    "h200": Hardware("h200", 989e12, 4.8e12, 141e9),
    "a100": Hardware("a100", 312e12, 2.0e12, 80e9, link=300e9, kv_link=25e9),
    "l40s": Hardware("l40s", 362e12, 0.864e12, 48e9, link=32e9, kv_link=12e9),
    "l4": Hardware("l4", 121e12, 0.3e12, 24e9, link=32e9, kv_link=12e9),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int = 2  # of the weights and activations, and of a cache in the model's dtype
    kv_cache_dtype: str = "auto"  # auto (bytes_per_element), int8 or fp8_e4m3

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_element

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * row_bytes(self.kv_cache_dtype, self.head_dim, self.bytes_per_element)


MODELS = {
    "llama-3-8b": ModelShape("llama-3-8b", 8.03e9, 32, 4096, 32, 8, 128),
    "llama-3-70b": ModelShape("llama-3-70b", 70.6e9, 80, 8192, 64, 8, 128),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 7.6e9, 28, 3584, 28, 4, 128),
    "mistral-7b": ModelShape("mistral-7b", 7.24e9, 32, 4096, 32, 8, 128),
}


def hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name]
    except KeyError:
        raise RooflineError(f"--hardware: unknown {name!r}; known: {', '.join(HARDWARE)}") from None


def model_shape(name_or_path: str) -> ModelShape:
    """A named shape, or one read from a local model (its config, parameters counted)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    from pathlib import Path

    if not Path(name_or_path).expanduser().exists():
        raise RooflineError(f"--model-shape: {name_or_path!r} is neither a known shape ({', '.join(MODELS)}) nor a "
                            f"local model")
    from cluster.engine.models.read_config import load_model_config

    c = load_model_config(Path(name_or_path).expanduser())
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * \
        c.intermediate_size
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    element = 4 if str(c.dtype).endswith("float32") else 2
    return ModelShape(Path(name_or_path).name, per_layer * c.num_layers + embeddings, c.num_layers, c.hidden_size,
                      c.num_heads, c.num_kv_heads, c.head_dim, element)


def step_model(hw: Hardware, shape: ModelShape, tp: int = 1, block_size: int = 16,
               max_num_batched_tokens: int = 2048) -> StepTimeModel:
    flops, bandwidth = hw.flops * hw.mfu * tp, hw.bandwidth * hw.mbu * tp
    weights_s = shape.weight_bytes / bandwidth
    per_token = 2 * shape.params / flops
    if tp > 1:  # two all-reduces of the hidden state per layer, ring: 2 (t-1)/t of it each
        per_token += 2 * shape.layers * shape.hidden * shape.bytes_per_element * 2 * (tp - 1) / tp / hw.link
    attention = 4 * shape.layers * shape.heads * shape.head_dim / flops
    kv_read = shape.kv_bytes_per_token / bandwidth
    block_last_layer = block_size * shape.kv_bytes_per_token / shape.layers
    a = hw.step_overhead_s + weights_s
    return StepTimeModel(prefill=(a, per_token, attention), decode=(a, per_token, kv_read),
                         transfer_s_per_block=block_last_layer / hw.kv_link,
                         max_num_batched_tokens=max_num_batched_tokens)


def worker_spec(hw: Hardware, shape: ModelShape, tp: int = 1, block_size: int = 16, memory_fraction: float = 0.9,
                max_num_batched_tokens: int = 2048, max_num_seqs: int = 256, max_model_len: int = 8192) -> WorkerSpec:
    free = hw.memory * tp * memory_fraction - shape.weight_bytes
    blocks = int(free // (block_size * shape.kv_bytes_per_token))
    if blocks < 1:
        raise RooflineError(f"{shape.name} does not fit on {tp} {hw.name} GPU(s) with room for a KV block; "
                            f"raise the TP degree")
    return WorkerSpec(step_model(hw, shape, tp, block_size, max_num_batched_tokens), blocks, block_size,
                      max_num_batched_tokens, max_num_seqs, max_model_len, tp=tp)
