"""The native decode attention against plain softmax attention over each request's own keys.

Caches are random and blocks are scattered, so a wrong block-table walk, head mapping, stride
or window shows as a mismatch. Every head size and group size the kernel specialises is
covered, and one it does not (the generic path).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from cluster.engine.kernels import load_library
from cluster.engine.kernels.paged_attention import NativeDecodeAttention, native_decode_attention
from cluster.engine.models.attention import AttentionMetadata, PagedAttention

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def kernel() -> NativeDecodeAttention:
    assert shutil.which("cc") or shutil.which("gcc"), "this machine should have a C compiler"
    found = native_decode_attention()
    assert found is not None, "the native kernel did not build; see the warning logged by cluster.engine.kernels"
    return found


def scattered_case(lengths, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    generator = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lengths]
    num_blocks = sum(counts) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in counts:
        tables.append(order[start : start + count])
        start += count
    widest = max(counts)
    table = torch.tensor([t + [0] * (widest - len(t)) for t in tables], dtype=torch.long)
    # q as the engine has it: a strided view into a fused qkv projection.
    fused = torch.randn(len(lengths), (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q = fused[:, : num_heads * head_dim].view(len(lengths), num_heads, head_dim)
    return q, k_cache, v_cache, tables, table


def dense_reference(q, k_cache, v_cache, tables, lengths, num_kv_heads, window):
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    rows = []
    for row, (blocks, length) in enumerate(zip(tables, lengths)):
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        first = max(0, length - window) if window else 0
        keys, values = keys[first:].repeat_interleave(group, 1), values[first:].repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[row].double(), keys.double()) * head_dim**-0.5
        rows.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values.double()).reshape(-1))
    return torch.stack(rows).float()


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size",
    [(8, 4, 64, 16), (4, 4, 64, 16), (16, 4, 64, 8), (8, 1, 64, 16), (8, 2, 128, 16), (4, 4, 128, 32), (9, 3, 64, 16),
     (6, 2, 128, 16), (6, 2, 48, 16)],
)
@pytest.mark.parametrize("window", [None, 37])
def test_matches_dense_attention(kernel, num_heads, num_kv_heads, head_dim, block_size, window):
    lengths = [1, 2, block_size, block_size + 1, 90, 300]
    q, k_cache, v_cache, tables, table = scattered_case(lengths, num_heads, num_kv_heads, head_dim, block_size)
    out = torch.full((len(lengths) + 2, num_heads * head_dim), 7.0)
    assert kernel.supports(q, k_cache, out)
    kernel(q, k_cache, v_cache, table, torch.tensor(lengths), out, num_kv_heads, window, head_dim**-0.5)
    expected = dense_reference(q, k_cache, v_cache, tables, lengths, num_kv_heads, window)
    torch.testing.assert_close(out[: len(lengths)], expected, rtol=1e-5, atol=1e-5)
    assert (out[len(lengths):] == 7.0).all(), "rows past the decodes (prompt tokens) must be left alone"


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_thread_count_does_not_change_results(kernel, threads):
    lengths = [3, 700, 41, 1, 256]
    q, k_cache, v_cache, _, table = scattered_case(lengths, 8, 4, 64, 16, seed=3)
    results = []
    previous = torch.get_num_threads()
    try:
        for count in (1, threads):
            torch.set_num_threads(count)
            out = torch.empty(len(lengths), 8 * 64)
            kernel(q, k_cache, v_cache, table, torch.tensor(lengths), out, 4, None, 0.125)
            results.append(out)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(results[0], results[1])


def test_layer_uses_the_same_numbers_either_path(kernel, monkeypatch):
    """PagedAttention's plain-torch decode loop and the kernel agree to float rounding."""
    lengths = [5, 64, 130]
    q, k_cache, v_cache, _, table = scattered_case(lengths, 8, 2, 64, 16, seed=5)
    layer = PagedAttention(8, 2, 64, sliding_window=100)
    layer.k_cache, layer.v_cache = k_cache, v_cache
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(lengths), decode_block_table=table,
        decode_context_lens=lengths, decode_lens=torch.tensor(lengths),
    )
    outputs = {}
    for enabled in ("1", "0"):
        monkeypatch.setenv("TANDEM_NATIVE_KERNELS", enabled)
        outputs[enabled] = torch.empty(len(lengths), 8 * 64)
        layer._decode(q, outputs[enabled], meta)
    torch.testing.assert_close(outputs["1"], outputs["0"], rtol=1e-5, atol=1e-6)


