"""Linear, embedding and norm layers written for tensor parallelism.

Each parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this
rank's slice of a checkpoint tensor into it. ``loaded`` may be a tensor or a safetensors slice
(anything with ``get_shape()`` and ``[...]`` indexing), so a rank can read only its own shard.
With ``tp_size == 1`` no collective runs; the collectives of a larger group live in
``ParallelGroup`` (``reduce`` after a row-parallel layer, ``gather`` after a vocab-parallel head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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


def _copy_into(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(source.shape)} does not match {tuple(target.shape)}")
    target.copy_(source)


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    _copy_into(param.data, loaded if isinstance(loaded, torch.Tensor) else loaded[:], "weight")


def _set_loader(param: nn.Parameter | None, loader) -> None:
    if param is not None:
        param.weight_loader = loader


class _Linear(nn.Module):
    """A local matmul over this rank's slice; subclasses say how the slice is cut."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group: ParallelGroup):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; no communication in the forward pass."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK):
        if out_features % group.size:
            raise ValueError(f"output size {out_features} is not divisible by tensor-parallel size {group.size}")
        super().__init__(in_features, out_features // group.size, bias, dtype, group)
        _set_loader(self.weight, self.weight_loader)
        _set_loader(self.bias, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        _copy_into(param.data, _read_rows(loaded, 0, self.group.rank * size, size), "column-parallel weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up); shard_id is the part's index."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK):
        self.part_sizes = [p // group.size for p in part_sizes]
        super().__init__(in_features, sum(part_sizes), bias, dtype, group)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: int = 0) -> None:
        offset = sum(self.part_sizes[:shard_id])
        size = self.part_sizes[shard_id]
        part = _read_rows(loaded, 0, self.group.rank * size, size)
        _copy_into(param.data.narrow(0, offset, size), part, f"merged part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. KV heads are split across ranks, or replicated
    (each rank keeps the head it needs) when there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK):
        if num_heads % group.size:
            raise ValueError(f"{num_heads} attention heads are not divisible by tensor-parallel size {group.size}")
        if num_kv_heads % group.size and group.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over tensor-parallel size {group.size}")
        self.head_dim = head_dim
        self.local_heads = num_heads // group.size
        self.local_kv_heads = max(1, num_kv_heads // group.size)
        self.kv_replicas = max(1, group.size // num_kv_heads)
        out = (self.local_heads + 2 * self.local_kv_heads) * head_dim * group.size
        super().__init__(hidden_size, out, bias, dtype, group)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str = "q") -> None:
        q_size = self.local_heads * self.head_dim
        kv_size = self.local_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, self.group.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (self.group.rank // self.kv_replicas) * kv_size
        _copy_into(param.data.narrow(0, offset, size), _read_rows(loaded, 0, start, size), f"{shard_id}_proj")


class RowParallelLinear(_Linear):
    """Input features split across ranks; the partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, group: ParallelGroup = SINGLE_RANK):
        if in_features % group.size:
            raise ValueError(f"input size {in_features} is not divisible by tensor-parallel size {group.size}")
        super().__init__(in_features // group.size, out_features, bias, dtype, group)
        _set_loader(self.weight, self.weight_loader)
        _set_loader(self.bias, default_weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[1]
        _copy_into(param.data, _read_rows(loaded, 1, self.group.rank * size, size), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        out = self.group.all_reduce(out)
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; a rank embeds the ids it owns and the group sums."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 group: ParallelGroup = SINGLE_RANK):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // group.size)
        self.start = group.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rows = min(self.per_rank, self.vocab_size - self.start)
        _copy_into(param.data.narrow(0, 0, rows), _read_rows(loaded, 0, self.start, rows), "embedding")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection; logits are gathered so every rank sees all of them."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
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
