"""Linear, embedding and norm layers written for tensor parallelism.

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this
rank's slice of a checkpoint tensor into it. ``loaded`` may be a tensor or a safetensors slice
(anything with ``get_shape()`` and ``[...]`` indexing), so a rank can read only its own shard.
With ``tp_size == 1`` no collective runs; the collectives of a larger group live in
``ParallelGroup`` (``reduce`` after a row-parallel layer, ``gather`` after a vocab-parallel head).

Weights may be kept quantized (``ModelConfig.quantization``): ``gguf`` keeps a GGUF's blocks
repacked (:mod:`cluster.engine.quantization.gguf_repack`), ``checkpoint`` a Hugging Face
checkpoint's FP8/AWQ/GPTQ tensors (:mod:`cluster.engine.quantization.hf_repack`), each rank
repacking only its rows or columns (a row-parallel cut off the kernel's 32-column blocks widens
that layer on the rank); ``int8``/``int4``/``fp8`` quantize a float weight once it is loaded (a
cut through their groups keeps the rank's columns widened, with the values quantizing the whole
weight gives). A packed linear layer multiplies through
:func:`cluster.engine.kernels.quantized_matmul.packed_linear` (the Triton kernel on CUDA, or
where ``triton_matmul`` is set: an engine on the Triton backend); embeddings widen only the rows
they look up. ``finish_loading`` turns what was read into that form, on the layer's device, once
every tensor is in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.kernels.quantized_matmul import KERNEL_COLUMNS, packed_linear, with_kernel_form
from cluster.engine.quantization.choice import AS_SHIPPED
from cluster.engine.quantization.packed import PackedWeight, stack_rows
from cluster.engine.quantization.quantize import GROUP as LOAD_TIME_GROUP
from cluster.engine.quantization.quantize import KINDS as LOAD_TIME_KINDS
from cluster.engine.quantization.quantize import quantizable, quantize


@dataclass(frozen=True)
class ParallelGroup:
    """This rank's place in a tensor-parallel group (a single rank by default).

    ``process_group`` is a standalone ``torch.distributed`` process group object (see
    :mod:`cluster.parallel.group`); its collectives are called on it directly.
    """

    rank: int = 0
    size: int = 1
    process_group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.process_group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.process_group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)


SINGLE_RANK = ParallelGroup()


def _read_rows(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Reads ``loaded[start:start+size]`` along ``dim`` (0 or 1) without reading the rest."""
    index = (slice(start, start + size),) if dim == 0 else (slice(None), slice(start, start + size))
    return loaded[index]


