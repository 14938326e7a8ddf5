"""Which form the weights are served in, from ``model.quantization`` and the checkpoint.

``auto``: a quantized checkpoint on the CPU is served as shipped (a GGUF's blocks, ``gguf``, or a
Hugging Face checkpoint's FP8/AWQ/GPTQ tensors, ``checkpoint``: repacked, not widened); anything
else in floats. ``none``: floats always (quantized weights are widened). ``int8`` / ``int4`` /
``fp8``: a float checkpoint quantized at load. The quantized kernels are CPU kernels so far: on
CUDA a quantized checkpoint is widened, and ``int8``/``int4``/``fp8`` are refused.
"""

from __future__ import annotations

CHOICES = ("auto", "none", "int8", "int4", "fp8")
AS_SHIPPED = ("gguf", "checkpoint")  # ModelConfig.quantization values that keep the checkpoint's own codes


class QuantizationChoiceError(ValueError):
    pass


def resolve_quantization(requested: str, shipped: str | None, device: str) -> str:
    """The ``ModelConfig.quantization`` an engine runs with: none, gguf, checkpoint, int8, int4
    or fp8. ``shipped``: how the checkpoint is quantized, None for floats, ``gguf`` for a GGUF
    file, else the Hugging Face ``quant_method`` (fp8, compressed-tensors, awq, gptq)."""
    if requested not in CHOICES:
        raise QuantizationChoiceError(f"quantization must be one of {', '.join(CHOICES)}, got {requested!r}")
    on_cpu = device == "cpu"
    if requested == "auto":
        if shipped is None or not on_cpu:
            return "none"
        return "gguf" if shipped == "gguf" else "checkpoint"
    if requested == "none":
        return "none"
    if shipped is not None:
        what = "the GGUF file" if shipped == "gguf" else f"the checkpoint ({shipped})"
        raise QuantizationChoiceError(f"quantization {requested}: {what} is already quantized; "
                                      "use auto (served as shipped) or none (widened)")
    if not on_cpu:
        raise QuantizationChoiceError(f"quantization {requested} has no kernel on {device} yet; use none")
    return requested
