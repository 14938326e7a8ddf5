"""A GGUF file's metadata and tensor directory, read once per file and machine.

The ``gguf`` library parses every metadata value into numpy views, one per string: for the
default model's vocabulary (49,152 tokens and 48,900 merges) that takes 1.5 to 2.5 s on a
2-core machine, and every process that opens the file (``tandem up`` itself, each worker,
each ingress replica) paid it again on each start. So the library reads a file once, and what
it read (the metadata's values, and each tensor's name, type, shape and offset) is kept as
JSON under ``<tandem cache>/gguf/<key>.json``; the key hashes the file's resolved path, size
and modification time and the library's version, so a changed file is read afresh. A cache
that cannot be written only costs the next process the parse; the ``KEPT_INDEXES`` most
recently used are kept. Tensor data is never copied: each tensor is a read-only view of one
map of the file, as the library's are.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from cluster.paths import cache_dir, keep_newest, read_cache_file, write_cache_file

INDEX_FORMAT = 1
KEPT_INDEXES = 16  # the most recently used are kept

# Types whose tensors the library reads as numpy scalars; every other type is read as bytes.
_PLAIN_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's order: the innermost dimension first
    offset: int  # of its data, from the start of the file


@dataclass(frozen=True)
class GGUFIndex:
    path: Path
    metadata: dict[str, Any]
    entries: tuple[TensorEntry, ...]

    @cached_property
    def _file(self) -> np.memmap:
        return np.memmap(self.path, mode="r")

    def tensors(self) -> list["GGUFTensor"]:
        return [GGUFTensor(entry, self._file) for entry in self.entries]


class GGUFTensor:
    """A tensor as the library's reader gives it: ``name``, ``tensor_type``, ``shape`` (ggml's
    order) and ``data``, a view of the file shaped as the reader shapes it (rows of bytes for a
    quantized type)."""

    def __init__(self, entry: TensorEntry, file: np.memmap):
        self.name = entry.name
        self.tensor_type = entry.tensor_type
        self.shape = entry.shape
        self._entry = entry
        self._file = file

    @cached_property
    def data(self) -> np.ndarray:
        entry = self._entry
        elements = int(np.prod(entry.shape))
        dims = tuple(reversed(entry.shape))
        plain = _PLAIN_TYPES.get(entry.tensor_type)
        if plain is not None:
            count, item = elements, np.dtype(plain)
        else:
            block, type_size = GGML_QUANT_SIZES[entry.tensor_type]
            count, item = elements * type_size // block, np.dtype(np.uint8)
            dims = quant_shape_to_byte_shape(dims, entry.tensor_type)
        return self._file[entry.offset: entry.offset + count * item.itemsize].view(item).reshape(dims)


def read_index(path: Path) -> GGUFIndex:
    """The file's index: from the cache when it holds this file, else read by the library (and
    cached). Raises what the library raises for a file it cannot read."""
    path = path.resolve()
    stat = path.stat()
    cached = _cache_path(path, stat)
    try:
        return _from_json(path, json.loads(read_cache_file(cached)))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    index = _read_with_library(path)
    if write_cache_file(cached, _to_json(index)):
        keep_newest(cached.parent, KEPT_INDEXES)
    return index


def _cache_path(path: Path, stat: os.stat_result) -> Path:
    identity = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{version('gguf')}\0{INDEX_FORMAT}"
    return cache_dir() / "gguf" / f"{path.stem[:40]}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"


def _read_with_library(path: Path) -> GGUFIndex:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    entries = tuple(TensorEntry(t.name, GGMLQuantizationType(t.tensor_type), tuple(int(n) for n in t.shape),
                                int(t.data_offset)) for t in reader.tensors)
    return GGUFIndex(path, metadata, entries)


def _to_json(index: GGUFIndex) -> str:
    return json.dumps({"metadata": index.metadata,
                       "tensors": [[e.name, int(e.tensor_type), list(e.shape), e.offset] for e in index.entries]})


def _from_json(path: Path, data: dict) -> GGUFIndex:
    entries = tuple(TensorEntry(name, GGMLQuantizationType(kind), tuple(shape), offset)
                    for name, kind, shape, offset in data["tensors"])
    return GGUFIndex(path, data["metadata"], entries)
