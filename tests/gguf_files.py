"""Tiny GGUF files written the way llama.cpp's converter writes them, from a random-weight
``transformers`` checkpoint (see conftest.build_checkpoint), with ``gguf.GGUFWriter``.

Weights are quantized with ``gguf.quants.quantize`` where the package implements the type. It
has no quantizer for the K-quants, so for those each block gets random quantized values and
scales (valid blocks of the real layout, with scales small enough for a sane model): both
engines then read the same bytes, and the dequantization itself is checked against
``transformers``' own (torch) dequantizer in test_gguf_tensors.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, get_tensor_name_map, quants
from gguf.constants import GGML_QUANT_SIZES, MODEL_ARCH

CONTROL, NORMAL = 3, 1

# ggml type -> offsets (in a block) of its float16 scale fields, for the K-quants written at random.
K_QUANT_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}
_ARCH = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3}


def random_k_blocks(rows: int, cols: int, qtype: Q, seed: int, scale: float = 2e-4) -> np.ndarray:
    """``rows`` rows of valid ``qtype`` blocks: random quantized values and sub-block scales, and
    the block's float16 super-scales set to about ``scale``."""
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        d = (rng.uniform(0.5, 1.5, size=blocks.shape[:2]) * scale).astype(np.float16)
        blocks[:, :, offset:offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def encode_tensor(values: np.ndarray, qtype: Q, seed: int = 0) -> np.ndarray:
    """The bytes (or float array) GGUFWriter.add_tensor takes for ``values`` stored as ``qtype``."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in K_QUANT_SCALES:
        return random_k_blocks(values.shape[0], values.shape[1], qtype, seed)
    return quants.quantize(values, qtype)


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of a Llama Q or K weight (interleaved rotary halves)."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _vocabulary(checkpoint: Path) -> tuple[list[str], list[int], list[str]]:
    raw = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in raw.get("added_tokens", []) if t.get("special")}
    types = [CONTROL if t in special else NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    return tokens, types, merges


def write_gguf(
    checkpoint: Path,
    out: Path,
    qtype: Q = Q.F32,
    embedding_qtype: Q | None = None,
    leaf_qtypes: tuple[tuple[str, Q], ...] = (),
    pre: str = "gpt2",
    chat_template: str | None = None,
    add_bos: bool = False,
    bos_token_id: int | None = 2,
    eos_token_id: int = 3,
) -> Path:
    """Writes the checkpoint at ``checkpoint`` as a GGUF file ``out``: 2-D weights as ``qtype``
    (the embedding as ``embedding_qtype``, default ``qtype``; a tensor whose name's leaf is named
    in ``leaf_qtypes``, e.g. ``("attn_v", Q.Q6_K)``, as that type, as llama.cpp's mixes do), norms as F32."""
    from safetensors.numpy import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
        config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    layers = config["num_hidden_layers"]
    rope = config.get("rope_parameters") or {}
    writer = GGUFWriter(str(out), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config["vocab_size"])
    tokens, types, merges = _vocabulary(checkpoint)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos_token_id is not None:
        writer.add_bos_token_id(bos_token_id)
    writer.add_eos_token_id(eos_token_id)
    writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    names = get_tensor_name_map(_ARCH[arch], layers)
    weights = load_file(str(checkpoint / "model.safetensors"))
    for index, (hf_name, value) in enumerate(sorted(weights.items())):
        stem, kind = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(stem)}.{kind}"
        value = value.astype(np.float32)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            value = llama_cpp_permute(value, heads if ".attn_q." in gguf_name else kv_heads)
        if value.ndim == 1:
            writer.add_tensor(gguf_name, value)
            continue
        chosen = embedding_qtype if gguf_name.startswith("token_embd") and embedding_qtype is not None else qtype
        chosen = dict(leaf_qtypes).get(gguf_name.split(".")[-2], chosen)
        data = encode_tensor(value, chosen, seed=index)
        writer.add_tensor(gguf_name, data, raw_dtype=None if chosen in (Q.F32, Q.F16) else chosen)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
