"""GGUF checkpoints: the model's description from the file's metadata, and its tensors under
the Hugging Face names our model tree uses, dequantized on demand.

A GGUF stores each matrix as rows of quantization blocks (the blocks run along a row), so a
tensor-parallel rank that keeps some rows dequantizes only those; one that keeps some columns
dequantizes whole rows and keeps its columns. Dequantization is ``gguf.quants.dequantize`` (F32,
F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants among others), to float32, then cast to
the engine's dtype.

llama.cpp's converter reorders the rows of a Llama model's Q and K projections within each head
(it interleaves the two rotary halves, for its own rotary kernel); :func:`unpermute_rows` gives
the order back, so our rotary (the "rotate half" convention) sees what a Hugging Face checkpoint
holds. Qwen2 files are not reordered.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from cluster.engine.models.config import ModelConfig, ModelConfigError, RopeConfig, parse_dtype
from cluster.engine.models.gguf_index import read_index
from cluster.engine.quantization.gguf_repack import repack, repackable
from cluster.engine.quantization.packed import PackedWeight

# general.architecture -> (our architecture name, family)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Tensors outside the blocks, GGUF name -> ours.
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Tensors of block N, GGUF leaf -> ours under model.layers.N.
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# Not parameters: rope_freqs holds llama3-style rotary frequency factors (read into the config).
_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})

_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


class GGUFError(ModelConfigError):
    """The GGUF file cannot be read, or describes what we do not support."""


def hf_tensor_name(gguf_name: str) -> str | None:
    """Our parameter name for a GGUF tensor name, or None when we do not know the tensor."""
    match = _BLOCK_NAME.match(gguf_name)
    if match:
        layer, leaf, kind = match.groups()
        target = _BLOCK_TENSORS.get(leaf)
        return f"model.layers.{layer}.{target}.{kind}" if target else None
    match = _GLOBAL_NAME.match(gguf_name)
    if match and match.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[match.group(1)]}.{match.group(2)}"
    return None


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """For each row of the Hugging Face Q or K weight, the row of the GGUF tensor that holds it.

    Within a head of ``2 * half`` rows, llama.cpp stores HF row ``j * half + i`` (rotary half j,
    frequency i) at row ``2 * i + j``.
    """
    half = num_rows // num_heads // 2
    rows = np.arange(num_rows)
    head, within = rows // (2 * half), rows % (2 * half)
    rotary_half, frequency = within // half, within % half
    return head * 2 * half + 2 * frequency + rotary_half


class GGUFTensorSlice:
    """One GGUF tensor, read like a safetensors slice: ``get_shape()`` in torch order, and
    ``[rows]`` or ``[:, cols]`` returning a torch tensor of ``dtype`` with only what was asked
    dequantized (whole rows for a column slice)."""

    def __init__(self, tensor: Any, dtype: torch.dtype, row_order: np.ndarray | None = None):
        self.tensor = tensor
        self.dtype = dtype
        self.row_order = row_order
        self.shape = [int(n) for n in reversed(list(tensor.shape))]  # ggml lists the innermost first

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _rows(self, index: Any) -> tuple[np.ndarray, slice, slice]:
        """The raw rows ``index`` asks for (in Hugging Face order), and its row and column parts."""
        index = index if isinstance(index, tuple) else (index,)
        rows, cols = index[0], (index[1] if len(index) > 1 else slice(None))
        data = self.tensor.data
        if self.row_order is not None:
            data = data[self.row_order[rows]]
        elif rows != slice(None):
            data = data[rows]
        return np.ascontiguousarray(data), rows, cols

    def packed(self, index: Any) -> PackedWeight | None:
        """``self[index]`` kept quantized (:mod:`cluster.engine.quantization.gguf_repack`), or
        None when the type has no packed layout or a column cut does not fall on its groups."""
        if len(self.shape) != 2 or not repackable(self.tensor.tensor_type):
            return None
        data, _, cols = self._rows(index)
        weight = repack(data, self.tensor.tensor_type)
        if cols == slice(None):
            return weight
        start, stop, _ = cols.indices(self.shape[1])
        try:
            return weight.col_slice(start, stop - start)
        except ValueError:
            return None

    def __getitem__(self, index: Any) -> torch.Tensor:
        from gguf.quants import dequantize

        data, rows, cols = self._rows(index)
        values = dequantize(data, self.tensor.tensor_type)
        if values.dtype != np.float32 or not values.flags.writeable:  # F32 comes back as the file's read-only map
            values = values.astype(np.float32)
        values = values.reshape([len(range(*rows.indices(self.shape[0])))] + self.shape[1:])
        out = torch.from_numpy(values)
        if cols != slice(None):
            out = out[:, cols]
        return out.to(self.dtype)


class GGUFCheckpoint:
    """An open GGUF file: metadata by key, the model config, the tensors under our names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            index = read_index(self.path)
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({exc})") from None
        self.metadata = index.metadata
        self.all_tensors = index.tensors()
        self.tensors_by_name = {t.name: t for t in self.all_tensors}
        self.arch = self.get("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: GGUF architecture {self.arch!r} is not supported; "
                f"supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )

    # -- metadata -------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: GGUF metadata has no {key!r}")
        return value

    def _arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    # -- the model ------------------------------------------------------------------------

    def model_config(self, dtype: str | torch.dtype | None = None) -> ModelConfig:
        architecture, family = GGUF_ARCHITECTURES[self.arch]
        hidden_size = int(self.require(f"{self.arch}.embedding_length"))
        num_heads = int(self.require(f"{self.arch}.attention.head_count"))
        embedding = self.tensors_by_name.get("token_embd.weight")
        if embedding is None:
            raise GGUFError(f"{self.path}: GGUF file has no token_embd.weight tensor")
        first = "blk.0."
        return ModelConfig(
            architecture=architecture,
            family=family,
            vocab_size=int(embedding.shape[1]),
            hidden_size=hidden_size,
            intermediate_size=int(self.require(f"{self.arch}.feed_forward_length")),
            num_layers=int(self.require(f"{self.arch}.block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self._arch("attention.head_count_kv") or num_heads),
            head_dim=int(self._arch("attention.key_length") or hidden_size // num_heads),
            rms_norm_eps=float(self._arch("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(self._arch("context_length", 2048)),
            rope=self._rope(),
            tie_word_embeddings="output.weight" not in self.tensors_by_name,
            qkv_bias=f"{first}attn_q.bias" in self.tensors_by_name,
            o_bias=f"{first}attn_output.bias" in self.tensors_by_name,
            mlp_bias=f"{first}ffn_up.bias" in self.tensors_by_name,
            qk_norm=f"{first}attn_q_norm.weight" in self.tensors_by_name,
            sliding_window=None,
            dtype=parse_dtype(dtype if dtype is not None else "float32"),
            eos_token_ids=self._eos_ids(),
            bos_token_id=self.get("tokenizer.ggml.bos_token_id"),
        )

    def _rope(self) -> RopeConfig:
        scaling = self._arch("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise GGUFError(f"{self.path}: rope scaling {scaling!r} is not supported (none and linear are)")
        factors = self.tensors_by_name.get("rope_freqs.weight")
        return RopeConfig(
            theta=float(self._arch("rope.freq_base", 10000.0)),
            rope_type="linear" if scaling == "linear" else "default",
            factor=float(self._arch("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
            freq_factors=tuple(float(x) for x in np.asarray(factors.data, dtype=np.float32)) if factors else None,
        )

    def _eos_ids(self) -> tuple[int, ...]:
        """Every end-of-generation id the file names (llama.cpp stops on all of them)."""
        ids = [self.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, GGUFTensorSlice]]:
        """Every weight tensor under our parameter name, as a lazily dequantized slice. An
        unknown tensor is yielded under its GGUF name (the loader refuses it by that name)."""
        num_heads = int(self.require(f"{self.arch}.attention.head_count"))
        num_kv_heads = int(self._arch("attention.head_count_kv") or num_heads)
        heads_of = {"attn_q": num_heads, "attn_k": num_kv_heads}
        for tensor in self.all_tensors:
            if tensor.name in _CONFIG_TENSORS:
                continue
            name = hf_tensor_name(tensor.name) or tensor.name
            order = None
            leaf = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else None
            if self.arch == "llama" and leaf in heads_of:
                order = unpermute_rows(int(tensor.shape[-1]), heads_of[leaf])
            yield name, GGUFTensorSlice(tensor, dtype, order)

    @property
    def num_tensors(self) -> int:
        return sum(1 for t in self.all_tensors if t.name not in _CONFIG_TENSORS)


@lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """The checkpoint at ``path``, opened once per process while the file is unchanged (config,
    tokenizer and weights all read it; its metadata is read once per machine: ``gguf_index.py``)."""
    resolved = Path(path).resolve()
    try:
        stat = resolved.stat()
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read the GGUF file ({exc.strerror})") from None
    return _open(resolved, stat.st_mtime_ns, stat.st_size)


def load_gguf_tensors(
    path: Path, dtype: torch.dtype, visit: Callable[[str, GGUFTensorSlice], None],
    progress: Callable[[int, int], None] | None = None, reports: int = 4,
) -> None:
    """Calls ``visit(name, slice)`` for every weight tensor; ``progress(done, total)`` about
    ``reports`` times along the way."""
    checkpoint = open_gguf(path)
    total = checkpoint.num_tensors
    every = max(1, total // reports)
    for done, (name, tensor) in enumerate(checkpoint.tensors(dtype), start=1):
        visit(name, tensor)
        if progress is not None and (done % every == 0 or done == total):
            progress(done, total)
