"""Reading GGUF tensors: dequantization of every promised type against ``transformers``' own
torch dequantizer (an implementation independent of the ``gguf`` package's numpy one), slices
that dequantize only what they return, the Llama Q/K row order, and tensor names."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, MODEL_ARCH, get_tensor_name_map

from cluster.engine.models.gguf_checkpoint import GGUFTensorSlice, hf_tensor_name, unpermute_rows
from gguf_files import encode_tensor, llama_cpp_permute

pytestmark = pytest.mark.unit

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]
ROWS, COLS = 12, 512


@pytest.fixture(scope="module")
def tensors(tmp_path_factory):
    """One ROWS x COLS tensor of each type in a GGUF file, read back: name -> reader tensor."""
    path = tmp_path_factory.mktemp("tensors") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for index, qtype in enumerate(TYPES):
        data = encode_tensor(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype, seed=index)
        writer.add_tensor(qtype.name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in GGUFReader(str(path)).tensors}


def independent_dequantize(tensor) -> torch.Tensor:
    raw = np.asarray(tensor.data)
    if tensor.tensor_type == Q.F32:
        return torch.from_numpy(raw.astype(np.float32))
    if tensor.tensor_type == Q.F16:
        return torch.from_numpy(raw.astype(np.float32))
    if tensor.tensor_type == Q.BF16:
        halves = raw.reshape(ROWS, -1).view(np.uint16).astype(np.uint32) << 16
        return torch.from_numpy(halves.view(np.float32))
    from transformers.integrations.gguf.dequant import dequantize

    return dequantize(torch.from_numpy(raw.copy()), int(tensor.tensor_type), torch.float32).reshape(ROWS, COLS)


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_dequantization_matches_transformers(tensors, qtype):
    tensor = tensors[qtype.name]
    ours = GGUFTensorSlice(tensor, torch.float32)
    assert ours.get_shape() == [ROWS, COLS]
    full = ours[:]
    torch.testing.assert_close(full, independent_dequantize(tensor), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(full).all() and full.abs().max() > 0
    torch.testing.assert_close(ours[(slice(3, 7),)], full[3:7], rtol=0, atol=0)
    torch.testing.assert_close(ours[(slice(None), slice(128, 384))], full[:, 128:384], rtol=0, atol=0)
    assert ours[(slice(2, 4),)].dtype == torch.float32
    assert GGUFTensorSlice(tensor, torch.bfloat16)[:].dtype == torch.bfloat16


def test_row_slices_dequantize_only_those_rows(tensors, monkeypatch):
    import gguf.quants

    seen = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: seen.append(data.shape) or real(data, qtype))
    GGUFTensorSlice(tensors["Q4_K"], torch.float32)[(slice(4, 7),)]
    assert seen == [(3, COLS // 256 * 144)]


@pytest.mark.parametrize("rows,heads", [(64, 4), (32, 2), (192, 3), (8, 1)])
def test_unpermute_rows_undoes_llama_cpp_and_matches_transformers(rows, heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    original = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    stored = llama_cpp_permute(original, heads)
    assert not np.array_equal(stored, original) or rows // heads == 2
    np.testing.assert_array_equal(stored[unpermute_rows(rows, heads)], original)
    undone = LlamaTensorProcessor()._reverse_permute_weights(stored, heads, heads)
    np.testing.assert_array_equal(stored[unpermute_rows(rows, heads)], undone)


def test_reordered_slices_read_the_unpermuted_rows(tensors):
    order = unpermute_rows(ROWS, 3)
    tensor = tensors["Q8_0"]
    plain, reordered = GGUFTensorSlice(tensor, torch.float32), GGUFTensorSlice(tensor, torch.float32, order)
    torch.testing.assert_close(reordered[:], plain[:][torch.from_numpy(order)], rtol=0, atol=0)
    torch.testing.assert_close(reordered[(slice(4, 8),)], plain[:][torch.from_numpy(order[4:8])], rtol=0, atol=0)


@pytest.mark.parametrize("arch", [MODEL_ARCH.LLAMA, MODEL_ARCH.QWEN2, MODEL_ARCH.QWEN3])
def test_tensor_names_are_the_inverse_of_gguf_s_own_map(arch):
    names = get_tensor_name_map(arch, 3)
    ours = [
        "model.embed_tokens", "model.norm", "lm_head",
        *(f"model.layers.2.{leaf}" for leaf in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    ]
    if arch == MODEL_ARCH.QWEN3:
        ours += ["model.layers.2.self_attn.q_norm", "model.layers.2.self_attn.k_norm"]
    for name in ours:
        for kind in ("weight", "bias"):
            assert hf_tensor_name(f"{names.get_name(name)}.{kind}") == f"{name}.{kind}"
    assert hf_tensor_name("blk.0.ssm_conv1d.weight") is None and hf_tensor_name("rope_freqs.weight") is None


@pytest.mark.parametrize("tp_size", [16, 32])
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_a_row_parallel_rank_keeps_its_columns_packed_only_on_32_column_blocks(tensors, qtype, tp_size):
    """Rank 3's COLS / tp_size columns: 32 of them stay packed (the same codes and scales as those
    columns of the whole weight); 16 are widened, even for Q6_K, whose groups of 16 they fall on,
    because the kernel reads whole blocks of 32 columns. Both multiply to the same result."""
    from cluster.engine.models.layers import ParallelGroup, RowParallelLinear
    from cluster.engine.quantization.gguf_repack import repack

    tensor = tensors[qtype.name]
    layer = RowParallelLinear(COLS, ROWS, group=ParallelGroup(rank=3, size=tp_size), quantization="gguf")
    layer.weight_loader(layer.weight, GGUFTensorSlice(tensor, torch.float32))
    layer.finish_loading()
    width = COLS // tp_size
    columns = slice(3 * width, 4 * width)
    full = GGUFTensorSlice(tensor, torch.float32)[:]
    if width % 32 == 0:
        ((first, part),) = layer.packed
        expected = repack(np.asarray(tensor.data), qtype).col_slice(columns.start, width)
        assert first == 0 and (part.layout, part.group) == (expected.layout, expected.group)
        for ours, theirs in ((part.codes, expected.codes), (part.scales, expected.scales), (part.mins, expected.mins)):
            assert (ours is None and theirs is None) or torch.equal(ours, theirs)
    else:
        assert layer.packed == ()
        assert torch.equal(layer.weight, full[:, columns])
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(layer._matmul(x), x @ full[:, columns].T, rtol=1e-5, atol=1e-5)
