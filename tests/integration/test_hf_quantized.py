"""Hugging Face quantized checkpoints (fp8, compressed-tensors FP8, AWQ, GPTQ) served packed on the
CPU: each weight as loaded dequantizes bit for bit to the format's formula (computed by the
writer in ``hf_quantized_files``, apart from the loader), greedy tokens equal ``transformers``
running those dequantized weights, and decode steps run the fused native step. ``none`` widens
the same weights exactly; what we do not serve is refused in one line naming it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from cluster.engine.models.config import ModelConfigError
from cluster.engine.models.hf_checkpoint import ZeroPointWeightSlice
from cluster.engine.models.loader import WeightLoadError, build_model
from cluster.engine.models.read_config import load_model_config
from cluster.offline.llm import LLM
from hf_quantized_files import write_quantized
from reference_checks import assert_batch_matches_reference

pytestmark = pytest.mark.integration

WIDE = dict(hidden_size=256, intermediate_size=512)  # room for AWQ/GPTQ's groups of 128 and FP8's 128-blocks
FUSED = {  # our fused layer -> the checkpoint's projections in it
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}

CASES = {
    "fp8-block128": ("llama", WIDE, "fp8", dict(block=(128, 128))),
    "fp8-tensor": ("qwen3", {}, "fp8", {}),
    "ct-channel": ("qwen2", {}, "compressed-tensors", dict(strategy="channel")),
    "ct-tensor": ("llama", {}, "compressed-tensors", dict(strategy="tensor")),
    "ct-block": ("llama", {}, "compressed-tensors", dict(strategy="block", block=(32, 64))),
    "ct-group": ("llama", {}, "compressed-tensors", dict(strategy="group", group_size=32)),
    "awq": ("llama", WIDE, "awq", dict(split=True)),
    "awq-qwen2": ("qwen2", WIDE, "awq", {}),
    "gptq-v1": ("llama", WIDE, "gptq", dict(format="gptq", zero_biases=True)),
    "gptq-v2-g64": ("qwen3", WIDE, "gptq", dict(format="gptq_v2", group_size=64, split=True)),
}


@pytest.fixture(scope="session")
def quantized(checkpoint, tmp_path_factory):
    """``quantized(case)`` -> (the quantized checkpoint, its float source, dequantized weights)."""
    built: dict[str, tuple] = {}

    def make(case: str):
        if case not in built:
            architecture, size, method, options = CASES[case]
            source = checkpoint(architecture, **size)
            target = tmp_path_factory.mktemp(f"hfq-{case}")
            built[case] = target, source, write_quantized(source, target, method, **options)
        return built[case]

    return make


def reference_with(source, dequantized: dict[str, torch.Tensor]):
    """``transformers`` on the float checkpoint with every quantized weight replaced by its
    dequantized value."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, weight in dequantized.items():
            state[name].copy_(weight)
    return model


def expected_layer(dequantized: dict[str, torch.Tensor], layer: int, parts: tuple[str, ...]) -> torch.Tensor:
    prefix = f"model.layers.{layer}"
    group = "self_attn" if parts[0] in ("q_proj", "o_proj") else "mlp"
    return torch.cat([dequantized[f"{prefix}.{group}.{part}.weight"] for part in parts])


def our_layers(model, layer: int):
    block = model.model.layers[layer]
    return {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj,
            "gate_up_proj": block.mlp.gate_up_proj, "down_proj": block.mlp.down_proj}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_weights_dequantize_exactly_and_tokens_match_transformers(quantized, case):
    path, source, dequantized = quantized(case)
    layout = "f8" if CASES[case][2] in ("fp8", "compressed-tensors") else "q4"
    with LLM(str(path), dtype="float32", verbose=False, num_kv_blocks=16) as llm:
        assert llm.engine.model_config.quantization == "checkpoint"
        assert llm.engine.runner.native_step is not None
        model = llm.engine.runner.model
        for layer in range(model.config.num_layers):
            ours = our_layers(model, layer)
            for fused, parts in FUSED.items():
                (first, weight), = ours[fused].packed
                assert first == 0 and weight.layout == layout
                assert torch.equal(weight.dequantize(), expected_layer(dequantized, layer, parts)), (case, fused)
    assert_batch_matches_reference(path, reference_with(source, dequantized), case)


