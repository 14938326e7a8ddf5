"""The Triton attention kernels against plain softmax attention over each request's own keys.

Without CUDA they run under Triton's CPU interpreter (set here, before the kernels module is
imported); with CUDA, natively. Caches are random and blocks scattered, so a wrong block-table
walk, head mapping, stride, split merge, mask or window shows as a mismatch. Shapes are small
so the interpreter stays quick; the families cover head dims (64, 128, 256 and the padded 48
and 96), GQA groups 1 to 8, page sizes, sliding windows, contexts around block edges, split counts, and
mixed steps of decodes and prompt chunks through the attention layer (with 16-bit and 8-bit caches;
the 8-bit kernels' own tests are in test_triton_attention_8bit.py).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from cluster.engine.fused_inputs import build_fused_step  # noqa: E402
from cluster.engine.kernels import triton_attention as kernels  # noqa: E402
from cluster.engine.models.attention import AttentionMetadata, PagedAttention, PrefillSpan, visible_keys  # noqa: E402
from cluster.engine.quantization.kv_format import KVCacheFormat  # noqa: E402

pytestmark = pytest.mark.unit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def scattered_cache(num_blocks, page, num_kv_heads, head_dim, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    return k_cache, v_cache, torch.randperm(num_blocks, generator=generator).tolist()


def assign_blocks(order, lengths, page):
    tables, start = [], 0
    for n in lengths:
        count = -(-n // page)
        tables.append(order[start : start + count])
        start += count
    return tables


def table_tensor(tables):
    widest = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (widest - len(t)) for t in tables], dtype=torch.int64, device=DEVICE)


def reference(q_rows, k_cache, v_cache, blocks, context_len, query_positions, window):
    """float64 attention of queries [Q, H, D] at ``query_positions`` over one request's keys."""
    num_heads, head_dim = q_rows.shape[1], q_rows.shape[2]
    kv_heads = k_cache.shape[2]
    keys = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:context_len].double()
    values = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:context_len].double()
    keys = keys.repeat_interleave(num_heads // kv_heads, 1)
    values = values.repeat_interleave(num_heads // kv_heads, 1)
    scores = torch.einsum("qhd,thd->hqt", q_rows.double(), keys) * head_dim**-0.5
    mask = visible_keys(torch.tensor(query_positions), context_len, window).to(scores.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), values).reshape(len(query_positions), -1)


DECODE_SHAPES = [  # heads, kv heads, head dim, page
    (4, 4, 64, 16),
    (8, 4, 64, 16),
    (8, 2, 128, 16),
    (16, 4, 64, 8),
    (8, 1, 64, 32),
    (6, 2, 48, 16),
    (4, 4, 96, 16),
    (4, 2, 256, 16),
]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page", DECODE_SHAPES)
@pytest.mark.parametrize("window", [None, 37])
def test_decode_matches_reference(num_heads, num_kv_heads, head_dim, page, window):
    lengths = [1, page - 1, page, page + 1, 2 * page, 150]
    k_cache, v_cache, order = scattered_cache(sum(-(-n // page) for n in lengths) + 2, page, num_kv_heads, head_dim,
                                              torch.float32, seed=num_heads + head_dim)
    tables = assign_blocks(order, lengths, page)
    q = torch.randn(len(lengths), num_heads, head_dim, device=DEVICE)
    expected = torch.stack([
        reference(q[i : i + 1], k_cache, v_cache, tables[i], n, [n - 1], window)[0] for i, n in enumerate(lengths)
    ]).float()
    for splits in (1, 4):
        out = torch.full((len(lengths) + 2, num_heads * head_dim), 7.0, device=DEVICE)
        kernels.paged_decode(q, k_cache, v_cache, table_tensor(tables), torch.tensor(lengths, device=DEVICE), out,
                             head_dim**-0.5, window, splits)
        torch.testing.assert_close(out[: len(lengths)], expected, rtol=2e-5, atol=2e-5)
        assert (out[len(lengths):] == 7.0).all(), "rows past the decodes (prompt tokens) must be left alone"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_in_half_precision(dtype):
    lengths = [3, 33, 200]
    k_cache, v_cache, order = scattered_cache(24, 16, 2, 64, dtype, seed=7)
    tables = assign_blocks(order, lengths, 16)
    q = torch.randn(len(lengths), 8, 64, device=DEVICE).to(dtype)
    out = torch.empty(len(lengths), 8 * 64, dtype=dtype, device=DEVICE)
    kernels.paged_decode(q, k_cache, v_cache, table_tensor(tables), torch.tensor(lengths, device=DEVICE), out,
                         0.125, None, 2)
    expected = torch.stack([reference(q[i : i + 1], k_cache, v_cache, tables[i], n, [n - 1], None)[0]
                            for i, n in enumerate(lengths)])
    torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_decode_padding_rows_give_zeros():
    """A CUDA-graph batch pads with rows of length 0: they attend to nothing and output zeros."""
    k_cache, v_cache, order = scattered_cache(8, 16, 2, 64, torch.float32, seed=3)
    q = torch.randn(3, 4, 64, device=DEVICE)
    table = torch.tensor([[order[0], order[1]], [0, 0], [0, 0]], device=DEVICE)
    for splits in (1, 2):
        out = torch.full((3, 4 * 64), 5.0, device=DEVICE)
        kernels.paged_decode(q, k_cache, v_cache, table, torch.tensor([20, 0, 0], device=DEVICE), out, 0.125, None,
                             splits)
        expected = reference(q[:1], k_cache, v_cache, [order[0], order[1]], 20, [19], None)[0].float()
        torch.testing.assert_close(out[0], expected, rtol=2e-5, atol=2e-5)
        assert (out[1:] == 0).all()


# Chunks as (query rows, context length): fresh prompts, chunks after cached context, a one-token
# chunk, and a context that ends right at a block edge.
CHUNKS = [(5, 5), (17, 40), (33, 33), (1, 70), (16, 48)]


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, page", [
    (4, 4, 64, 16), (8, 2, 64, 16), (8, 1, 128, 8), (6, 2, 48, 32), (2, 1, 256, 16),
])
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_chunks_match_reference(num_heads, num_kv_heads, head_dim, page, window):
    k_cache, v_cache, order = scattered_cache(sum(-(-n // page) for _, n in CHUNKS) + 2, page, num_kv_heads, head_dim,
                                              torch.float32, seed=head_dim + page)
    check_prefill(CHUNKS, k_cache, v_cache, (k_cache, v_cache), assign_blocks(order, [n for _, n in CHUNKS], page),
                  num_heads, window)


def check_prefill(chunks, k_cache, v_cache, reference_rows, tables, num_heads, window, kv_format=None):
    """paged_prefill of ``chunks`` ((query rows, context length), after three rows of decodes that
    it must leave alone) against the float64 reference over ``reference_rows`` (the caches' keys
    and values as floats)."""
    head_dim = reference_rows[0].shape[-1]
    first = 3
    starts = [first]
    for rows, _ in chunks:
        starts.append(starts[-1] + rows)
    q = torch.randn(starts[-1], num_heads, head_dim, device=DEVICE)
    out = torch.full((starts[-1], num_heads * head_dim), 7.0, device=DEVICE)
    kernels.paged_prefill(q, k_cache, v_cache, table_tensor(tables), torch.tensor(starts, device=DEVICE),
                          torch.tensor([n for _, n in chunks], device=DEVICE), max(r for r, _ in chunks), out,
                          head_dim**-0.5, window, kv_format)
    for c, (rows, context) in enumerate(chunks):
        expected = reference(q[starts[c] : starts[c] + rows], *reference_rows, tables[c], context,
                             list(range(context - rows, context)), window).float()
        torch.testing.assert_close(out[starts[c] : starts[c] + rows], expected, rtol=2e-5, atol=2e-5)
    assert (out[:first] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_in_half_precision(dtype):
    chunks = [(20, 20), (9, 41)]
    k_cache, v_cache, order = scattered_cache(8, 16, 2, 64, dtype, seed=11)
    tables = assign_blocks(order, [n for _, n in chunks], 16)
    q = torch.randn(29, 8, 64, device=DEVICE).to(dtype)
    out = torch.empty(29, 8 * 64, dtype=dtype, device=DEVICE)
    kernels.paged_prefill(q, k_cache, v_cache, table_tensor(tables), torch.tensor([0, 20, 29], device=DEVICE),
                          torch.tensor([20, 41], device=DEVICE), 20, out, 0.125, None)
    for c, ((rows, context), start) in enumerate(zip(chunks, (0, 20))):
        expected = reference(q[start : start + rows], k_cache, v_cache, tables[c], context,
                             list(range(context - rows, context)), None)
        torch.testing.assert_close(out[start : start + rows].double(), expected, rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype])


def test_write_kv_cache_follows_slots_and_skips_negative_ones():
    kv_heads, head_dim, page = 2, 48, 8
    k_cache = torch.zeros(4, page, kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # k and v as the engine has them: strided views into one fused projection.
    fused = torch.randn(4, 3 * kv_heads * head_dim, device=DEVICE)
    k = fused[:, : kv_heads * head_dim].view(4, kv_heads, head_dim)
    v = fused[:, 2 * kv_heads * head_dim :].view(4, kv_heads, head_dim)
    slots = torch.tensor([3 * page + 5, -1, 0, page + 7], device=DEVICE)
    kernels.write_kv_cache(k, v, k_cache, v_cache, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // page, slot % page], k[row])
            assert torch.equal(v_cache[slot // page, slot % page], v[row])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3, "the -1 slot writes nothing"


@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_mixed_step_through_the_layer_matches_the_torch_path(window, cache_dtype):
    """One step of three decodes and three prompt chunks (fresh, with cached context, a single
    token) through PagedAttention: fused metadata and the torch path give the same output and
    write the same cache, the same bytes in an 8-bit cache too (the torch path quantizing with
    KVCacheFormat, the kernels as they write, both attending to the rows as the cache holds them)."""
    num_heads, kv_heads, head_dim, page = 8, 2, 64, 16
    decode_lens = [1, 17, 64]
    chunks = [(12, 12), (20, 50), (1, 33)]  # (rows, context length)
    contexts = decode_lens + [n for _, n in chunks]
    num_blocks = sum(-(-n // page) for n in contexts) + 2
    base_k, base_v, order = scattered_cache(num_blocks, page, kv_heads, head_dim, torch.float32, seed=5)
    fmt = KVCacheFormat(cache_dtype, torch.float32)
    base_k, base_v = fmt.quantize_rows(base_k), fmt.quantize_rows(base_v)
    tables = assign_blocks(order, contexts, page)
    positions = [n - 1 for n in decode_lens] + [p for rows, n in chunks for p in range(n - rows, n)]
    owners = list(range(3)) + [3 + c for c, (rows, _) in enumerate(chunks) for _ in range(rows)]
    slots = [tables[o][p // page] * page + p % page for o, p in zip(owners, positions)]
    tokens = len(positions)
    q = torch.randn(tokens, num_heads, head_dim, device=DEVICE)
    k = torch.randn(tokens, kv_heads, head_dim, device=DEVICE)
    v = torch.randn(tokens, kv_heads, head_dim, device=DEVICE)
    layer = PagedAttention(num_heads, kv_heads, head_dim, window)
    layer.kv_format = fmt if fmt.quantized else None

    starts = [3]
    for rows, _ in chunks:
        starts.append(starts[-1] + rows)
    step = build_fused_step(
        [0] * tokens, positions, slots, [], decode_lens, [tables[i] for i in range(3)],
        [(starts[c], rows, n, tables[3 + c]) for c, (rows, n) in enumerate(chunks)], 2, DEVICE,
    )
    layer.k_cache, layer.v_cache = base_k.clone(), base_v.clone()
    fused_out = layer(q, k, v, AttentionMetadata(slot_mapping=step.slot_mapping, num_decodes=3, fused=step.fused))
    fused_cache = (layer.k_cache, layer.v_cache)

    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), num_decodes=3, decode_context_lens=decode_lens,
        decode_lens=torch.tensor(decode_lens), decode_block_table=table_tensor(tables[:3]),
    )
    for c, (rows, n) in enumerate(chunks):
        span = PrefillSpan(starts[c], rows, n)
        if n > rows:
            span.block_ids = torch.tensor(tables[3 + c], device=DEVICE)
        if n > rows or (window is not None and n > window):
            span.mask = visible_keys(torch.arange(n - rows, n), n, window).to(DEVICE)
        meta.prefills.append(span)
    layer.k_cache, layer.v_cache = base_k.clone(), base_v.clone()
    torch_out = layer(q, k, v, meta)
    torch.testing.assert_close(fused_out, torch_out, rtol=2e-5, atol=2e-5)
    assert torch.equal(fused_cache[0], layer.k_cache) and torch.equal(fused_cache[1], layer.v_cache)
