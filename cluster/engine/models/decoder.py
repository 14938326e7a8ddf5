"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm).

One module tree whose parameter names follow the Hugging Face checkpoints, except that q/k/v
and gate/up are fused; ``PACKED_MODULES`` tells the loader how checkpoint tensors map to the
fused parameters.

On the fused (Triton) path, when the step's metadata carries ``fused``, the elementwise work
between the matmuls runs as Triton kernels too (:mod:`cluster.engine.kernels.triton_layers`):
each residual add rides on the next RMSNorm, the rotary embedding is one launch, and so is the
MLP's ``silu(gate) * up``. The layer's arithmetic and its roundings are the torch path's.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.kernels.quantized_matmul import BF16_LAYOUTS
from cluster.engine.models.attention import AttentionMetadata, PagedAttention
from cluster.engine.models.config import ModelConfig
from cluster.engine.models.layers import (
    SINGLE_RANK,
    MergedColumnParallelLinear,
    ParallelGroup,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    ShardedLinear,
    VocabParallelEmbedding,
)
from cluster.engine.models.rotary import RopeRows, RotaryEmbedding, apply_rotary
from cluster.engine.quantization.choice import AS_SHIPPED


@cache
def _layer_kernels():
    """The Triton elementwise kernels, imported on first use (Triton is optional)."""
    from cluster.engine.kernels import triton_layers

    return triton_layers


PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, group: ParallelGroup):
        super().__init__()
        dtype = config.dtype
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
            bias=config.qkv_bias, dtype=dtype, group=group, quantization=config.quantization,
        )
        self.num_heads = self.qkv_proj.local_heads
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.head_dim = config.head_dim
        self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, bias=config.o_bias, dtype=dtype, group=group,
                                        quantization=config.quantization)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, config.sliding_window)

    def _qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values per head (QK-normed where the model does), before rotary."""
        tokens = hidden.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, rope: RopeRows, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(hidden)
        q, k = apply_rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v, meta))

    def forward_fused(self, positions: torch.Tensor, rotary: RotaryEmbedding, hidden: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self._qkv(hidden)
        q, k = _layer_kernels().rotary(q, k, positions, rotary.cos, rotary.sin)
        return self.o_proj(self.attn(q, k, v, meta))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, group: ParallelGroup):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=config.mlp_bias, dtype=config.dtype, group=group,
            quantization=config.quantization,
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=config.mlp_bias, dtype=config.dtype, group=group,
                                           quantization=config.quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_layer_kernels().silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, group: ParallelGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = SelfAttention(config, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = GatedMLP(config, group)

    def forward(self, rope: RopeRows, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, positions: torch.Tensor, rotary: RotaryEmbedding, hidden: torch.Tensor,
                      residual: torch.Tensor | None,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with the residual stream kept apart: takes the previous layer's output
        and the stream before it (None for the first layer, whose input is the stream), and
        returns this layer's MLP output and the stream before it; their sum is ``forward``'s."""
        kernels = _layer_kernels()
        norm = self.input_layernorm
        if residual is None:
            residual, x = hidden, kernels.rms_norm(hidden, norm.weight, norm.eps)
        else:
            x, residual = kernels.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        attn = self.self_attn.forward_fused(positions, rotary, x, meta)
        norm = self.post_attention_layernorm
        x, residual = kernels.add_rms_norm(attn, residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, group: ParallelGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, config.dtype, group,
                                                   quantization=_table_quantization(config))
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope, config.dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, group) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if meta.fused is not None:
            return self._forward_fused(hidden, positions, meta)
        rope = self.rotary.lookup(positions)
        for index, layer in enumerate(self.layers):
            hidden = layer(rope, hidden, meta)
            if meta.after_layer is not None:
                meta.after_layer(index)
        return self.norm(hidden)

    def _forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        residual = None
        for index, layer in enumerate(self.layers):
            hidden, residual = layer.forward_fused(positions, self.rotary, hidden, residual, meta)
            if meta.after_layer is not None:
                meta.after_layer(index)
        kernels = _layer_kernels()
        if residual is None:  # no layers
            return kernels.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return kernels.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]


def _table_quantization(config: ModelConfig) -> str:
    """Embedding tables stay packed only as the checkpoint ships them; ``int8``/``int4``/``fp8``
    quantize the linear layers."""
    return config.quantization if config.quantization in AS_SHIPPED else "none"


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None, group: ParallelGroup = SINGLE_RANK):
        super().__init__()
        self.config = config
        self.group = group
        self.model = DecoderModel(config, max_positions or config.max_position_embeddings, group)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, config.dtype, group,
                                      quantization=_table_quantization(config))
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def finish_loading(self) -> None:
        """Once every tensor is read: packs the quantized layers (see ``layers``); a tied head
        shares the embedding's packed table."""
        for module in self.modules():
            if isinstance(module, (ShardedLinear, VocabParallelEmbedding)) and module is not self.lm_head:
                module.finish_loading()
        if self.config.tie_word_embeddings:
            self.lm_head.packed = self.model.embed_tokens.packed
        else:
            self.lm_head.finish_loading()
        layouts = BF16_LAYOUTS[self.config.cpu_matmul_dtype]
        for module in self.modules():
            if isinstance(module, (ShardedLinear, ParallelLMHead)):
                module.bf16_layouts = layouts

    def use_triton_matmuls(self) -> None:
        """Packed layers multiply with the Triton kernel: on an engine on the Triton backend (on
        CUDA they do anyway; on the CPU this is the interpreter's engine, in tests)."""
        for module in self.modules():
            if isinstance(module, (ShardedLinear, ParallelLMHead)):
                module.triton_matmul = True

    def packed_bytes(self) -> int:
        tables = [self.model.embed_tokens] + ([] if self.config.tie_word_embeddings else [self.lm_head])
        linears = [m for m in self.modules() if isinstance(m, ShardedLinear)]
        return sum(m.packed_bytes() for m in tables + linears)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
