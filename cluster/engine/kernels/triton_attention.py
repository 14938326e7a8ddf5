"""Paged attention in Triton: the fused path of :class:`~cluster.engine.models.attention.PagedAttention`.

Three kernels, each one launch per layer for the whole step, reading keys and values in place
through the block table (no gather, no per-request Python):

- ``write_kv_cache``: the step's new keys and values into their cache slots; a slot of -1
  writes nothing (the padding rows of a CUDA-graph batch).
- ``paged_decode``: one query token per request. A program takes one request, one KV head and
  one split of the context, and attends with every query head of that KV head's group at once,
  so each key and value is loaded once per group. Long contexts are split across programs
  (flash-decoding) and a second small kernel merges the splits by their log-sum-exp.
- ``paged_prefill``: the step's prompt chunks in one launch, each chunk with its cached
  context, the causal mask and the sliding window; chunks have any length.

Scores are accumulated in float32 with an online softmax (exp2, the scale folded into log2 e).
Head sizes need not be powers of two (they are padded and masked).

An 8-bit cache (:mod:`cluster.engine.quantization.kv_format`: each token-head row is its codes
then its float32 scale in 4 bytes) is a constexpr variant of each kernel, so the 16-bit ones are
unchanged: ``write_kv_cache`` quantizes each new row as ``KVCacheFormat.quantize_rows`` does
(the same codes and scale bytes, bit for bit: 16-bit inputs are widened to float32 exactly
first, so they match too), and the attention kernels load a tile of codes and scales and
dequantize it in registers to the model's dtype, the values ``dequantize_rows`` gives. The e4m3
codes are encoded and decoded with integer arithmetic rather than Triton's ``float8e4nv``: that
type needs compute capability 8.9, and the interpreter's conversion rounds ties away from even,
so integer code is what runs the same on every GPU and under the tests. This module imports triton
at import time: import it only when the Triton backend is chosen (see ``triton_support``).

Under Triton's CPU interpreter (``TRITON_INTERPRET=1``) the kernels run on CPU tensors, which
is how they are tested without a GPU; there, bfloat16 products are taken in float32 because the
interpreter's ``tl.dot`` mishandles bfloat16 operands (the values are the same products).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cluster.engine.kernels.triton_support import interpreting
from cluster.engine.quantization.kv_format import KVCacheFormat

LOG2E = 1.4426950408889634
# What a cache row holds (the kernels' KV constexpr): the model's dtype, or 8-bit codes and a scale.
KV_PLAIN: tl.constexpr = tl.constexpr(0)
KV_INT8: tl.constexpr = tl.constexpr(1)
KV_FP8: tl.constexpr = tl.constexpr(2)
_KV_KINDS = {"auto": KV_PLAIN.value, "int8": KV_INT8.value, "fp8_e4m3": KV_FP8.value}  # by KVCacheFormat.name


@triton.jit
def _round_half_even(x):
    """x (float32, |x| < 2**22) rounded to the nearest integer, ties to even, as torch.round: adding
    1.5 * 2**23 leaves no fraction bits, and IEEE addition rounds to nearest even."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _e4m3_codes(x):
    """float32 values (|x| <= 448) to their float8_e4m3fn bit patterns (int32, 0..255), rounded to
    nearest even as torch's conversion does."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    # Below 2**-6 (subnormal codes, steps of 2**-9): 2**14's float32 ulp is 2**-9, so adding it rounds.
    subnormal = (magnitude + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    # Normal: keep 3 of float32's 23 mantissa bits, rounding to nearest even, and rebias 127 -> 7.
    normal = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) >> 20) - (120 << 3)
    return sign | tl.minimum(tl.where(magnitude < 0.015625, subnormal, normal), 0x7E)


@triton.jit
def _e4m3_values(codes):
    """float8_e4m3fn bit patterns (int8) to their float32 values (exactly; no NaN codes expected)."""
    bits = codes.to(tl.int32) & 0xFF
    magnitude_bits = bits & 0x7F
    normal = ((magnitude_bits << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = magnitude_bits.to(tl.float32) * 0.001953125  # 2**-9 per step
    magnitude = tl.where(magnitude_bits < 8, subnormal, normal)
    return tl.where(bits >= 0x80, -magnitude, magnitude)


@triton.jit
def _store_rows(cache_ptr, row, x, row_ok, dims, dim_ok, HEAD_DIM: tl.constexpr, KV: tl.constexpr):
    """Rows ``x`` ([R, BLOCK_D], zero past HEAD_DIM) into the cache rows at offsets ``row``: as they
    are, or quantized as KVCacheFormat.quantize_rows (amax / limit -> scale, x / scale -> codes)."""
    mask = row_ok[:, None] & dim_ok[None, :]
    if KV == KV_PLAIN:
        tl.store(cache_ptr + row[:, None] + dims[None, :], x, mask=mask)
    else:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        if KV == KV_INT8:
            scale = tl.math.div_rn(amax, 127.0)
        else:
            scale = tl.math.div_rn(amax, 448.0)
        scale = tl.where(scale > 0, scale, 1.0)
        scaled = tl.math.div_rn(x, scale[:, None])
        if KV == KV_INT8:
            codes = tl.minimum(tl.maximum(_round_half_even(scaled), -127.0), 127.0).to(tl.int8)
        else:
            codes = _e4m3_codes(scaled).to(tl.int8)
        tl.store(cache_ptr + row[:, None] + dims[None, :], codes, mask=mask)
        shifts = tl.arange(0, 4) * 8  # the scale's 4 bytes, little-endian as torch views them
        scale_bytes = ((scale.to(tl.int32, bitcast=True)[:, None] >> shifts[None, :]) & 0xFF).to(tl.int8)
        tl.store(cache_ptr + row[:, None] + HEAD_DIM + tl.arange(0, 4)[None, :], scale_bytes, mask=row_ok[:, None])


@triton.jit
def _load_rows(cache_ptr, row, row_ok, dims, dim_ok, HEAD_DIM: tl.constexpr, KV: tl.constexpr):
    """The cache rows at offsets ``row`` ([N]) as an [N, BLOCK_D] tile (zero where masked): as
    stored, or 8-bit rows dequantized to float32 (codes times their row's scale)."""
    mask = row_ok[:, None] & dim_ok[None, :]
    if KV == KV_PLAIN:
        tile = tl.load(cache_ptr + row[:, None] + dims[None, :], mask=mask, other=0.0)
    else:
        codes = tl.load(cache_ptr + row[:, None] + dims[None, :], mask=mask, other=0)
        shifts = tl.arange(0, 4) * 8
        scale_bytes = tl.load(cache_ptr + row[:, None] + HEAD_DIM + tl.arange(0, 4)[None, :], mask=row_ok[:, None],
                              other=0)
        scale = tl.sum((scale_bytes.to(tl.int32) & 0xFF) << shifts[None, :], 1).to(tl.float32, bitcast=True)
        if KV == KV_INT8:
            values = codes.to(tl.float32)
        else:
            values = _e4m3_values(codes)
        tile = values * scale[:, None]
    return tile


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b accumulated in float32; with FP32 the operands are float32 and the product exact
    IEEE (no TF32), as the torch reference computes float32 matmuls."""
    if FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, table_ptr, pos, key_ok, visible, kv_head, dims, dim_ok,
                 stride_c_block, stride_c_slot, stride_c_head, m_i, l_i, acc, qk_scale,
                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV: tl.constexpr, FP32_DOT: tl.constexpr):
    """Folds one tile of keys into the running softmax of the queries ``q``: the keys at context
    positions ``pos`` (``key_ok`` of them exist), found through one request's block-table row
    ``table_ptr``; ``visible`` masks scores per query. Keys and values come in ``q``'s dtype
    (8-bit rows dequantized to it). Returns the new (max, sum, accumulator)."""
    block = tl.load(table_ptr + pos // PAGE, mask=key_ok, other=0).to(tl.int64)
    base = block * stride_c_block + (pos % PAGE) * stride_c_slot + kv_head * stride_c_head
    k = _load_rows(k_cache_ptr, base, key_ok, dims, dim_ok, HEAD_DIM, KV).to(q.dtype)
    scores = tl.where(visible, _dot(q, tl.trans(k), FP32_DOT) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no visible key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    v = _load_rows(v_cache_ptr, base, key_ok, dims, dim_ok, HEAD_DIM, KV).to(q.dtype)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_DOT)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_slot, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        head_ok = heads < NUM_KV_HEADS
        dim_ok = dims < HEAD_DIM
        mask = head_ok[:, None] & dim_ok[None, :]
        row = (slot // PAGE) * stride_c_block + (slot % PAGE) * stride_c_slot + heads * stride_c_head
        k = tl.load(k_ptr + token * stride_k_tok + heads[:, None] * stride_k_head + dims[None, :], mask=mask,
                    other=0.0)
        _store_rows(k_cache_ptr, row, k, head_ok, dims, dim_ok, HEAD_DIM, KV)
        v = tl.load(v_ptr + token * stride_v_tok + heads[:, None] * stride_v_head + dims[None, :], mask=mask,
                    other=0.0)
        _store_rows(v_cache_ptr, row, v, head_ok, dims, dim_ok, HEAD_DIM, KV)


@triton.jit(do_not_specialize=["stride_bt"])  # the block table's width changes from step to step
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    stride_q_tok, stride_q_head, stride_c_block, stride_c_slot, stride_c_head, stride_bt, stride_o_tok,
    qk_scale, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV: tl.constexpr,
    SLIDING: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window, 0)
    # Each split takes a whole number of tiles of the visible keys; the last ones may get none.
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        pos = tile + cols
        valid = pos < end
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, block_table_ptr + seq * stride_bt, pos, valid,
                                     valid[None, :], kv_head, dims, dim_ok, stride_c_block, stride_c_slot,
                                     stride_c_head, m_i, l_i, acc, qk_scale, HEAD_DIM, PAGE, KV, FP32_DOT)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a split (or a padding row) with no keys: zeros
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_o_tok + heads[:, None] * HEAD_DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_o_tok,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < NUM_SPLITS
    base = (seq * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + splits, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)
    parts = tl.load(part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
                    mask=split_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_o_tok + head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_starts_ptr, context_lens_ptr, out_ptr,
    stride_q_tok, stride_q_head, stride_c_block, stride_c_slot, stride_c_head, stride_bt, stride_o_tok,
    qk_scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV: tl.constexpr, SLIDING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
):
    tile_m = tl.program_id(0)
    chunk = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_starts_ptr + chunk).to(tl.int32)
    q_len = tl.load(query_starts_ptr + chunk + 1).to(tl.int32) - q_start
    if tile_m * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + chunk).to(tl.int32)
        first_pos = context_len - q_len  # the chunk's first query position: its cached tokens come before
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < q_len
        dim_ok = dims < HEAD_DIM
        q_pos = first_pos + rows
        q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        kv_head = head // GROUP

        hi = tl.minimum(context_len, first_pos + (tile_m + 1) * BLOCK_M)  # past the tile's last query
        lo = 0
        if SLIDING:
            lo = tl.maximum(first_pos + tile_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile in range(lo, hi, BLOCK_N):
            pos = tile + cols
            key_ok = pos < hi
            visible = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, block_table_ptr + chunk * stride_bt, pos, key_ok,
                                         visible, kv_head, dims, dim_ok, stride_c_block, stride_c_slot, stride_c_head,
                                         m_i, l_i, acc, qk_scale, HEAD_DIM, PAGE, KV, FP32_DOT)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None] * stride_o_tok + head * HEAD_DIM + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _fp32_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def _cache_kind(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int, kv_format: KVCacheFormat | None) -> int:
    """The kernels' KV constexpr for these caches, once their layout is checked."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("key and value caches must share strides, with head_dim contiguous")
    if kv_format is None or not kv_format.quantized:
        return _KV_KINDS["auto"]
    width = kv_format.row_width(head_dim)
    if k_cache.shape[-1] != width or k_cache.dtype != kv_format.storage_dtype:
        raise ValueError(f"{kv_format.name} cache rows of head_dim {head_dim} are {width} int8 values, "
                         f"got {k_cache.shape[-1]} of {k_cache.dtype}")
    return _KV_KINDS[kv_format.name]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_format: KVCacheFormat | None = None) -> None:
    """k, v: [T, kv_heads, D] (any token and head strides, D contiguous); caches [blocks, page,
    kv_heads, D], or [..., D + 4] int8 rows for an 8-bit ``kv_format``; ``slot_mapping[t]`` is
    block * page + offset, or -1 for nothing."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    kind = _cache_kind(k_cache, v_cache, head_dim, kv_format)
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], KV=kind,
        BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, scale: float, sliding_window: int | None = None,
                 num_splits: int = 1, kv_format: KVCacheFormat | None = None) -> None:
    """Attention of one query per request: q [B, heads, D] (rows 0..B-1 of the step), written
    into ``out[:B]`` ([T, heads * D]). ``block_table`` [B, W] and ``seq_lens`` [B] (keys each
    request attends to, its new one included; 0 for a padding row, which gets zeros). Caches as
    in :func:`write_kv_cache`."""
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return
    kind = _cache_kind(k_cache, v_cache, head_dim, kv_format)
    kv_heads = k_cache.shape[2]
    group = num_heads // kv_heads
    block_d = _pow2(head_dim)
    block_n = 64 if block_d <= 128 else 32
    common = dict(
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], KV=kind,
        SLIDING=sliding_window is not None, NUM_SPLITS=num_splits,
        BLOCK_H=_pow2(group), BLOCK_D=block_d, BLOCK_N=block_n, FP32_DOT=_fp32_dot(q.dtype),
    )
    if num_splits == 1:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), out.stride(0), scale * LOG2E, sliding_window or 0,
        num_warps=4, **common,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
        )


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  query_starts: torch.Tensor, context_lens: torch.Tensor, max_query_len: int, out: torch.Tensor,
                  scale: float, sliding_window: int | None = None, kv_format: KVCacheFormat | None = None) -> None:
    """Causal attention of C prompt chunks: chunk c's queries are rows
    ``query_starts[c]:query_starts[c + 1]`` of q ([T, heads, D]) and of ``out`` ([T, heads * D]);
    it attends to the first ``context_lens[c]`` tokens of its blocks (``block_table[c]``), its
    own keys included (they must already be in the cache). Caches as in :func:`write_kv_cache`."""
    chunks = context_lens.shape[0]
    if chunks == 0 or max_query_len == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    kind = _cache_kind(k_cache, v_cache, head_dim, kv_format)
    group = num_heads // k_cache.shape[2]
    block_d = _pow2(head_dim)
    block = 64 if block_d <= 128 else 32
    if interpreting():
        block = 16 if max_query_len <= 16 else 32  # fewer masked rows to emulate on a CPU
    _prefill_kernel[(triton.cdiv(max_query_len, block), chunks, num_heads)](
        q, k_cache, v_cache, block_table, query_starts, context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0), out.stride(0), scale * LOG2E, sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], KV=kind, SLIDING=sliding_window is not None,
        BLOCK_M=block, BLOCK_D=block_d, BLOCK_N=block, FP32_DOT=_fp32_dot(q.dtype),
        num_warps=4,
    )
