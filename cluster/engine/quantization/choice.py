"""Which form the weights are served in, from ``model.quantization`` and the checkpoint.

``auto``: a quantized checkpoint is served as shipped (a GGUF's blocks, ``gguf``, or a Hugging
Face checkpoint's FP8/AWQ/GPTQ tensors, ``checkpoint``: repacked, not widened) wherever a
quantized kernel runs; anything else in floats. ``none``: floats always (quantized weights are
widened). ``int8`` / ``int4`` / ``fp8``: a float checkpoint quantized at load.

The quantized kernels run on the CPU (``kernels/quantized_matmul.c``) and, on CUDA, on the Triton
backend (``kernels/triton_quantized_matmul.py``): on CUDA with ``attention_backend: torch``
``auto`` widens a quantized checkpoint and ``int8``/``int4``/``fp8`` are refused.
"""

from __future__ import annotations

CHOICES = ("auto", "none", "int8", "int4", "fp8")
AS_SHIPPED = ("gguf", "checkpoint")  # ModelConfig.quantization values that keep the checkpoint's own codes


class QuantizationChoiceError(ValueError):
    pass


def quantized_kernels_run(device: str, attention_backend: str) -> bool:
    """Whether packed weights are multiplied by a quantized kernel on ``device`` (a device type:
    cpu, cuda, ...) with ``attention_backend`` (torch, triton, or auto: a topology check, which
    knows no engine's backend, takes the engine's default, Triton on CUDA)."""
    if device == "cpu":
        return True
    return device == "cuda" and attention_backend in ("auto", "triton")


def resolve_quantization(requested: str, shipped: str | None, device: str, attention_backend: str = "auto") -> str:
    """The ``ModelConfig.quantization`` an engine runs with: none, gguf, checkpoint, int8, int4
    or fp8. ``shipped``: how the checkpoint is quantized, None for floats, ``gguf`` for a GGUF
    file, else the Hugging Face ``quant_method`` (fp8, compressed-tensors, awq, gptq).
    ``attention_backend``: the engine's, as resolved (see :func:`quantized_kernels_run`)."""
    if requested not in CHOICES:
        raise QuantizationChoiceError(f"quantization must be one of {', '.join(CHOICES)}, got {requested!r}")
    kernels = quantized_kernels_run(device, attention_backend)
    if requested == "auto":
        if shipped is None or not kernels:
            return "none"
        return "gguf" if shipped == "gguf" else "checkpoint"
    if requested == "none":
        return "none"
    if shipped is not None:
        what = "the GGUF file" if shipped == "gguf" else f"the checkpoint ({shipped})"
        raise QuantizationChoiceError(f"quantization {requested}: {what} is already quantized; "
                                      "use auto (served as shipped) or none (widened)")
    if not kernels:
        if device == "cuda":
            raise QuantizationChoiceError(f"quantization {requested} on cuda runs on the Triton kernels: set "
                                          f"attention_backend to auto or triton (it is {attention_backend}), "
                                          "or quantization to none")
        raise QuantizationChoiceError(f"quantization {requested} has no kernel on {device}; use none")
    return requested
