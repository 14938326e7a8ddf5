"""The fused CPU decode step (``decode_step.c``) behind a torch-shaped call.

:class:`StepWeights` describes the model once (pointers to its packed or float32 weights, norms,
rotary tables and KV cache); each call passes only the step's tensors. The tensors the
description points into are kept referenced here, so they outlive it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from cluster.engine.kernels.build import load_library
from cluster.engine.kernels.threads import kernel_threads
from cluster.engine.quantization.packed import PackedWeight

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
Q4, Q8_G32, Q8_G16, F32, F8 = 0, 1, 2, 3, 4  # quantized_matmul.c's kinds
KV_KINDS = {"auto": 0, "int8": 1, "fp8_e4m3": 2}


class _Part(ctypes.Structure):
    _fields_ = [("kind", _i64), ("first", _i64), ("rows", _i64), ("codes", _ptr), ("scales", _ptr), ("mins", _ptr),
                ("bf16_dots", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
        ("qkv_bias", _ptr), ("o_bias", _ptr), ("gate_up_bias", _ptr), ("down_bias", _ptr),
        ("qkv", _Part * 3), ("o", _Part * 1), ("gate_up", _Part * 2), ("down", _Part * 1),
        ("qkv_parts", _i64), ("gate_up_parts", _i64),
        ("k_cache", _ptr), ("v_cache", _ptr),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
        ("intermediate", _i64), ("block_size", _i64), ("window", _i64), ("max_blocks", _i64), ("kv_kind", _i64),
        ("eps", _f32), ("scale", _f32), ("cos", _ptr), ("sin", _ptr), ("final_norm", _ptr),
        ("layers", ctypes.POINTER(_Layer)),
    ]


WeightParts = tuple[tuple[int, "PackedWeight | torch.Tensor"], ...]  # (first row, packed part or float32 rows)


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: WeightParts
    o: WeightParts
    gate_up: WeightParts
    down: WeightParts
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class StepShape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    window: int  # 0: none
    eps: float
    scale: float
    kv_cache_dtype: str = "auto"  # auto (float32 rows), int8 or fp8_e4m3: KVCacheFormat.name
    # layouts of the quantized weights that multiply with bfloat16 dot products (quantized_matmul.c)
    bf16_layouts: tuple[str, ...] = ()


def _kind(part: PackedWeight) -> int:
    if part.layout == "q8":
        return Q8_G32 if part.group == 32 else Q8_G16
    return {"q4": Q4, "f8": F8}[part.layout]


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeDecodeStep:
    def __init__(self, lib: ctypes.CDLL, shape: StepShape, layers: list[LayerWeights], cos: torch.Tensor,
                 sin: torch.Tensor, final_norm: torch.Tensor):
        self._step = lib.decode_step
        self._step.restype = ctypes.c_int
        self._step.argtypes = [ctypes.POINTER(_Model), _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, ctypes.c_int]
        self._scratch_floats = lib.decode_step_scratch_floats
        self._scratch_floats.restype = _i64
        self._scratch_floats.argtypes = [ctypes.POINTER(_Model), _i64]
        self._keep: list[torch.Tensor] = [cos, sin, final_norm]
        self.bf16_layouts = shape.bf16_layouts
        self._layers = (_Layer * len(layers))(*(self._layer(w) for w in layers))
        self._model = _Model(len(layers), shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                             shape.intermediate, shape.block_size, shape.window, 0,
                             KV_KINDS[shape.kv_cache_dtype], shape.eps, shape.scale,
                             cos.data_ptr(), sin.data_ptr(), final_norm.data_ptr(), self._layers)
        self.hidden = shape.hidden
        self._scratch = torch.empty(0)

    def _parts(self, parts: WeightParts, size: int):
        array = (_Part * size)()
        for slot, (first, part) in enumerate(parts):
            if isinstance(part, PackedWeight):
                kind = _kind(part)
                self._keep.extend(t for t in (part.codes, part.scales, part.mins) if t is not None)
                array[slot] = _Part(kind, first, part.rows, part.codes.data_ptr(), part.scales.data_ptr(),
                                    _pointer(part.mins), part.layout in self.bf16_layouts)
            else:
                self._keep.append(part)
                array[slot] = _Part(F32, first, part.shape[0], part.data_ptr(), None, None, 0)
        return array

    def _layer(self, w: LayerWeights) -> _Layer:
        self._keep.extend(t for t in (w.input_norm, w.post_norm, w.q_norm, w.k_norm, w.qkv_bias, w.o_bias,
                                      w.gate_up_bias, w.down_bias, w.k_cache, w.v_cache) if t is not None)
        return _Layer(
            w.input_norm.data_ptr(), w.post_norm.data_ptr(), _pointer(w.q_norm), _pointer(w.k_norm),
            _pointer(w.qkv_bias), _pointer(w.o_bias), _pointer(w.gate_up_bias), _pointer(w.down_bias),
            self._parts(w.qkv, 3), self._parts(w.o, 1), self._parts(w.gate_up, 2), self._parts(w.down, 1),
            len(w.qkv), len(w.gate_up), w.k_cache.data_ptr(), w.v_cache.data_ptr(),
        )

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_table: torch.Tensor,
                 lengths: torch.Tensor) -> torch.Tensor:
        """hidden: [rows, hidden] float32 embeddings, contiguous; becomes the final norm's output.
        positions, slots, lengths: int64 [rows]; block_table: int64 [rows, blocks], contiguous."""
        rows = hidden.shape[0]
        self._model.max_blocks = block_table.shape[1]
        needed = self._scratch_floats(ctypes.byref(self._model), rows)
        if self._scratch.numel() < needed:
            self._scratch = torch.empty(needed, dtype=torch.float32)
        status = self._step(ctypes.byref(self._model), hidden.data_ptr(), rows, positions.data_ptr(), slots.data_ptr(),
                            block_table.data_ptr(), lengths.data_ptr(), self._scratch.data_ptr(),
                            kernel_threads())
        if status == -1:
            raise MemoryError("native decode step could not allocate attention scratch memory")
        if status:
            raise ValueError("native decode step: unsupported model shape")
        return hidden


@cache
def decode_step_library() -> ctypes.CDLL | None:
    return load_library("decode_step")
