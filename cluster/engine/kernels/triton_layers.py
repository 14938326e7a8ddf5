"""The decoder's elementwise work in Triton: the rest of a layer on the fused path.

On the plain-torch path a layer launches some forty small kernels besides its four matmuls and
its attention (RMSNorm alone is eight: the cast, square, mean, add, rsqrt, multiply, cast back
and weight; the rotary embedding ten). At small batches a decode step on a GPU is bounded by
reading the weights, and those launches (a few microseconds each, even inside a CUDA graph)
add up to a large part of the step. Here each is one launch:

- ``rms_norm``: RMSNorm of each row, optionally after adding the residual stream (the sum is
  written back as the new residual), so a layer's two residual adds ride on its two norms;
- ``rotary``: the rotary embedding of a step's queries and keys, reading cos and sin for each
  token's position straight from the model's tables;
- ``silu_and_mul``: ``silu(gate) * up`` of the fused gate/up projection.

Each computes in float32 and converts to the activations' dtype where the torch ops round
(after the add, after the normalisation, after the weight; after each product of the rotation
and after their sum; after the SiLU and after the product). The residual sum is bit-equal to
torch's; elsewhere, in 16-bit floats, a value can still differ from the torch path's in its last
bit (on an H100, 12-16% of rotary outputs did, each by at most a unit in the last place of its
products; under 1% of the norm and SiLU outputs). In float32 they agree to rounding. Like
``triton_attention``, this module imports triton: import it only on the Triton backend (also
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    normed = (x32 * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x_ptr, out_ptr, token, stride_tok, stride_head, heads, dims, mask, cos1, sin1, cos2, sin2,
            HALF: tl.constexpr, HEADS: tl.constexpr):
    """One token's heads: out = x * cos + rotate_half(x) * sin, rounded as torch rounds."""
    base = x_ptr + token * stride_tok + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    first = (x1f * cos1).to(dtype).to(tl.float32) + (-x2f * sin1).to(dtype).to(tl.float32)
    second = (x2f * cos2).to(dtype).to(tl.float32) + (x1f * sin2).to(dtype).to(tl.float32)
    dst = out_ptr + token * HEADS * 2 * HALF + heads[:, None] * 2 * HALF + dims[None, :]
    tl.store(dst, first.to(dtype), mask=mask)
    tl.store(dst + HALF, second.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_table,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < HALF
    row = pos * stride_table
    cos1 = tl.load(cos_ptr + row + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + row + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + row + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + row + HALF + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    heads = tl.arange(0, BLOCK_H)
    _rotate(q_ptr, q_out_ptr, token, stride_q_tok, stride_q_head, heads, dims,
            (heads[:, None] < NUM_HEADS) & dim_ok[None, :], cos1, sin1, cos2, sin2, HALF, NUM_HEADS)
    kv_heads = tl.arange(0, BLOCK_KV)
    _rotate(k_ptr, k_out_ptr, token, stride_k_tok, stride_k_head, kv_heads, dims,
            (kv_heads[:, None] < NUM_KV_HEADS) & dim_ok[None, :], cos1, sin1, cos2, sin2, HALF, NUM_KV_HEADS)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected rows [T, N] with the last dimension contiguous, got {tuple(x.shape)} {x.stride()}")
    return x


def _norm_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` per row of x [T, N], as :class:`RMSNorm` computes it."""
    _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, out, x.stride(0), 0, out.stride(0), 0, x.shape[1], eps,
                                        HAS_RESIDUAL=False, BLOCK=block, num_warps=_norm_warps(block))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (rounded to x's dtype), then (RMSNorm(s), s)."""
    _rows(x), _rows(residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, summed, x.stride(0), residual.stride(0),
                                        out.stride(0), summed.stride(0), x.shape[1], eps,
                                        HAS_RESIDUAL=True, BLOCK=block, num_warps=_norm_warps(block))
    return out, summed


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D] and k [T, kv_heads, D] (any token and head strides, D contiguous) rotated
    for ``positions`` [T] with the tables ``cos``/``sin`` [max_positions, D] (the "rotate half"
    convention, as :func:`~cluster.engine.models.rotary.apply_rotary`); new contiguous tensors."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or head_dim % 2 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rotary needs contiguous head dimensions of even size and tables of one layout")
    q_out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    if tokens:
        half = head_dim // 2
        _rotary_kernel[(tokens,)](
            q, k, q_out, k_out, cos, sin, positions,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        )
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    _rows(x)
    tokens, width = x.shape
    size = width // 2
    out = torch.empty(tokens, size, dtype=x.dtype, device=x.device)
    if tokens:
        block = min(1024, triton.next_power_of_2(size))
        _silu_and_mul_kernel[(tokens, triton.cdiv(size, block))](x, out, x.stride(0), out.stride(0), size,
                                                                 BLOCK=block, num_warps=4)
    return out
