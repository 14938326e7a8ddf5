"""A float checkpoint quantized at load (``quantization: int8 | int4 | fp8``) on a tiny random model:
greedy tokens equal ``transformers`` running the weights the quantization gives (each packed
weight dequantized), through the fused decode step; fp8's codes are e4m3fn values within 1/16 of
each weight (3 mantissa bits) or half a subnormal step of its group's scale."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.quantization.quantize import F8_MAX
from cluster.offline.llm import LLM
from reference_checks import assert_batch_matches_reference
from test_hf_quantized import FUSED, our_layers

pytestmark = pytest.mark.integration

LAYOUTS = {"int8": "q8", "int4": "q4", "fp8": "f8"}


def served_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """Each quantized linear layer's weight as the engine holds it, dequantized, under the
    checkpoint's names."""
    model, weights = llm.engine.runner.model, {}
    for index in range(model.config.num_layers):
        for fused, layer in our_layers(model, index).items():
            (first, packed), = layer.packed
            assert first == 0
            parts = FUSED[fused]
            sizes = [layer.out_features // len(parts)] * len(parts)
            if fused == "qkv_proj":
                sizes = [layer.head_dim * layer.local_heads] + [layer.head_dim * layer.local_kv_heads] * 2
            group = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            for part, rows in zip(parts, packed.dequantize().split(sizes)):
                weights[f"model.layers.{index}.{group}.{part}.weight"] = rows
    return weights


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_quantized_at_load_matches_transformers_on_the_served_weights(checkpoint, reference_model, kind):
    import transformers

    path = checkpoint("llama")
    with LLM(str(path), dtype="float32", verbose=False, num_kv_blocks=16, quantization=kind) as llm:
        assert llm.engine.model_config.quantization == kind
        assert llm.engine.runner.native_step is not None
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert layer.packed[0][1].layout == LAYOUTS[kind]
        served = served_weights(llm)
    original = reference_model(path).state_dict()
    if kind == "fp8":
        for name, weight in served.items():
            error = (weight - original[name]).abs()
            scale = original[name].abs().reshape(weight.shape[0], -1, 32).amax(-1) / F8_MAX
            subnormal_step = scale.repeat_interleave(32, 1) * 2.0**-9
            assert (error <= torch.maximum(original[name].abs() / 16, subnormal_step / 2) * 1.0001).all(), name
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, weight in served.items():
            reference.state_dict()[name].copy_(weight)
    assert_batch_matches_reference(path, reference, f"{kind} at load", quantization=kind)
