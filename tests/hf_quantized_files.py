"""Tiny quantized Hugging Face checkpoints written from a float one, in the layouts the quantizers
publish: transformers' fine-grained FP8 (``weight_scale_inv``), compressed-tensors FP8
(``weight_scale`` per tensor, channel, group or block), AutoAWQ's GEMM packing and GPTQ's (v1, zero
points stored less one, and v2). Each weight's dequantization is computed here too, by the
published formula. All of it is written with plain torch, apart from the loader's code, so the
loader is tested against the formats rather than against itself."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
F8_MAX = 448.0
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_PACK_ORDER[i] of its 8


def _blocked(scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A [R, C] grid of per-block scales expanded to every weight of [rows, cols]."""
    return scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def float8_blocks(weight: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype):
    """(codes float8_e4m3fn, scale grid, dequantized float32): a scale amax / 448 per block."""
    rows, cols = weight.shape
    grid = torch.zeros(-(-rows // block[0]), -(-cols // block[1]))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].abs().max()
    grid = (grid / F8_MAX).clamp(min=1e-8).to(scale_dtype)
    scale = _blocked(grid.float(), rows, cols, block)
    codes = (weight / scale).clamp(-F8_MAX, F8_MAX).to(torch.float8_e4m3fn)
    return codes, grid, codes.float() * scale


def zero_point_groups(weight: torch.Tensor, group: int, min_zero: int = 0):
    """Asymmetric 4-bit quantization of W [out, in] along the input in groups: (q [in, out] in
    0..15, zeros [groups, out], scales fp16 [groups, out], dequantized W [out, in] float32)."""
    t = weight.T.reshape(-1, group, weight.shape[0])  # [groups, group, out]
    low, high = t.amin(1), t.amax(1)
    scales = ((high - low) / 15).clamp(min=1e-4).to(torch.float16)
    s = scales.float()
    zeros = torch.round(-low / s).clamp(min_zero, 15)
    q = (torch.round(t / s.unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, 15)
    dequantized = ((q - zeros.unsqueeze(1)) * s.unsqueeze(1)).reshape(weight.shape[1], -1).T
    return q.reshape(weight.shape[1], -1).to(torch.int64), zeros.to(torch.int64), scales, dequantized.contiguous()


def pack_words(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int64 [..., 8n] in 0..15 -> int32 [..., n]: nibble i of each word holds element order[i]."""
    grouped = values.reshape(*values.shape[:-1], -1, 8)
    words = torch.zeros(grouped.shape[:-1], dtype=torch.int64)
    for i, element in enumerate(order):
        words |= grouped[..., element] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _quantize(method: str, name: str, weight: torch.Tensor, options: dict) -> tuple[dict, torch.Tensor]:
    """The tensors replacing ``<module>.weight``, by leaf, and the dequantized weight."""
    if method == "fp8":  # without a block size, one scale for the tensor (a 0-d tensor, as transformers has it)
        codes, grid, dequantized = float8_blocks(weight, options.get("block", weight.shape), torch.float32)
        return {"weight": codes, "weight_scale_inv": grid if "block" in options else grid.reshape(())}, dequantized
    if method == "compressed-tensors":
        strategy = options["strategy"]
        block = {"tensor": tuple(weight.shape), "channel": (1, weight.shape[1]),
                 "group": (1, options.get("group_size", 32)), "block": options.get("block", (32, 64))}[strategy]
        codes, grid, dequantized = float8_blocks(weight, block, torch.bfloat16)
        tensors = {"weight": codes, "weight_scale": grid.reshape(1) if strategy == "tensor" else grid,
                   "input_scale": torch.ones(1, dtype=torch.bfloat16)}
        return tensors, dequantized
    group = options.get("group_size", 128)
    v1 = method == "gptq" and options.get("format", "gptq") == "gptq"
    q, zeros, scales, dequantized = zero_point_groups(weight, group, min_zero=1 if v1 else 0)
    if method == "awq":
        return {"qweight": pack_words(q, AWQ_PACK_ORDER), "qzeros": pack_words(zeros, AWQ_PACK_ORDER),
                "scales": scales}, dequantized
    stored = (zeros - 1) & 15 if v1 else zeros
    g_idx = torch.arange(weight.shape[1], dtype=torch.int32) // group
    if options.get("act_order"):
        g_idx = g_idx[torch.randperm(len(g_idx), generator=torch.Generator().manual_seed(0))]
    qweight = pack_words(q.T.contiguous(), tuple(range(8))).T.contiguous()  # 8 input rows a word
    tensors = {"qweight": qweight, "qzeros": pack_words(stored, tuple(range(8))), "scales": scales, "g_idx": g_idx}
    if options.get("zero_biases"):  # as some GPTQ exports write for layers that have none
        tensors["bias"] = torch.zeros(weight.shape[0], dtype=torch.float16)
    return tensors, dequantized


def quantization_config(method: str, options: dict) -> dict:
    if method == "fp8":
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        return {**config, "weight_block_size": list(options["block"])} if "block" in options else config
    if method == "compressed-tensors":
        strategy = options["strategy"]
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
                   "group_size": options.get("group_size", 32) if strategy == "group" else None,
                   "block_structure": list(options.get("block", (32, 64))) if strategy == "block" else None}
        inputs = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": inputs}}, "ignore": ["lm_head"]}
    config = {"quant_method": method, "bits": 4, "group_size": options.get("group_size", 128)}
    if method == "awq":
        return {**config, "zero_point": True, "version": "gemm"}
    return {**config, "desc_act": bool(options.get("act_order")), "sym": False,
            "checkpoint_format": options.get("format", "gptq")}


def write_quantized(source: Path, target: Path, method: str, split: bool = False,
                    **options) -> dict[str, torch.Tensor]:
    """Writes ``target``: ``source`` with every linear layer quantized by ``method`` (embeddings,
    norms and the output head stay float). ``split``: the scale and zero-point tensors go to a
    second file of a sharded index. Returns ``{weight name: dequantized float32 [out, in]}``."""
    target.mkdir(parents=True, exist_ok=True)
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        floats = {name: f.get_tensor(name) for name in f.keys()}
    main, side, dequantized = {}, {}, {}
    for name, tensor in floats.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in LINEARS:
            main[name] = tensor
            continue
        tensors, dequantized[name] = _quantize(method, name, tensor.float(), options)
        for key, value in tensors.items():
            (main if key in ("weight", "qweight") or not split else side)[f"{module}.{key}"] = value
    if split:
        files = {"model-00001-of-00002.safetensors": main, "model-00002-of-00002.safetensors": side}
        for file, tensors in files.items():
            save_file(tensors, str(target / file), metadata={"format": "pt"})
        weight_map = {name: file for file, tensors in files.items() for name in tensors}
        (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(main, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, options)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("tokenizer.json", "generation_config.json"):
        if (source / extra).is_file():
            shutil.copy(source / extra, target / extra)
    return dequantized
