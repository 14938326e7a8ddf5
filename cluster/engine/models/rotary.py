"""Rotary position embeddings (the Hugging Face "rotate half" convention), with llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from cluster.engine.models.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.freq_factors is not None:
        if len(rope.freq_factors) != inv_freq.numel():
            raise ValueError(f"{len(rope.freq_factors)} rotary frequency factors for {inv_freq.numel()} frequencies")
        inv_freq = inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    original = rope.original_max_position_embeddings or 8192
    low_wavelen = original / rope.low_freq_factor
    high_wavelen = original / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (original / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputes cos/sin for every position once; a step only indexes the table."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, dtype: torch.dtype):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows [T, 1, D] for a step's positions; looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


RopeRows = tuple[torch.Tensor, torch.Tensor]


def apply_rotary(rope: RopeRows, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, D], k: [T, kv_heads, D]; rope from :meth:`RotaryEmbedding.lookup`."""
    cos, sin = rope
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
