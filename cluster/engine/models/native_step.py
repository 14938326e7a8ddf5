"""Describes a loaded model to the fused CPU decode step (:mod:`cluster.engine.kernels.decode_step`),
or says why it cannot run there.

The fused step serves every step (decode tokens and prompt chunks, each prompt token a row
attending to the cache up to its position) of a single-rank float32 model on the CPU whose
weights are held quantized (``ModelConfig.quantization`` other than ``none``); every other model
runs the torch path, which stays the reference the fused step is tested against.
"""

from __future__ import annotations

import torch

from cluster.engine.kernels import native_kernels_enabled
from cluster.engine.kernels.decode_step import LayerWeights, NativeDecodeStep, StepShape, WeightParts, decode_step_library
from cluster.engine.kernels.quantized_matmul import BF16_LAYOUTS
from cluster.engine.models.decoder import CausalLM
from cluster.engine.models.layers import ShardedLinear


def _parts(layer: ShardedLinear) -> WeightParts | None:
    if layer.packed:
        return layer.packed
    weight = layer.weight.data
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 32 or not weight.is_contiguous():
        return None
    return ((0, weight),)


def _bias(layer: ShardedLinear) -> torch.Tensor | None:
    return None if layer.bias is None else layer.bias.data


def why_not_native(model: CausalLM) -> str | None:
    """None when the fused step can run this model, else the reason."""
    config = model.config
    if not native_kernels_enabled():
        return "native kernels are off"
    if config.quantization == "none":
        return "weights are not quantized"
    if model.group.size != 1:
        return "tensor parallelism runs the torch path"
    if config.dtype != torch.float32:
        return f"activations are {config.dtype}, the fused step is float32"
    if model.model.embed_tokens.weight.device.type != "cpu":
        return "not on the CPU"
    if config.head_dim > 512 or config.hidden_size % 32 or config.intermediate_size % 32:
        return "a width that is not a multiple of 32"
    if decode_step_library() is None:
        return "the fused step did not build"
    return None


def native_decode_step(model: CausalLM, block_size: int) -> NativeDecodeStep | None:
    """The fused step over ``model`` and its (allocated) KV cache, or None where it cannot run."""
    if why_not_native(model) is not None:
        return None
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [_parts(attn.qkv_proj), _parts(attn.o_proj), _parts(mlp.gate_up_proj), _parts(mlp.down_proj)]
        if any(p is None for p in parts) or len(parts[0]) > 3 or len(parts[2]) > 2:
            return None
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight.data, post_norm=layer.post_attention_layernorm.weight.data,
            qkv=parts[0], o=parts[1], gate_up=parts[2], down=parts[3],
            k_cache=attn.attn.k_cache, v_cache=attn.attn.v_cache,
            q_norm=attn.q_norm.weight.data if attn.q_norm is not None else None,
            k_norm=attn.k_norm.weight.data if attn.k_norm is not None else None,
            qkv_bias=_bias(attn.qkv_proj), o_bias=_bias(attn.o_proj),
            gate_up_bias=_bias(mlp.gate_up_proj), down_bias=_bias(mlp.down_proj),
        ))
    config, first = model.config, model.model.layers[0].self_attn
    shape = StepShape(
        hidden=config.hidden_size, heads=first.num_heads, kv_heads=first.num_kv_heads, head_dim=config.head_dim,
        intermediate=config.intermediate_size, block_size=block_size, window=config.sliding_window or 0,
        eps=config.rms_norm_eps, scale=first.attn.scale, kv_cache_dtype=config.kv_cache_dtype,
        bf16_layouts=BF16_LAYOUTS[config.cpu_matmul_dtype],
    )
    rotary = model.model.rotary
    return NativeDecodeStep(decode_step_library(), shape, layers, rotary.cos.contiguous(), rotary.sin.contiguous(),
                            model.model.norm.weight.data)