def test_unsupported_inputs_fall_back(kernel):
    q = torch.randn(2, 8, 64)
    cache = torch.randn(4, 16, 4, 64)
    out = torch.empty(2, 512)
    assert kernel.supports(q, cache, out)
    assert not kernel.supports(q.bfloat16(), cache.bfloat16(), out.bfloat16())
    assert not kernel.supports(q.transpose(0, 1).contiguous().transpose(0, 1), cache, out)
    assert not kernel.supports(q, cache.transpose(1, 2), out)


def test_disabled_by_environment(monkeypatch):
    load_library.cache_clear()
    try:
        monkeypatch.setenv("TANDEM_NATIVE_KERNELS", "0")
        assert load_library("paged_decode_attention") is None
    finally:
        load_library.cache_clear()


def test_library_is_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    load_library.cache_clear()
    try:
        assert load_library("paged_decode_attention") is not None
        built = list((tmp_path / "kernels").glob("paged_decode_attention-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        load_library.cache_clear()
        assert load_library("paged_decode_attention") is not None
        assert built[0].stat().st_mtime_ns == stamp
        assert not list((tmp_path / "kernels").glob(".build-*")), "no build scratch left behind"
    finally:
        load_library.cache_clear()


def verify_case(num_heads, num_kv_heads, head_dim, block_size, fmt=None, seed=7):
    """A call's rows as a step of the fused step has them: a decode, 5 rows of one request at
    consecutive lengths (a verify: one block table each), a decode, then 37 rows of a prompt
    chunk (more than a group's 16): tables padded to the widest."""
    spans = [(0, [130]), (1, [200 + i for i in range(5)]), (2, [17]), (3, [64 + i for i in range(37)])]
    counts = {request: -(-max(lengths) // block_size) for request, lengths in spans}
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(counts.values()) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    if fmt is not None:
        k_cache, v_cache = fmt.quantize_rows(k_cache), fmt.quantize_rows(v_cache)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    blocks, start = {}, 0
    for request, count in counts.items():
        blocks[request], start = order[start : start + count], start + count
    widest = max(counts.values())
    rows = [(blocks[request], length) for request, lengths in spans for length in lengths]
    table = torch.tensor([b + [0] * (widest - len(b)) for b, _ in rows], dtype=torch.long)
    fused = torch.randn(len(rows), (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    q = fused[:, : num_heads * head_dim].view(len(rows), num_heads, head_dim)
    return q, k_cache, v_cache, [b for b, _ in rows], table, [length for _, length in rows]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (8, 2, 128, 8), (6, 2, 48, 16)])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_reading_the_same_blocks_get_the_bits_they_get_alone(kernel, num_heads, num_kv_heads, head_dim,
                                                                     block_size, window, threads):
    """Rows of one request in one call (a verify's, a prompt chunk's: read together, each key once
    for all of them) give, bit for bit, what each row gives in a call of its own (a one-row decode
    step): so a guess checked in a verify gets the token a plain step would. And they are right."""
    q, k_cache, v_cache, tables, table, lengths = verify_case(num_heads, num_kv_heads, head_dim, block_size)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        together = torch.empty(len(lengths), num_heads * head_dim)
        kernel(q, k_cache, v_cache, table, torch.tensor(lengths), together, num_kv_heads, window, head_dim**-0.5)
        alone = torch.empty_like(together)
        for row, length in enumerate(lengths):
            kernel(q[row : row + 1], k_cache, v_cache, table[row : row + 1], torch.tensor([length]), alone[row : row + 1],
                   num_kv_heads, window, head_dim**-0.5)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone)
    expected = dense_reference(q, k_cache, v_cache, tables, lengths, num_kv_heads, window)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_8bit_rows_reading_the_same_blocks_get_the_bits_they_get_alone(kernel, name):
    from cluster.engine.quantization.kv_format import KVCacheFormat

    fmt = KVCacheFormat(name, torch.float32)
    q, k_cache, v_cache, tables, table, lengths = verify_case(9, 3, 64, 16, fmt)
    together = torch.empty(len(lengths), 9 * 64)
    kernel(q, k_cache, v_cache, table, torch.tensor(lengths), together, 3, None, 0.125, fmt)
    alone = torch.empty_like(together)
    for row, length in enumerate(lengths):
        kernel(q[row : row + 1], k_cache, v_cache, table[row : row + 1], torch.tensor([length]), alone[row : row + 1], 3,
               None, 0.125, fmt)
    assert torch.equal(together, alone)
    expected = dense_reference(q, fmt.dequantize_rows(k_cache), fmt.dequantize_rows(v_cache), tables, lengths, 3, None)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)
