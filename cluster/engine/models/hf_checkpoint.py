"""A Hugging Face checkpoint's safetensors files, each quantized weight read as one tensor.

:class:`HFCheckpoint` opens every file of a checkpoint and yields its tensors, file by file, as
safetensors slices. A quantized weight (``config.json``'s ``quantization_config``, see
:mod:`~cluster.engine.models.checkpoint_quantization`) ships as several tensors (fp8: ``weight``
and its scale; awq/gptq: ``qweight``, ``qzeros``, ``scales`` and ``g_idx``), possibly in different
files; it is yielded once, as ``<module>.weight``, by a slice that reads like a safetensors one:
``get_shape()`` [out, in], ``[index]`` dequantized to float32, and ``packed(index)``, those rows or
columns kept quantized (:mod:`cluster.engine.quantization.hf_repack`), reading only them; a column
cut off the 32-column groups gives None there, and the layer widens the weight. Tensors about
activations (static input scales, KV-cache scales) are skipped: activations stay in floats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from cluster.engine.models.checkpoint_quantization import CheckpointQuantization
from cluster.engine.quantization.hf_repack import (
    GROUP,
    awq_codes,
    f8_weight,
    gptq_codes,
    packed_zero_points,
    zero_point_weight,
)
from cluster.engine.quantization.packed import PackedWeight

ACTIVATION_LEAVES = ("input_scale", "input_zero_point", "k_scale", "v_scale")  # not applied
ZERO_POINT_COMPANIONS = ("qzeros", "scales", "g_idx")  # read with their module's qweight


class QuantizedTensorError(ValueError):
    """A quantized weight's tensors are missing, disagree, or hold what we do not serve."""


