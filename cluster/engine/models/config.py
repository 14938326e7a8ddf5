"""Reads a model's configuration into one frozen, architecture-neutral description.

A Hugging Face ``config.json`` is read here, in the transformers 4 form (``rope_theta``,
``rope_scaling``, ``torch_dtype``) or the transformers 5 form (``rope_parameters``, ``dtype``),
with its ``quantization_config`` (:mod:`cluster.engine.models.checkpoint_quantization`); a GGUF
file's metadata is read by :mod:`cluster.engine.models.gguf_checkpoint`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.engine.models.checkpoint_quantization import (
    CheckpointQuantization,
    CheckpointQuantizationError,
    parse_checkpoint_quantization,
)
from cluster.engine.quantization.kv_format import row_bytes


class ModelConfigError(ValueError):
    """The checkpoint's configuration is missing something or asks for what we do not support."""


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise ModelConfigError(f"unsupported dtype {name!r}; choose one of float32, bfloat16, float16")
    return DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # Per-frequency divisors of the inverse frequencies (a GGUF's rope_freqs tensor: llama.cpp's
    # form of llama3 scaling); None when there are none.
    freq_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # How weights are held: none (floats), gguf (a GGUF's blocks repacked), checkpoint (a Hugging
    # Face checkpoint's quantized tensors repacked), int8, int4, fp8 (quantized at load).
    quantization: str = "none"
    checkpoint_quantization: CheckpointQuantization | None = None  # how a Hugging Face checkpoint ships quantized
    kv_cache_dtype: str = "auto"  # how the KV cache holds keys and values: auto (dtype), int8, fp8_e4m3
    # How the CPU kernel multiplies quantized weights, as EngineConfig.resolved_cpu_matmul_dtype gives
    # it: float32, auto (4-bit weights with bfloat16 dot products) or bfloat16 (every quantized weight).
    cpu_matmul_dtype: str = "float32"

    @property
    def quant_method(self) -> str | None:
        """A Hugging Face checkpoint's ``quant_method``; None for floats (and for a GGUF file)."""
        return self.checkpoint_quantization.method if self.checkpoint_quantization else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one token's keys and values over every layer, as the cache holds them (``kv_cache_dtype``)."""
        element = torch.empty((), dtype=dtype or self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * row_bytes(self.kv_cache_dtype, self.head_dim, element)


def _require(raw: dict[str, Any], key: str, path: Path) -> Any:
    if key not in raw:
        raise ModelConfigError(f"{path}: config.json has no {key!r}")
    return raw[key]


def _rope_config(raw: dict[str, Any], path: Path) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise ModelConfigError(f"{path}: rope type {rope_type!r} is not supported (default, linear, llama3 are)")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def hf_model_config(path: Path, dtype: str | torch.dtype | None) -> ModelConfig:
    config_path = path / "config.json"
    raw = json.loads(config_path.read_text())
    generation_path = path / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    return parse_model_config(raw, generation, config_path, dtype)


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any], config_path: Path,
                       dtype: str | torch.dtype | None = None) -> ModelConfig:
    """A ``config.json`` mapping (and ``generation_config.json``'s) as a :class:`ModelConfig`;
    ``config_path`` names the file in messages."""
    architectures = raw.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"{config_path}: architecture {architecture!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    family = SUPPORTED_ARCHITECTURES[architecture]
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{config_path}: hidden_act {raw['hidden_act']!r} is not supported (only silu)")
    if raw.get("use_sliding_window") and family in ("qwen2", "qwen3"):
        raise ModelConfigError(f"{config_path}: use_sliding_window=true is not supported for {architecture}")

    hidden_size = int(_require(raw, "hidden_size", config_path))
    num_heads = int(_require(raw, "num_attention_heads", config_path))
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    checkpoint_dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    sliding_window = raw.get("sliding_window") if family == "mistral" else None
    try:
        checkpoint_quantization = parse_checkpoint_quantization(raw.get("quantization_config"))
    except CheckpointQuantizationError as exc:
        raise ModelConfigError(f"{config_path}: {exc}") from None
    return ModelConfig(
        architecture=architecture,
        family=family,
        vocab_size=int(_require(raw, "vocab_size", config_path)),
        hidden_size=hidden_size,
        intermediate_size=int(_require(raw, "intermediate_size", config_path)),
        num_layers=int(_require(raw, "num_hidden_layers", config_path)),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rope=_rope_config(raw, config_path),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=int(sliding_window) if sliding_window else None,
        dtype=parse_dtype(dtype if dtype is not None else checkpoint_dtype),
        eos_token_ids=_eos_ids(raw, generation),
        bos_token_id=raw.get("bos_token_id"),
        checkpoint_quantization=checkpoint_quantization,
    )