def _read_columns_as_quantized(loaded: Any, start: int, size: int, dtype: torch.dtype, kind: str,
                               row_amax: torch.Tensor | None) -> torch.Tensor:
    """Columns [start, start + size) of ``loaded`` as the whole weight quantized with ``kind`` holds
    them: the groups the cut runs through are read whole, quantized and widened, then cut."""
    first = start - start % LOAD_TIME_GROUP
    stop = -(-(start + size) // LOAD_TIME_GROUP) * LOAD_TIME_GROUP
    groups = _read_rows(loaded, 1, first, stop - first).to(dtype)
    return quantize(groups, kind, row_amax).dequantize(dtype)[:, start - first : start - first + size]


def _whole_row_amax(loaded: Any, dtype: torch.dtype) -> torch.Tensor:
    """Each row's ``max |w|`` over all of ``loaded``'s columns (read once, at load), as the
    weight's dtype holds it: fp8's scale per row of the whole weight, for a rank holding some
    of its columns."""
    return _read_rows(loaded, 1, 0, _width(loaded)).to(dtype).abs().amax(dim=1).to(torch.float32)


def _width(loaded: Any) -> int:
    return loaded.shape[1] if isinstance(loaded, torch.Tensor) else loaded.get_shape()[1]


def _read_packed(loaded: Any, dim: int, start: int, size: int) -> PackedWeight | None:
    """``_read_rows`` kept quantized, or None when ``loaded`` cannot give it packed, or when a
    column cut (a row-parallel rank's) does not fall on the kernel's blocks of 32 columns: a
    cut on Q6_K's groups of 16 alone would load, then fail in the matmul."""
    packed = getattr(loaded, "packed", None)
    if packed is None or (dim == 1 and (start % KERNEL_COLUMNS or size % KERNEL_COLUMNS)):
        return None
    index = (slice(start, start + size),) if dim == 0 else (slice(None), slice(start, start + size))
    return packed(index)


def _assemble(parts: dict[int, PackedWeight], rows: int) -> tuple[tuple[int, PackedWeight], ...] | None:
    """Row blocks covering rows 0..rows-1 exactly, neighbours of one kind stacked; None if they do not."""
    blocks: list[tuple[int, PackedWeight]] = []
    expected = 0
    for first in sorted(parts):
        part = parts[first]
        if first != expected:
            return None
        if blocks and blocks[-1][1].same_kind(part) and blocks[-1][1].cols == part.cols:
            blocks[-1] = (blocks[-1][0], stack_rows([blocks[-1][1], part]))
        else:
            blocks.append((first, part))
        expected = first + part.rows
    return tuple(blocks) if expected == rows else None


def _copy_into(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(source.shape)} does not match {tuple(target.shape)}")
    target.copy_(source)


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    _copy_into(param.data, loaded if isinstance(loaded, torch.Tensor) else loaded[:], "weight")


def _set_loader(param: nn.Parameter | None, loader) -> None:
    if param is not None:
        param.weight_loader = loader


class ShardedLinear(nn.Module):
    """A local matmul over this rank's slice; subclasses say how the slice is cut."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group: ParallelGroup,
                 quantization: str = "none"):
        super().__init__()
        self.group = group
        self.quantization = quantization
        self.out_features = out_features  # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.packed: tuple[tuple[int, PackedWeight], ...] = ()  # (first row, part), once loaded packed
        self.triton_matmul = False  # multiply packed weights with the Triton kernel (also off CUDA)
        self.bf16_layouts: tuple[str, ...] = ()  # packed layouts the CPU kernel multiplies in bfloat16
        self._packed_parts: dict[int, PackedWeight] = {}
        self._row_amax: torch.Tensor | None = None  # fp8 on a rank holding some columns: the whole rows' max |w|

    def _load(self, param: nn.Parameter, loaded: Any, dim: int, start: int, size: int, offset: int | None,
              what: str) -> None:
        """Rows (dim 0) or columns (dim 1) [start, start + size) of ``loaded`` into ``param`` (at
        row ``offset`` for a part of a fused weight); kept packed where this layer serves the
        checkpoint's quantized tensors as shipped."""
        if param is self.weight and self.quantization in AS_SHIPPED:
            packed = _read_packed(loaded, dim, start, size)
            if packed is not None:
                rows = param.shape[0] if offset is None else size
                if packed.shape != (rows, param.shape[1]):
                    raise ValueError(f"{what}: checkpoint shape {packed.shape} does not match {(rows, param.shape[1])}")
                self._packed_parts[offset or 0] = packed
                return
        target = param.data if offset is None else param.data.narrow(0, offset, size)
        if param is self.weight and dim == 1 and self.quantization == "fp8" and size < _width(loaded):
            self._row_amax = _whole_row_amax(loaded, param.dtype)
        if param is self.weight and dim == 1 and self._cuts_quantization_groups(loaded, start, size):
            values = _read_columns_as_quantized(loaded, start, size, param.dtype, self.quantization, self._row_amax)
        else:
            values = _read_rows(loaded, dim, start, size)
        _copy_into(target, values, what)

    def _cuts_quantization_groups(self, loaded: Any, start: int, size: int) -> bool:
        """Whether columns [start, start + size) cut through the groups that ``int8``/``int4``
        quantize the whole weight in. Such a rank cannot quantize its columns alone: it keeps
        them widened, as quantizing the whole weight gives them, so TP serves the model TP 1 does."""
        return (self.quantization in LOAD_TIME_KINDS and bool(start % LOAD_TIME_GROUP or size % LOAD_TIME_GROUP)
                and _width(loaded) % LOAD_TIME_GROUP == 0)

    def finish_loading(self) -> None:
        """Packs what was read: packed parts become the layer's weight (widened instead when some
        part came as floats); with ``int8``/``int4``/``fp8`` the float weight is quantized."""
        parts, self._packed_parts = self._packed_parts, {}
        if parts:
            blocks = _assemble(parts, self.out_features)
            if blocks is None:
                for first, part in parts.items():
                    self.weight.data.narrow(0, first, part.rows).copy_(part.dequantize(self.weight.dtype))
                return
            self.packed = blocks
        elif self.quantization in LOAD_TIME_KINDS and quantizable(self.weight):
            self.packed = ((0, quantize(self.weight, self.quantization, self._row_amax)),)
        else:
            return
        device, dtype = self.weight.device, self.weight.dtype
        self.packed = tuple((first, with_kernel_form(part.to(device), dtype)) for first, part in self.packed)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=device)

    def packed_bytes(self) -> int:
        return sum(part.nbytes for _, part in self.packed)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return packed_linear(x, self.packed, self.out_features, self.triton_matmul, self.bf16_layouts)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        return out + self.bias if self.bias is not None else out


