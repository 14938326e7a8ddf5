"""Which form the weights are served in, from ``model.quantization`` and the checkpoint.

``auto``: a GGUF on the CPU is served as shipped (its blocks repacked, ``gguf``); anything else
in floats. ``none``: floats always (a GGUF is widened, as before quantized kernels). ``int8`` /
``int4``: a float checkpoint quantized at load. The quantized kernels are CPU kernels so far:
on CUDA a GGUF is widened, and ``int8``/``int4`` are refused.
"""

from __future__ import annotations

CHOICES = ("auto", "none", "int8", "int4")


class QuantizationChoiceError(ValueError):
    pass


def resolve_quantization(requested: str, is_gguf: bool, device: str) -> str:
    """The ``ModelConfig.quantization`` an engine runs with: none, gguf, int8 or int4."""
    if requested not in CHOICES:
        raise QuantizationChoiceError(f"quantization must be one of {', '.join(CHOICES)}, got {requested!r}")
    on_cpu = device == "cpu"
    if requested == "auto":
        return "gguf" if is_gguf and on_cpu else "none"
    if requested == "none":
        return "none"
    if is_gguf:
        raise QuantizationChoiceError(f"quantization {requested}: the GGUF file is already quantized; "
                                      "use auto (served as shipped) or none (widened)")
    if not on_cpu:
        raise QuantizationChoiceError(f"quantization {requested} has no kernel on {device} yet; use none")
    return requested