def _blocks(size: int, block: int | None) -> int:
    return 1 if block is None else -(-size // block)


def _covering_words(span: range) -> tuple[int, int, slice]:
    """The 8-element words holding ``span``, and where ``span`` lies in their elements."""
    first, last = span.start // 8, -(-span.stop // 8)
    return first, last, slice(span.start - 8 * first, span.stop - 8 * first)


class QuantizedWeightSlice(ABC):
    """One quantized weight, read like a safetensors slice of its float [out, in] form."""

    def __init__(self, name: str, shape: list[int]):
        self.name = name
        self.shape = shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def _ranges(self, index: Any) -> tuple[range, range]:
        index = index if isinstance(index, tuple) else (index,)
        rows, cols = index[0], (index[1] if len(index) > 1 else slice(None))
        return range(*rows.indices(self.shape[0])), range(*cols.indices(self.shape[1]))

    @abstractmethod
    def read(self, rows: range, cols: range) -> PackedWeight:
        """Rows ``rows`` and 32-aligned columns ``cols``, packed."""

    def packed(self, index: Any) -> PackedWeight | None:
        rows, cols = self._ranges(index)
        if cols.start % GROUP or len(cols) % GROUP:
            return None
        return self.read(rows, cols)

    def __getitem__(self, index: Any) -> torch.Tensor:
        """Dequantized to float32 (whole rows read for a column cut off the groups)."""
        rows, cols = self._ranges(index)
        if cols.start % GROUP == 0 and len(cols) % GROUP == 0:
            return self.read(rows, cols).dequantize()
        return self.read(rows, range(self.shape[1])).dequantize()[:, cols.start : cols.stop]


class Float8WeightSlice(QuantizedWeightSlice):
    """fp8 / compressed-tensors: a float8_e4m3fn weight and a scale per block of it."""

    def __init__(self, name: str, weight: Any, scale: torch.Tensor, block: tuple[int | None, int | None]):
        super().__init__(name, weight.get_shape())
        if weight.get_dtype() != "F8_E4M3":
            raise QuantizedTensorError(f"{name}: weights of type {weight.get_dtype()} are not served "
                                       "(float8_e4m3fn are)")
        if not scale.is_floating_point():
            raise QuantizedTensorError(f"{name}: scales of type {scale.dtype} are not served")
        rows, cols = self.shape
        grid = [_blocks(rows, block[0]), _blocks(cols, block[1])]
        if scale.numel() != grid[0] * grid[1]:
            raise QuantizedTensorError(f"{name}: {scale.numel()} scales for a [{rows}, {cols}] weight in blocks of "
                                       f"{block}: {grid[0]} x {grid[1]} expected")
        self.weight, self.grid, self.block = weight, scale.reshape(grid), block

    def read(self, rows: range, cols: range) -> PackedWeight:
        codes = self.weight[rows.start : rows.stop, cols.start : cols.stop]
        try:
            return f8_weight(codes, self.grid, self.block, rows, cols)
        except ValueError as exc:
            raise QuantizedTensorError(f"{self.name} {exc}") from None


class ZeroPointWeightSlice(QuantizedWeightSlice):
    """awq / gptq: 4-bit codes with a scale and a zero point per group of input columns."""

    def __init__(self, name: str, method: str, tensors: dict[str, Any], group: int | None, zero_offset: int):
        words = tensors["qweight"].get_shape()
        shape = [words[1] * 8, words[0]] if method == "awq" else [words[1], words[0] * 8]
        super().__init__(name, shape)
        self.method, self.group, self.zero_offset = method, group, zero_offset
        self.qweight, self.qzeros, self.scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        out, inputs = shape
        groups = _blocks(inputs, group)
        expected = {"qzeros": [groups, out // 8], "scales": [groups, out]}
        for key, want in expected.items():
            if tensors[key].get_shape() != want:
                raise QuantizedTensorError(f"{name}: {key} of shape {tensors[key].get_shape()}, {want} expected "
                                           f"for a [{out}, {inputs}] weight in groups of {group or inputs}")
        if "g_idx" in tensors:
            self._check_group_order(tensors["g_idx"][:])

    def _check_group_order(self, g_idx: torch.Tensor) -> None:
        inputs = self.shape[1]
        ordered = torch.arange(inputs) // (self.group or inputs)
        if not torch.equal(g_idx.to(torch.long), ordered):
            raise QuantizedTensorError(f"{self.name}: g_idx is permuted (GPTQ desc_act / act-order), which is not "
                                       "served; use a checkpoint quantized with desc_act=false")

    def read(self, rows: range, cols: range) -> PackedWeight:
        first_group = cols.start // self.group if self.group else 0
        last_group = -(-cols.stop // self.group) if self.group else 1
        out_first, out_last, out_span = _covering_words(rows)
        if self.method == "awq":
            q = awq_codes(self.qweight[cols.start : cols.stop, out_first:out_last])[out_span]
        else:
            in_first, in_last, in_span = _covering_words(cols)
            q = gptq_codes(self.qweight[in_first:in_last, rows.start : rows.stop])[:, in_span]
        zeros = packed_zero_points(self.qzeros[first_group:last_group, out_first:out_last], self.method)[out_span]
        scales = self.scales[first_group:last_group, rows.start : rows.stop].T
        return zero_point_weight(q, zeros.to(torch.int16) + self.zero_offset, scales, self.group, cols)


class HFCheckpoint:
    """The open safetensors files of one checkpoint (a context manager)."""

    def __init__(self, files: list[Path], quantization: CheckpointQuantization | None):
        self.files = files
        self.quantization = quantization
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Any] = {}

    def __enter__(self) -> "HFCheckpoint":
        for path in self.files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._handles[path] = handle
            self._where.update((name, handle) for name in handle.keys())
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str) -> Any:
        return self._where[name].get_slice(name)

    def _companion(self, module: str, leaf: str, of: str) -> Any:
        name = f"{module}.{leaf}"
        if name not in self._where:
            raise QuantizedTensorError(f"{of}: no {name} beside it")
        return self._slice(name)

    def tensors(self, path: Path) -> Iterator[tuple[str, Any]]:
        """The tensors of file ``path``, a quantized weight as one slice, under its weight's name."""
        q = self.quantization
        for name in self._handles[path].keys():
            module, _, leaf = name.rpartition(".")
            if q is None:
                yield name, self._slice(name)
            elif q.float8:
                yield from self._float8(name, module, leaf, q)
            elif leaf == "qweight":
                tensors = {"qweight": self._slice(name)}
                tensors.update((key, self._companion(module, key, name)) for key in ("qzeros", "scales"))
                if f"{module}.g_idx" in self._where:
                    tensors["g_idx"] = self._slice(f"{module}.g_idx")
                yield f"{module}.weight", ZeroPointWeightSlice(f"{module}.weight", q.method, tensors, q.group_size,
                                                               q.zero_offset)
            elif not (leaf in ZERO_POINT_COMPANIONS and f"{module}.qweight" in self._where):
                yield name, self._slice(name)

    def _float8(self, name: str, module: str, leaf: str, q: CheckpointQuantization) -> Iterator[tuple[str, Any]]:
        if leaf in ACTIVATION_LEAVES or leaf == q.scale_name:
            return
        if leaf == "weight_zero_point":
            if bool(self._where[name].get_tensor(name).to(torch.float32).any()):
                raise QuantizedTensorError(f"{name}: asymmetric float8 weights are not served")
            return
        tensor = self._slice(name)
        if leaf == "weight" and tensor.get_dtype().startswith("F8"):
            self._companion(module, q.scale_name, name)
            scale = self._where[f"{module}.{q.scale_name}"].get_tensor(f"{module}.{q.scale_name}")
            yield name, Float8WeightSlice(name, tensor, scale, q.scale_block)
        else:
            yield name, tensor
