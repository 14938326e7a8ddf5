"""How a Hugging Face checkpoint ships quantized: its ``config.json``'s ``quantization_config``.

Served (as transformers, vLLM and AutoAWQ/GPTQModel lay the tensors out):

- ``quant_method: fp8`` (transformers' fine-grained FP8, as DeepSeek-V3 and Qwen3-FP8 ship):
  ``weight`` float8_e4m3fn and ``weight_scale_inv``, one scale per ``weight_block_size`` block of
  rows x columns (``[128, 128]``), or one per tensor without a block size; ``w = code * scale``.
- ``quant_method: compressed-tensors`` with 8-bit float weights (format ``float-quantized`` or
  ``naive-quantized``): ``weight`` float8_e4m3fn and ``weight_scale`` per tensor, output channel,
  group or block (strategy ``tensor``, ``channel``, ``group``, ``block``).
- ``quant_method: awq``, GEMM version, 4 bits with zero points.
- ``quant_method: gptq``, 4 bits, format ``gptq`` (v1: zero points stored less one) or ``gptq_v2``.

What these checkpoints say of activations (static input scales, FP8 KV-cache scales) is not
applied: activations and the KV cache stay in the engine's dtype, as weight-only kernels run them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("awq", "compressed-tensors", "fp8", "gptq")
FLOAT_FORMATS = ("float-quantized", "naive-quantized")  # compressed-tensors formats storing float8 weights as is
COLUMN_ALIGNMENT = 32  # the packed layouts' group: a scale must cover whole groups of 32 columns


class CheckpointQuantizationError(ValueError):
    """The checkpoint's quantization is one we do not serve (the message names the key)."""


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str  # fp8, compressed-tensors, awq or gptq
    # fp8 and compressed-tensors: rows and columns one scale covers (None: all of them).
    scale_block: tuple[int | None, int | None] = (None, None)
    scale_name: str = "weight_scale_inv"  # the scale tensor beside each float8 weight
    group_size: int | None = None  # awq, gptq: input columns per scale and zero point (None: a whole row)
    zero_offset: int = 0  # gptq: added to each stored zero point (v1 stores them less one)

    @property
    def float8(self) -> bool:
        return self.method in ("fp8", "compressed-tensors")


def _fail(message: str):
    raise CheckpointQuantizationError(message)


def _positive(value: Any, what: str, aligned: bool = True) -> int:
    """A positive integer; ``aligned``: also a multiple of 32 (a count of columns)."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        _fail(f"{what} must be a positive integer, got {value!r}")
    if aligned and value % COLUMN_ALIGNMENT:
        _fail(f"{what} {value} is not a multiple of {COLUMN_ALIGNMENT}, which the packed layouts need")
    return value


def _group_size(raw: dict[str, Any], method: str) -> int | None:
    """awq/gptq's group_size: -1 (or absent for neither) means one group per row."""
    value = raw.get("group_size", 128)
    return None if value == -1 else _positive(value, f"quantization_config.group_size ({method})")


def _four_bits(raw: dict[str, Any], method: str) -> None:
    if raw.get("bits", 4) != 4:
        _fail(f"quantization_config.bits {raw['bits']!r}: {method} is served with 4 bits only")


def _block(block: Any, what: str) -> tuple[int, int]:
    """[rows, columns] one scale covers."""
    if isinstance(block, str):  # older compressed-tensors exports write "128x128"
        block = block.lower().split("x")
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        _fail(f"{what} must be [rows, columns], got {block!r}")
    return _positive(block[0], f"{what} rows", aligned=False), _positive(block[1], f"{what} columns")


def _fp8(raw: dict[str, Any]) -> CheckpointQuantization:
    if raw.get("fmt", "e4m3") != "e4m3":
        _fail(f"quantization_config.fmt {raw['fmt']!r}: only e4m3 FP8 weights are served")
    block = raw.get("weight_block_size")
    if block is None:
        return CheckpointQuantization("fp8")
    return CheckpointQuantization("fp8", _block(block, "quantization_config.weight_block_size"))


def _compressed_tensors_block(args: dict[str, Any]) -> tuple[int | None, int | None]:
    strategy = args.get("strategy")
    if strategy == "tensor":
        return None, None
    if strategy == "channel":
        return 1, None
    if strategy == "group":
        return 1, _positive(args.get("group_size"), "compressed-tensors weights.group_size")
    if strategy == "block":
        return _block(args.get("block_structure"), "compressed-tensors weights.block_structure")
    _fail(f"compressed-tensors weights.strategy {strategy!r} is not served (tensor, channel, group, block are)")


def _compressed_tensors(raw: dict[str, Any]) -> CheckpointQuantization:
    if raw.get("sparsity_config"):
        _fail("compressed-tensors sparsity_config: sparse checkpoints are not served")
    groups = raw.get("config_groups") or {}
    if not groups:
        _fail("compressed-tensors quantization_config has no config_groups")
    blocks = set()
    for name, group in groups.items():
        fmt = group.get("format") or raw.get("format")
        if fmt not in FLOAT_FORMATS:
            _fail(f"compressed-tensors format {fmt!r} (config group {name}) is not served; "
                  f"float8 weights ({', '.join(FLOAT_FORMATS)}) are")
        args = group.get("weights") or {}
        if args.get("type") != "float" or args.get("num_bits") != 8:
            _fail(f"compressed-tensors config group {name}: weights of type {args.get('type')!r} with "
                  f"{args.get('num_bits')!r} bits are not served (8-bit float weights are)")
        if args.get("symmetric") is False:
            _fail(f"compressed-tensors config group {name}: asymmetric float8 weights are not served")
        blocks.add(_compressed_tensors_block(args))
    if len(blocks) > 1:
        _fail("compressed-tensors config groups with different weight scale strategies are not served")
    return CheckpointQuantization("compressed-tensors", blocks.pop(), scale_name="weight_scale")


def _awq(raw: dict[str, Any]) -> CheckpointQuantization:
    version = str(raw.get("version", raw.get("format", "gemm"))).lower()
    if version != "gemm":
        _fail(f"quantization_config.version {version!r}: AWQ is served in its GEMM layout only")
    _four_bits(raw, "awq")
    if raw.get("zero_point", True) is not True:
        _fail("quantization_config.zero_point false: AWQ is served with zero points only")
    return CheckpointQuantization("awq", group_size=_group_size(raw, "awq"))


def _gptq(raw: dict[str, Any]) -> CheckpointQuantization:
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        _fail(f"quantization_config.checkpoint_format {fmt!r}: GPTQ is served in the gptq and gptq_v2 formats")
    _four_bits(raw, "gptq")
    return CheckpointQuantization("gptq", group_size=_group_size(raw, "gptq"), zero_offset=1 if fmt == "gptq" else 0)


PARSERS = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq}


def parse_checkpoint_quantization(raw: dict[str, Any] | None) -> CheckpointQuantization | None:
    """``quantization_config`` as a :class:`CheckpointQuantization`; None for a float checkpoint."""
    if not raw:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method not in PARSERS:
        _fail(f"quantization_config.quant_method {raw.get('quant_method')!r} is not supported; "
              f"supported: {', '.join(METHODS)}")
    return PARSERS[method](raw)
