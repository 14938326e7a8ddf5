"""The native decode attention (``paged_decode_attention.c``) behind a torch-shaped call."""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from cluster.engine.kernels.build import load_library
from cluster.engine.kernels.threads import kernel_threads
from cluster.engine.quantization.kv_format import KVCacheFormat

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class NativeDecodeAttention:
    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.paged_decode_attention_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [
            _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64,
            _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _ptr, _i64, ctypes.c_int,
        ]
        self._fn8 = lib.paged_decode_attention_8bit
        self._fn8.restype = ctypes.c_int
        self._fn8.argtypes = [
            _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64,
            _i64, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_int, _ptr, _i64, ctypes.c_int,
        ]

    @staticmethod
    def supports(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor, kv_format: KVCacheFormat | None = None) -> bool:
        """float32 queries on the CPU, heads of ``q`` contiguous within a row, cache and ``out``
        contiguous; the cache float32, or 8-bit rows (``kv_format``)."""
        heads, head_dim = q.shape[1], q.shape[2]
        quantized = kv_format is not None and kv_format.quantized
        return (
            q.device.type == "cpu"
            and q.dtype == out.dtype == torch.float32
            and k_cache.dtype == (torch.int8 if quantized else torch.float32)
            and q.stride(2) == 1 and q.stride(1) == head_dim
            and k_cache.is_contiguous() and out.is_contiguous() and out.shape[1] == heads * head_dim
        )

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 lengths: torch.Tensor, out: torch.Tensor, num_kv_heads: int, sliding_window: int | None,
                 scale: float, kv_format: KVCacheFormat | None = None) -> None:
        """Writes attention of the ``len(lengths)`` decode queries in ``q`` into the first rows of ``out``."""
        num_requests, heads, head_dim = len(lengths), q.shape[1], q.shape[2]
        common = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                  block_table.data_ptr(), block_table.shape[1], lengths.data_ptr(), num_requests,
                  heads, num_kv_heads, head_dim, k_cache.shape[1], sliding_window or 0, scale)
        tail = (out.data_ptr(), out.stride(0), kernel_threads())
        if kv_format is not None and kv_format.quantized:
            status = self._fn8(*common, int(kv_format.name == "fp8_e4m3"), *tail)
        else:
            status = self._fn(*common, *tail)
        if status != 0:
            raise MemoryError("native decode attention could not allocate its scratch buffer")


@cache
def native_decode_attention() -> NativeDecodeAttention | None:
    lib = load_library("decode_step")  # it holds every CPU kernel: one library, so one thread pool (thread_pool.c)
    return NativeDecodeAttention(lib) if lib is not None else None