class ColumnParallelLinear(ShardedLinear):
    """Output features split across ranks; no communication in the forward pass."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK, quantization: str = "none"):
        if out_features % group.size:
            raise ValueError(f"output size {out_features} is not divisible by tensor-parallel size {group.size}")
        super().__init__(in_features, out_features // group.size, bias, dtype, group, quantization)
        _set_loader(self.weight, self.weight_loader)
        _set_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        self._load(param, loaded, 0, self.group.rank * size, size, None, "column-parallel weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); shard_id is the part's index."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK, quantization: str = "none"):
        self.part_sizes = [p // group.size for p in part_sizes]
        super().__init__(in_features, sum(part_sizes), bias, dtype, group, quantization)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        offset = sum(self.part_sizes[:shard_id])
        size = self.part_sizes[shard_id]
        self._load(param, loaded, 0, self.group.rank * size, size, offset, f"merged part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. KV heads are split across ranks, or replicated
    (each rank keeps the head it needs) when there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK, quantization: str = "none"):
        if num_heads % group.size:
            raise ValueError(f"{num_heads} attention heads are not divisible by tensor-parallel size {group.size}")
        if num_kv_heads % group.size and group.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over tensor-parallel size {group.size}")
        self.head_dim = head_dim
        self.local_heads = num_heads // group.size
        self.local_kv_heads = max(1, num_kv_heads // group.size)
        self.kv_replicas = max(1, group.size // num_kv_heads)
        out = (self.local_heads + 2 * self.local_kv_heads) * head_dim * group.size
        super().__init__(hidden_size, out, bias, dtype, group, quantization)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str = "q") -> None:
        q_size = self.local_heads * self.head_dim
        kv_size = self.local_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.group.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.group.rank // self.kv_replicas) * kv_size
        self._load(param, loaded, 0, start, size, offset, f"{shard_id}_proj")


class RowParallelLinear(ShardedLinear):
    """Input features split across ranks; the partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK, quantization: str = "none"):
        if in_features % group.size:
            raise ValueError(f"input size {in_features} is not divisible by tensor-parallel size {group.size}")
        super().__init__(in_features // group.size, out_features, bias, dtype, group, quantization)
        _set_loader(self.weight, self.weight_loader)
        _set_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[1]
        self._load(param, loaded, 1, self.group.rank * size, size, None, "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x)
        out = self.group.all_reduce(out)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; a rank embeds the ids it owns and the group sums."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 group: ParallelGroup = SINGLE_RANK, quantization: str = "none"):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.quantization = quantization
        self.per_rank = -(-vocab_size // group.size)
        self.start = group.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed: PackedWeight | None = None  # the table kept as the checkpoint's codes, once loaded
        self.triton_matmul = False  # an output head multiplies by a packed table with the Triton kernel
        self.bf16_layouts: tuple[str, ...] = ()  # packed layouts the CPU kernel multiplies in bfloat16
        self._loaded_packed: PackedWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = min(self.per_rank, self.vocab_size - self.start)
        packed = _read_packed(loaded, 0, self.start, rows) if self.quantization in AS_SHIPPED else None
        if packed is not None and packed.cols == param.shape[1]:
            self._loaded_packed = _pad_rows(packed, self.per_rank)
            return
        _copy_into(param.data.narrow(0, 0, rows), _read_rows(loaded, 0, self.start, rows), "embedding")

    def finish_loading(self) -> None:
        if self._loaded_packed is not None:
            packed, self._loaded_packed = self._loaded_packed.to(self.weight.device), None
            self.packed = with_kernel_form(packed, self.weight.dtype)
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def packed_bytes(self) -> int:
        return self.packed.nbytes if self.packed is not None else 0

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight)
        rows = self.packed.dequantize_rows(ids.reshape(-1), self.weight.dtype)
        return rows.view(*ids.shape, rows.shape[-1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


def _pad_rows(packed: PackedWeight, rows: int) -> PackedWeight:
    """``packed`` with zero rows added up to ``rows`` (the last rank's share of a vocabulary)."""
    extra = rows - packed.rows
    if extra <= 0:
        return packed
    zeros = lambda t: None if t is None else torch.zeros(extra, *t.shape[1:], dtype=t.dtype)  # noqa: E731
    return stack_rows([packed, PackedWeight(packed.layout, packed.group, zeros(packed.codes), zeros(packed.scales),
                                            zeros(packed.mins))])


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection; logits are gathered so every rank sees all of them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            logits = packed_linear(hidden, ((0, self.packed),), self.per_rank, self.triton_matmul, self.bf16_layouts)
        else:
            logits = F.linear(hidden, self.weight)
        if self.group.size > 1:
            logits = self.group.all_gather_last_dim(logits)
        return logits[..., : self.vocab_size]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)