def test_none_widens_to_the_same_weights(quantized):
    path, _, dequantized = quantized("awq")
    config = load_model_config(path, "float32")
    model = build_model(config, path)
    assert config.quantization == "none"
    for layer in range(config.num_layers):
        ours = our_layers(model, layer)
        for fused, parts in FUSED.items():
            assert not ours[fused].packed
            assert torch.equal(ours[fused].weight, expected_layer(dequantized, layer, parts))


def test_auto_on_cudas_torch_backend_and_none_widen(quantized):
    from cluster.engine.quantization.choice import resolve_quantization

    path, _, _ = quantized("ct-channel")
    method = load_model_config(path).quant_method
    assert method == "compressed-tensors"
    assert resolve_quantization("auto", method, "cuda", "torch") == resolve_quantization("none", method, "cpu") == "none"
    assert resolve_quantization("auto", method, "cuda", "triton") == "checkpoint"
    with pytest.raises(ValueError, match=r"int8: the checkpoint \(compressed-tensors\) is already quantized"):
        resolve_quantization("int8", method, "cpu")


def test_a_permuted_gptq_g_idx_is_refused_in_one_line(checkpoint, tmp_path):
    path = tmp_path / "act-order"
    write_quantized(checkpoint("llama", **WIDE), path, "gptq", act_order=True)
    with pytest.raises(WeightLoadError, match=r"^model\.safetensors: model\.layers\.0\.[a-z_.]+_proj\.weight: "
                       r"g_idx is permuted \(GPTQ desc_act / act-order\), which is not served; "
                       r"use a checkpoint quantized with desc_act=false$"):
        build_model(load_model_config(path, "float32"), path)


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "bitsandbytes"}, r"quant_method 'bitsandbytes' is not supported; "
                                       r"supported: awq, compressed-tensors, fp8, gptq"),
    ({"bits": 8}, r"quantization_config\.bits 8: gptq is served with 4 bits only"),
    ({"group_size": 48}, r"group_size \(gptq\) 48 is not a multiple of 32"),
    ({"checkpoint_format": "marlin"}, r"checkpoint_format 'marlin': GPTQ is served in the gptq and gptq_v2 formats"),
])
def test_unserved_quantization_configs_are_named(quantized, tmp_path, change, message):
    path, _, _ = quantized("gptq-v1")
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"].update(change)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=message):
        load_model_config(folder)


def test_a_tensor_parallel_rank_packs_its_rows_and_columns(quantized):
    """Rank 1 of 2 of an AWQ checkpoint packs the second half of the rows (column-parallel) or of
    the columns (row-parallel): the same values as those of the whole weight."""
    from cluster.engine.models.layers import ParallelGroup

    path, _, dequantized = quantized("awq")
    config = load_model_config(path, "float32")
    model = build_model(replace(config, quantization="checkpoint"), path, group=ParallelGroup(rank=1, size=2))
    ours = our_layers(model, 0)
    (_, down), = ours["down_proj"].packed
    full = dequantized["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.dequantize(), full[:, full.shape[1] // 2 :])
    (_, qkv), = ours["qkv_proj"].packed
    q = dequantized["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(qkv.dequantize()[: q.shape[0] // 2], q[q.shape[0] // 2 :])


def test_zero_point_slices_read_misaligned_rows(quantized):
    """Rows that start inside a packed word, and columns off the 32-column groups (widened)."""
    from safetensors import safe_open

    path, _, dequantized = quantized("awq-qwen2")
    name = "model.layers.1.self_attn.k_proj"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {key: f.get_slice(f"{name}.{key}") for key in ("qweight", "qzeros", "scales")}
        weight = ZeroPointWeightSlice(name, "awq", tensors, 128, 0)
        expected = dequantized[f"{name}.weight"]
        assert torch.equal(weight.packed((slice(3, 29),)).dequantize(), expected[3:29])
        assert weight.packed((slice(None), slice(40, 104))) is None
        assert torch.equal(weight[:, 40:104], expected[:, 40:104])
        assert torch.equal(weight.packed((slice(None), slice(64, 192))).dequantize(), expected[:, 64:192])

