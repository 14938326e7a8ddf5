"""``x @ W.T`` for a :class:`PackedWeight` in Triton: the GPU path of the quantized linear layers.

One kernel reads every layout of ``quantization/packed.py`` (q4; q8 in groups of 16 or 32, with or
without mins; f8) straight from its packed bytes, each byte once per tile of activation rows, and
widens the weight tile by tile in registers: ``w = scale * q (+ min)`` in float32, then rounded to
the activations' dtype (bf16/fp16; float32 activations keep float32 weights and take an exact
IEEE product, no TF32), multiplied on the tensor cores with float32 accumulation. The output is
in x's dtype. This is weight-only dequantization, as vLLM's, SGLang's and gemlite's W4A16/W8A16
Triton kernels do it: at decode batches the step is bounded by the weight bytes read, and those
are the packed ones (q4: 0.5 byte a weight plus 8 bytes of scale and min per 32).

q4 needs no shuffling: byte j of a group holds weights j (low nibble) and j + 16 (high nibble),
so the kernel takes two products per tile, one with the low nibbles against the activations'
columns j, one with the high nibbles against columns j + 16. An f8 code is widened exactly on
any GPU by moving its 7 exponent/mantissa bits into an fp16 (the value over 2^8, subnormals
included; the 2^8 joins the scale); the two NaN codes read as +-480, as on the CPU kernel.

FP8 activations (f8 weights, 16-bit activations, a GPU with FP8 tensor cores: compute capability
>= 8.9, asked for with ``fp8_activations=True``): each activation row is quantized in the kernel,
per group of 32 columns (the weight's groups), to e4m3 with a scale of ``max |x| / 448``, and each
group is one FP8 product of 32 terms scaled by the row's and the weight row's group scales. The
rounding to e4m3 is done with integer arithmetic to the nearest even value (exact before the
conversion: Triton's interpreter converts float32 to e4m3 wrongly where the rounding carries into
the exponent). It is not the default: on an H200 (Llama-3-8B shape, ``benchmarks/quantized_gpu.py``)
it took 5.7, 5.8 and 12.3 ms a step at batch 1, 8 and 64 against weight-only's 3.8, 5.3 and 7.4:
every program quantizes its rows again, per group. ``torch._scaled_mm`` does not fit a scale per 32:
its float32 scales are per tensor, per row/column or per 1x128/128x128 block, and its 1x32 blocks
(MXFP8) take power-of-two e8m0 scales, which would change the weights. f8 weights with one scale
per row do fit it, and a bfloat16 model multiplies them there (``torch_quantized_matmul``), as
it does q4 weights on tinygemm at small batches: this kernel serves what those do not take.

Plans (``plan_tiles``), from the number of activation rows M (not specialised on: one compiled
variant per plan and layout), chosen by ``benchmarks/quantized_gpu_tiles.py`` on an H200
(``benchmarks/results/quantized_gpu_h200.txt``):

- M = 1: ``_gemv_kernel``, no tensor cores: 32 weight rows a program, 256 columns a step, K split
  into runs of 1,024 columns (partial sums added by a second kernel). Per weight row and group,
  ``scale * sum(q x) + min * sum(x)`` in float32, as the CPU kernel sums. Linear layers of a
  Llama-3-8B step: int4 3.3 ms, int8 3.4, fp8 3.8, against bf16's 4.0 through cuBLAS (the
  tensor-core tiles, with scales gathered per weight, took 17, 29 and 30 ms). It reads 35-52% of the bandwidth: converting codes to float32
  costs more than reading them (int4 is no faster than int8); the next lever.
  At M = 4 it took 1.4-2.1x longer than the tiles below take at M = 8, so only one row takes it.
- 1 < M <= 64 (decode batches): one tile of 16, 32 or 64 rows covers the batch, 64 weight rows by
  128 columns a step; codes read as [groups, 32, n] with each group's scale (and min) loaded once
  and broadcast (a scale gathered per weight made the kernel 4-7x slower). Few weight rows give
  few programs (a 4096-row o_proj: 64), so K is split until there are about two programs per SM,
  each split at least 4 tiles. q4 in tiles of 32 or more rows keeps scales read per weight: the
  group-broadcast form took 45 ms at batch 64 against 21 (at 16 rows it took 7.0 against 16.9).
- M > 64 (prompt chunks): 128 x 128 tiles, 64 columns a step, no split (each split would
  write and read back a float32 copy of the chunk's output), programs grouped along M so a
  weight tile is reused from L2 by neighbouring row tiles. The weight is still widened in the
  kernel: its cost is one conversion per weight per 128 rows, against 128 multiply-adds, and
  there is no full-width copy of the weight (a 16-bit gate/up projection of Llama-3-8B is
  235 MB) to allocate and write.

No host synchronisation and only caching-allocator buffers (the output, the split partial sums):
a decode step through it can be captured in a CUDA graph. Like the other ``triton_*`` modules
this imports triton: import it only on the Triton backend (also under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch
import triton
import triton.language as tl

from cluster.engine.kernels.triton_fp8 import round_to_e4m3
from cluster.engine.kernels.torch_quantized_matmul import torch_matmul
from cluster.engine.kernels.triton_support import FP8_TENSOR_CORES, capability_at_least, device_sm_count, interpreting
from cluster.engine.quantization.packed import PackedWeight

LAYOUT_IDS = {"q4": 0, "q8": 1, "f8": 2}
DECODE_ROWS = 64  # up to here, one tile of rows covers the batch (the decode plan)
GEMV_ROWS = 1  # up to here, one row a program without tensor cores (_gemv_kernel)
GEMV_BLOCK_K = 256
GEMV_TILES_PER_SPLIT = 4  # K is split into runs of 1,024 columns (the sweep's best on an H200)
MAX_SPLITS = 16
MIN_TILES_PER_SPLIT = 4


@triton.jit
def _dot(a, b, acc, FP32: tl.constexpr):
    """acc + a @ b; with FP32 the operands are float32 and the product exact IEEE (the
    interpreter also takes its bfloat16 products so: its ``tl.dot`` mishandles bfloat16)."""
    if FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _code_values(code, LAYOUT: tl.constexpr):
    """q8 (int8) or f8 (uint8 e4m3fn) codes as float32, exactly; f8 as its value / 2^8."""
    if LAYOUT == 2:  # sign and the 7 exponent/mantissa bits into an fp16: the value over 2^8
        bits = code.to(tl.uint16)
        value = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        value = code.to(tl.float32)
    return value


@triton.jit
def _group_scales(scales_ptr, mins_ptr, ns, n_ok, groups, g_ok, stride_sn, LAYOUT: tl.constexpr,
                  HAS_MINS: tl.constexpr):
    """A tile's scales and mins, [len(groups), len(ns)], loaded once per group (not per weight);
    f8's scale carries the 2^8 its codes were read without."""
    mask = g_ok[:, None] & n_ok[None, :]
    offsets = ns[None, :] * stride_sn + groups[:, None]
    scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0)
    if LAYOUT == 2:
        scale = scale * 256.0
    low = tl.zeros_like(scale)
    if HAS_MINS:
        low = tl.load(mins_ptr + offsets, mask=mask, other=0.0)
    return scale, low


