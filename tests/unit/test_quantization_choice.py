"""``model.quantization`` resolved per device and attention backend: quantized kernels run on the
CPU and on CUDA's Triton backend; elsewhere a quantized checkpoint is widened and quantizing at
load is refused in one line naming the key to change."""

from __future__ import annotations

import pytest

from cluster.engine.quantization.choice import QuantizationChoiceError, resolve_quantization

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("device, backend", [("cpu", "torch"), ("cpu", "triton"), ("cuda", "triton"),
                                             ("cuda", "auto")])
def test_checkpoints_are_served_as_shipped_where_a_quantized_kernel_runs(device, backend):
    assert resolve_quantization("auto", "gguf", device, backend) == "gguf"
    assert resolve_quantization("auto", "fp8", device, backend) == "checkpoint"
    assert resolve_quantization("auto", None, device, backend) == "none"
    for kind in ("int8", "int4", "fp8"):
        assert resolve_quantization(kind, None, device, backend) == kind


def test_cudas_torch_backend_widens_and_refuses_quantizing_at_load():
    assert resolve_quantization("auto", "gguf", "cuda", "torch") == "none"
    assert resolve_quantization("none", "gguf", "cuda", "triton") == "none"
    with pytest.raises(QuantizationChoiceError) as error:
        resolve_quantization("int4", None, "cuda", "torch")
    assert str(error.value) == ("quantization int4 on cuda runs on the Triton kernels: set attention_backend to auto "
                                "or triton (it is torch), or quantization to none")


def test_a_device_without_quantized_kernels_widens_and_refuses():
    assert resolve_quantization("auto", "gguf", "mps", "torch") == "none"
    with pytest.raises(QuantizationChoiceError, match=r"^quantization fp8 has no kernel on mps; use none$"):
        resolve_quantization("fp8", None, "mps", "torch")
