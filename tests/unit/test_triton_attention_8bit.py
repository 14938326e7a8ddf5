"""The Triton attention kernels over an 8-bit KV cache (int8, fp8_e4m3 rows: codes then a float32
scale, :mod:`cluster.engine.quantization.kv_format`).

``write_kv_cache`` must write the bytes ``KVCacheFormat.quantize_rows`` gives, exactly; decode and
prefill read the rows in place and must give what attention over the dequantized rows gives (the
plain-torch path's reference), within the float32 kernels' own tolerance: the dequantized tile is
the same floats ``dequantize_rows`` makes, so only the order of additions differs. Without CUDA the
kernels run under Triton's interpreter; with CUDA, natively (the same tests, on the GPU). A mixed
step through the attention layer, against the torch path, is in test_triton_attention.py.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from cluster.engine.kernels import triton_attention as kernels  # noqa: E402
from cluster.engine.quantization.kv_format import KVCacheFormat  # noqa: E402
from test_triton_attention import (  # noqa: E402
    DEVICE, assign_blocks, check_prefill, reference, scattered_cache, table_tensor,
)

pytestmark = pytest.mark.unit

FORMATS = ["int8", "fp8_e4m3"]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # as for the 16-bit caches (test_triton_attention.py)


def quantized_cache(name, num_blocks, page, num_kv_heads, head_dim, seed, dtype=torch.float32):
    """Random 8-bit caches, their dequantized rows (what the torch path attends to) and a block order."""
    fmt = KVCacheFormat(name, dtype)
    k_float, v_float, order = scattered_cache(num_blocks, page, num_kv_heads, head_dim, torch.float32, seed)
    k_cache, v_cache = fmt.quantize_rows(k_float), fmt.quantize_rows(v_float)
    return fmt, k_cache, v_cache, fmt.dequantize_rows(k_cache), fmt.dequantize_rows(v_cache), order


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_cache_writes_the_bytes_quantize_rows_gives(name, dtype):
    """Bit for bit for float32 keys and values; 16-bit ones are widened to float32 exactly first,
    on both sides, so they match bit for bit too. Scales span 1e-4 to 300, rows hold ties (x.5
    steps), an all-zero row (scale 1), and the slot -1 writes nothing."""
    kv_heads, head_dim, page = 3, 48, 8
    fmt = KVCacheFormat(name, dtype)
    fused = torch.randn(6, 3 * kv_heads * head_dim) * 3.0
    k = fused[:, : kv_heads * head_dim].view(6, kv_heads, head_dim)  # strided views, as the engine has them
    v = fused[:, 2 * kv_heads * head_dim :].view(6, kv_heads, head_dim)
    k.mul_(torch.tensor([1e-4, 1.0, 100.0]).view(1, 3, 1))
    k[0, 0] = 0.0
    limit = 127.0 if name == "int8" else 448.0
    k[1, 1, :6] = torch.tensor([limit, 2.5, -2.5, 0.5, 1.5, -3.5]) * (7.0 / limit)  # scale 7 / limit: ties
    k, v = k.to(DEVICE, dtype), v.to(DEVICE, dtype)
    k_cache = torch.zeros(4, page, kv_heads, fmt.row_width(head_dim), dtype=torch.int8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = [3 * page + 5, -1, 0, page + 7, 2 * page, 2 * page + 1]
    kernels.write_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots, device=DEVICE), fmt)
    for row, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(k_cache.view(-1, kv_heads, head_dim + 4)[slot], fmt.quantize_rows(k[row]))
            assert torch.equal(v_cache.view(-1, kv_heads, head_dim + 4)[slot], fmt.quantize_rows(v[row]))
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 5, "the -1 slot writes nothing"


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page", [(8, 2, 64, 16), (6, 2, 48, 8), (4, 4, 128, 16)])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_reads_8bit_rows(name, num_heads, num_kv_heads, head_dim, page, window):
    lengths = [1, page + 1, 2 * page, 150]
    fmt, k_cache, v_cache, k_rows, v_rows, order = quantized_cache(
        name, sum(-(-n // page) for n in lengths) + 2, page, num_kv_heads, head_dim, seed=num_heads + head_dim)
    tables = assign_blocks(order, lengths, page)
    q = torch.randn(len(lengths), num_heads, head_dim, device=DEVICE)
    expected = torch.stack([reference(q[i : i + 1], k_rows, v_rows, tables[i], n, [n - 1], window)[0]
                            for i, n in enumerate(lengths)]).float()
    for splits in (1, 4):
        out = torch.full((len(lengths) + 1, num_heads * head_dim), 7.0, device=DEVICE)
        kernels.paged_decode(q, k_cache, v_cache, table_tensor(tables), torch.tensor(lengths, device=DEVICE), out,
                             head_dim**-0.5, window, splits, fmt)
        torch.testing.assert_close(out[: len(lengths)], expected, rtol=2e-5, atol=2e-5)
        assert (out[len(lengths):] == 7.0).all()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page", [(8, 2, 64, 16), (6, 2, 48, 32)])
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_reads_8bit_rows(name, num_heads, num_kv_heads, head_dim, page, window):
    chunks = [(5, 5), (17, 40), (1, 70)]  # (query rows, context length)
    fmt, k_cache, v_cache, k_rows, v_rows, order = quantized_cache(
        name, sum(-(-n // page) for _, n in chunks) + 2, page, num_kv_heads, head_dim, seed=head_dim + page)
    check_prefill(chunks, k_cache, v_cache, (k_rows, v_rows), assign_blocks(order, [n for _, n in chunks], page),
                  num_heads, window, fmt)


@pytest.mark.parametrize("name", FORMATS)
def test_bfloat16_model_reads_rows_dequantized_to_bfloat16(name):
    """A bfloat16 model's rows dequantize to bfloat16 (as dequantize_rows gives them), then attend."""
    lengths, chunks = [3, 40], [(9, 41)]
    fmt, k_cache, v_cache, k_rows, v_rows, order = quantized_cache(name, 10, 16, 2, 64, seed=9, dtype=torch.bfloat16)
    tables = assign_blocks(order, lengths + [n for _, n in chunks], 16)
    q = torch.randn(len(lengths) + 9, 8, 64, device=DEVICE).to(torch.bfloat16)
    out = torch.empty(len(lengths) + 9, 8 * 64, dtype=torch.bfloat16, device=DEVICE)
    kernels.paged_decode(q[:2], k_cache, v_cache, table_tensor(tables[:2]), torch.tensor(lengths, device=DEVICE), out,
                         0.125, None, 2, fmt)
    kernels.paged_prefill(q, k_cache, v_cache, table_tensor(tables[2:]), torch.tensor([2, 11], device=DEVICE),
                          torch.tensor([41], device=DEVICE), 9, out, 0.125, None, fmt)
    expected = [reference(q[i : i + 1], k_rows, v_rows, tables[i], n, [n - 1], None) for i, n in enumerate(lengths)]
    expected.append(reference(q[2:], k_rows, v_rows, tables[2], 41, list(range(32, 41)), None))
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(out.double(), torch.cat(expected), rtol=tol, atol=tol)


def test_a_cache_of_the_wrong_width_is_refused():
    fmt = KVCacheFormat("int8", torch.float32)
    k_cache = torch.zeros(2, 16, 2, 64, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="int8 cache rows of head_dim 64 are 68 int8 values, got 64"):
        kernels.paged_decode(torch.zeros(1, 4, 64, device=DEVICE), k_cache, k_cache.clone(),
                             torch.zeros(1, 1, dtype=torch.int64, device=DEVICE), torch.ones(1, device=DEVICE),
                             torch.empty(1, 256, device=DEVICE), 0.125, kv_format=fmt)
