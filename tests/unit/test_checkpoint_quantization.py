"""``config.json``'s ``quantization_config`` as the loader reads it: each served method's scale
layout, and one line naming what is not served."""

from __future__ import annotations

import pytest

from cluster.engine.models.checkpoint_quantization import (
    CheckpointQuantization,
    CheckpointQuantizationError,
    parse_checkpoint_quantization,
)

pytestmark = pytest.mark.unit


def compressed(strategy: str, **weights) -> dict:
    args = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, **weights}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}


@pytest.mark.parametrize("raw,expected", [
    (None, None),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, CheckpointQuantization("fp8", (128, 128))),
    ({"quant_method": "fp8"}, CheckpointQuantization("fp8", (None, None))),
    (compressed("tensor"), CheckpointQuantization("compressed-tensors", (None, None), "weight_scale")),
    (compressed("channel"), CheckpointQuantization("compressed-tensors", (1, None), "weight_scale")),
    (compressed("group", group_size=64), CheckpointQuantization("compressed-tensors", (1, 64), "weight_scale")),
    (compressed("block", block_structure="128x128"),
     CheckpointQuantization("compressed-tensors", (128, 128), "weight_scale")),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM"},
     CheckpointQuantization("awq", group_size=128)),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False},
     CheckpointQuantization("gptq", group_size=None, zero_offset=1)),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "format": "gptq_v2"},
     CheckpointQuantization("gptq", group_size=32, zero_offset=0)),
])
def test_served_methods(raw, expected):
    assert parse_checkpoint_quantization(raw) == expected


@pytest.mark.parametrize("raw,message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 100]},
     "quantization_config.weight_block_size columns 100 is not a multiple of 32"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2': only e4m3 FP8 weights are served"),
    ({**compressed("channel"), "format": "pack-quantized"}, "compressed-tensors format 'pack-quantized'"),
    (compressed("channel", type="int"), "weights of type 'int' with 8 bits are not served"),
    (compressed("token"), "weights.strategy 'token' is not served"),
    ({"quant_method": "awq", "version": "gemv"}, "version 'gemv': AWQ is served in its GEMM layout only"),
    ({"quant_method": "awq", "zero_point": False}, "zero_point false"),
    ({"quant_method": "gptq", "bits": 3}, "bits 3: gptq is served with 4 bits only"),
])
def test_what_is_not_served_is_named(raw, message):
    with pytest.raises(CheckpointQuantizationError, match=message):
        parse_checkpoint_quantization(raw)