@triton.jit
def _weight_tile(codes_ptr, scales_ptr, mins_ptr, ns, n_ok, k0, k_end, stride_cn, stride_sn,
                 LAYOUT: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_K: tl.constexpr):
    """q8 or f8 weights [BLOCK_K, len(ns)] in float32, columns k0.. (one code a column): codes
    read as [groups, GROUP, n], each group's scale (and min) broadcast over its GROUP codes."""
    G: tl.constexpr = BLOCK_K // GROUP
    groups = k0 // GROUP + tl.arange(0, G)
    g_ok = groups * GROUP < k_end
    kk = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = g_ok[:, None, None] & n_ok[None, None, :]
    code = tl.load(codes_ptr + ns[None, None, :] * stride_cn + kk[:, :, None], mask=mask, other=0)
    scale, low = _group_scales(scales_ptr, mins_ptr, ns, n_ok, groups, g_ok, stride_sn, LAYOUT, HAS_MINS)
    w = _code_values(code, LAYOUT) * scale[:, None, :] + low[:, None, :]
    return tl.reshape(w, (BLOCK_K, ns.shape[0]))


@triton.jit(do_not_specialize=["M"])  # one compiled variant for every batch of a tile size
def _quantized_matmul_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_cn, stride_sn, stride_om, stride_os,
    LAYOUT: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, FP8_ACTIVATIONS: tl.constexpr,
    FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[split][m, n] = sum over this split's columns k of x[m, k] * w[n, k] (the whole sum,
    in out's dtype, with one split; float32 partial sums with several)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // band_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    codes_ptr += (pid_n * BLOCK_N).to(tl.int64) * stride_cn
    scales_ptr += (pid_n * BLOCK_N).to(tl.int64) * stride_sn
    mins_ptr += (pid_n * BLOCK_N).to(tl.int64) * stride_sn
    local_n = tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if LAYOUT == 0 and BLOCK_M >= 32:  # q4, wide row tiles: bytes [BLOCK_K / 2, BLOCK_N], scales per byte
            kb = tl.arange(0, BLOCK_K // 2)
            k_lo = k0 + (kb // 16) * 32 + kb % 16
            k_ok = k_lo < k_end
            mask = k_ok[:, None] & n_ok[None, :]
            byte = tl.load(codes_ptr + local_n[None, :] * stride_cn + (k0 // 2 + kb)[:, None], mask=mask, other=0)
            groups = (k_lo // 32)[:, None]
            scale = tl.load(scales_ptr + local_n[None, :] * stride_sn + groups, mask=mask, other=0.0)
            low = tl.load(mins_ptr + local_n[None, :] * stride_sn + groups, mask=mask, other=0.0)
            w_lo = ((byte & 15).to(tl.float32) * scale + low).to(dtype)
            w_hi = ((byte >> 4).to(tl.float32) * scale + low).to(dtype)
            x_mask = row_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=x_mask, other=0.0)
            acc = _dot(x_lo, w_lo, acc, FP32_DOT)
            acc = _dot(x_hi, w_hi, acc, FP32_DOT)
        elif LAYOUT == 0:  # q4: bytes [groups, 16, BLOCK_N], low nibbles columns j, high j + 16
            G: tl.constexpr = BLOCK_K // 32
            groups = k0 // 32 + tl.arange(0, G)
            g_ok = groups * 32 < k_end
            bytes_at = groups[:, None] * 16 + tl.arange(0, 16)[None, :]
            byte = tl.load(codes_ptr + local_n[None, None, :] * stride_cn + bytes_at[:, :, None],
                           mask=g_ok[:, None, None] & n_ok[None, None, :], other=0)
            scale, low = _group_scales(scales_ptr, mins_ptr, local_n, n_ok, groups, g_ok, stride_sn, 0, True)
            w_lo = tl.reshape((byte & 15).to(tl.float32) * scale[:, None, :] + low[:, None, :], (BLOCK_K // 2, BLOCK_N))
            w_hi = tl.reshape((byte >> 4).to(tl.float32) * scale[:, None, :] + low[:, None, :], (BLOCK_K // 2, BLOCK_N))
            w_lo = w_lo.to(dtype)
            w_hi = w_hi.to(dtype)
            k_lo = tl.reshape(groups[:, None] * 32 + tl.arange(0, 16)[None, :], (BLOCK_K // 2,))
            k_ok = k_lo < k_end
            x_mask = row_ok[:, None] & k_ok[None, :]
            x_lo = tl.load(x_rows + k_lo[None, :], mask=x_mask, other=0.0)
            x_hi = tl.load(x_rows + (k_lo + 16)[None, :], mask=x_mask, other=0.0)
            acc = _dot(x_lo, w_lo, acc, FP32_DOT)
            acc = _dot(x_hi, w_hi, acc, FP32_DOT)
        elif FP8_ACTIVATIONS:  # f8 against e4m3 activations: one FP8 product per group of 32
            for g in tl.static_range(BLOCK_K // 32):
                kk = k0 + g * 32 + tl.arange(0, 32)
                k_ok = kk < k_end
                x = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                amax = tl.max(tl.abs(x), axis=1)
                x_scale = tl.where(amax > 0, amax / 448.0, 1.0)
                x_codes = round_to_e4m3(tl.clamp(x * (448.0 / tl.where(amax > 0, amax, 448.0))[:, None],
                                                  -448.0, 448.0)).to(tl.float8e4nv)
                mask = k_ok[:, None] & n_ok[None, :]
                w_codes = tl.load(codes_ptr + local_n[None, :] * stride_cn + kk[:, None], mask=mask, other=0)
                group = tl.minimum(k0 // 32 + g, (k_end - 1) // 32)  # past the end: codes 0, any scale
                w_scale = tl.load(scales_ptr + local_n * stride_sn + group, mask=n_ok, other=0.0)
                part = tl.dot(x_codes, w_codes.to(tl.float8e4nv, bitcast=True))
                acc += part * x_scale[:, None] * w_scale[None, :]
        else:  # q8 or f8: one code a weight
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < k_end
            w = _weight_tile(codes_ptr, scales_ptr, mins_ptr, local_n, n_ok, k0, k_end, stride_cn, stride_sn,
                             LAYOUT, GROUP, HAS_MINS, BLOCK_K)
            x = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(x, w.to(dtype), acc, FP32_DOT)
    out = out_ptr + split.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_om + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_cn, stride_sn, stride_om, stride_os,
    LAYOUT: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One activation row by BLOCK_N weight rows (a few rows of x: a program each, neighbours
    in launch order, so a weight tile read for one row is in L2 for the next).

    No tensor cores: each weight row's codes [groups, GROUP] are widened to float32 and
    multiplied into x's row in registers; per group, ``scale * sum(q x) + min * sum(x)``.
    A q4 byte's two nibbles meet x's columns j and j + 16 of its group."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row = pid % M
    ns = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    G: tl.constexpr = BLOCK_K // GROUP
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    code_rows = codes_ptr + ns.to(tl.int64)[None, None, :] * stride_cn
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        groups = k0 // GROUP + tl.arange(0, G)
        g_ok = groups * GROUP < k_end
        mask = g_ok[:, None, None] & n_ok[None, None, :]
        scale, low = _group_scales(scales_ptr, mins_ptr, ns, n_ok, groups, g_ok, stride_sn, LAYOUT, HAS_MINS)
        if LAYOUT == 0:  # q4: [groups, 16, n] bytes
            js = groups[:, None] * 32 + tl.arange(0, 16)[None, :]
            x_lo = tl.load(x_row + js, mask=g_ok[:, None], other=0.0).to(tl.float32)
            x_hi = tl.load(x_row + js + 16, mask=g_ok[:, None], other=0.0).to(tl.float32)
            byte = tl.load(code_rows + (groups[:, None] * 16 + tl.arange(0, 16)[None, :])[:, :, None], mask=mask,
                           other=0)
            dots = tl.sum((byte & 15).to(tl.float32) * x_lo[:, :, None] + (byte >> 4).to(tl.float32) * x_hi[:, :, None],
                          axis=1)
            x_sums = tl.sum(x_lo + x_hi, axis=1)
        else:  # q8 or f8: [groups, GROUP, n] codes
            kk = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            x = tl.load(x_row + kk, mask=g_ok[:, None], other=0.0).to(tl.float32)
            code = tl.load(code_rows + kk[:, :, None], mask=mask, other=0)
            dots = tl.sum(_code_values(code, LAYOUT) * x[:, :, None], axis=1)
            x_sums = tl.sum(x, axis=1)
        acc += tl.sum(scale * dots + low * x_sums[:, None], axis=0)
    out = out_ptr + split.to(tl.int64) * stride_os + row.to(tl.int64) * stride_om + ns
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, N, stride_ps, stride_pm, stride_om,
                       SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum of the splits' partial sums, in a fixed order, in out's dtype."""
    row = tl.program_id(0).to(tl.int64)
    ns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = ns < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        total += tl.load(part_ptr + split * stride_ps + row * stride_pm + ns, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_om + ns, total.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class TilePlan:
    block_m: int
    block_n: int
    block_k: int
    splits: int
    k_per_split: int  # columns per split, a multiple of block_k
    num_warps: int
    num_stages: int
    gemv: bool = False  # one row a program, no tensor cores (_gemv_kernel)


def plan_tiles(m: int, n: int, k: int, num_sms: int, splits: int | None = None, layout: str = "q4",
               fp8_activations: bool = False) -> TilePlan:
    """The tiles and K split for an [m, k] x [k, n] product of a weight in ``layout`` (see the
    module's docstring); ``splits`` forces a split count (tests)."""
    if m <= GEMV_ROWS and not fp8_activations:
        k_tiles = triton.cdiv(k, GEMV_BLOCK_K)
        per_split = min(k_tiles, GEMV_TILES_PER_SPLIT) if splits is None else triton.cdiv(k_tiles, max(1, splits))
        per_split = max(per_split, triton.cdiv(k_tiles, MAX_SPLITS))
        if num_sms == 1:  # the interpreter runs programs one by one: no split
            per_split = k_tiles
        return TilePlan(1, 32, GEMV_BLOCK_K, triton.cdiv(k_tiles, per_split), per_split * GEMV_BLOCK_K, 4, 2, True)
    if m <= DECODE_ROWS:
        block_m, block_n, block_k, warps = max(16, triton.next_power_of_2(m)), 64, 128, 4
    else:
        block_m, block_n, block_k, warps = 128, 128, 64, 8
    k_tiles = triton.cdiv(k, block_k)
    if splits is None:
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        splits = 1
        while (m <= DECODE_ROWS and programs * splits < 2 * num_sms and splits * 2 <= MAX_SPLITS
               and k_tiles // (splits * 2) >= MIN_TILES_PER_SPLIT):
            splits *= 2
    tiles_per_split = triton.cdiv(k_tiles, max(1, splits))
    splits = triton.cdiv(k_tiles, tiles_per_split)
    return TilePlan(block_m, block_n, block_k, splits, tiles_per_split * block_k, warps, 3)


@cache
def _sm_count(device: torch.device) -> int:
    return device_sm_count(device)


def fp8_activations_run_on(device: torch.device) -> bool:
    """Whether the device has FP8 tensor cores (compute capability >= 8.9)."""
    return capability_at_least(device, FP8_TENSOR_CORES)


def _fp32_dot(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def quantized_matmul_into(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor,
                          fp8_activations: bool | None = None, splits: int | None = None,
                          plan: TilePlan | None = None) -> None:
    """Writes ``x @ W.T`` into ``out`` [M, N] (any row stride: a column slice of a wider output).

    x [M, K] with unit column stride, bf16, fp16 or float32, on the weight's device.
    ``fp8_activations``: take f8 weights' products with e4m3 activations (default: no, measured
    slower; needs FP8 tensor cores or the interpreter; ignored for other layouts and for float32).
    ``splits``: force a K split count (default: :func:`plan_tiles`); ``plan``: force the whole
    plan (``benchmarks/quantized_gpu_tiles.py`` sweeps plans with it)."""
    m, k = x.shape
    n = weight.rows
    if k != weight.cols or out.shape != (m, n) or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"quantized matmul: x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a weight of "
                         f"{weight.shape}, or their columns are not contiguous")
    if m == 0:
        return
    sixteen_bit = x.dtype in (torch.bfloat16, torch.float16)
    if fp8_activations is None:
        fp8_activations = False  # measured slower than weight-only at every batch: see the module's docstring
    fp8_activations = fp8_activations and sixteen_bit and weight.layout == "f8"
    if plan is None:
        plan = plan_tiles(m, n, k, _sm_count(x.device), splits, weight.layout, fp8_activations)
        if x.dtype == torch.float32 and not plan.gemv:  # float32 tiles take twice the shared memory a stage
            plan = replace(plan, num_stages=min(plan.num_stages, 2))
    if plan.splits == 1:
        target, stride_split = out, 0
    else:
        target = torch.empty(plan.splits, m, n, dtype=torch.float32, device=x.device)
        stride_split = target.stride(0)
    mins = weight.mins if weight.mins is not None else weight.scales
    args = (x, weight.codes, weight.scales, mins, target, m, n, k, plan.k_per_split,
            x.stride(0), weight.codes.stride(0), weight.scales.stride(0), target.stride(-2), stride_split)
    layout = dict(LAYOUT=LAYOUT_IDS[weight.layout], GROUP=weight.group, HAS_MINS=weight.mins is not None)
    if plan.gemv:
        _gemv_kernel[(m * triton.cdiv(n, plan.block_n), plan.splits)](
            *args, **layout, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
    else:
        _quantized_matmul_kernel[(triton.cdiv(m, plan.block_m) * triton.cdiv(n, plan.block_n), plan.splits)](
            *args, **layout, FP8_ACTIVATIONS=fp8_activations, FP32_DOT=_fp32_dot(x.dtype),
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](target, out, n, target.stride(0), target.stride(1),
                                                       out.stride(0), SPLITS=plan.splits, BLOCK=block, num_warps=4)


def packed_linear(x: torch.Tensor, parts: tuple[tuple[int, PackedWeight], ...], out_features: int,
                  fp8_activations: bool | None = None, torch_kernels: bool = True) -> torch.Tensor:
    """``x @ W.T`` for a weight kept as packed row blocks ``(first row, part)``, in x's dtype: a
    part with a torch kernel's form (``torch_kernels``) goes through it at the batches it takes."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    forms = [part.kernel_form if torch_kernels and part.kernel_form is not None and part.kernel_form.takes(m)
             else None for _, part in parts]
    if len(parts) == 1 and forms[0] is not None:
        return torch_matmul(rows, forms[0]).view(*x.shape[:-1], out_features)
    out = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    for (first, part), form in zip(parts, forms):
        target = out[:, first : first + part.rows]
        if form is not None:
            target.copy_(torch_matmul(rows, form))
        else:
            quantized_matmul_into(rows, part, target, fp8_activations)
    return out.view(*x.shape[:-1], out_features)
