"""A GGUF file's index (metadata and tensor directory) read once by the ``gguf`` library and kept
in the Tandem cache: what later reads get from the cache is what the library reads, a changed
file is read afresh, and a damaged cache entry is read past."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter

from cluster.engine.models import gguf_index
from cluster.engine.models.gguf_index import read_index
from gguf_files import encode_tensor

pytestmark = pytest.mark.unit

TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_1, Q.Q4_K]


def write_file(path, seed: int = 0) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_string("general.name", f"index test {seed}")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "é", "東京", " hello", "🙂"])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 1])
    rng = np.random.default_rng(seed)
    for index, qtype in enumerate(TYPES):
        data = encode_tensor(rng.standard_normal((6, 256)).astype(np.float32), qtype, seed=index)
        writer.add_tensor(f"t.{qtype.name}", data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same_as_the_library(index, path) -> None:
    reader = GGUFReader(str(path))
    assert index.metadata == {key: field.contents() for key, field in reader.fields.items()}
    ours = index.tensors()
    assert [t.name for t in ours] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours, reader.tensors):
        assert mine.tensor_type == theirs.tensor_type
        assert list(mine.shape) == theirs.shape.tolist()
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "gguf"


def test_the_index_is_read_once_and_then_comes_from_the_cache(tmp_path, cache, monkeypatch):
    path = tmp_path / "model.gguf"
    write_file(path)
    assert_same_as_the_library(read_index(path), path)
    assert len(list(cache.glob("*.json"))) == 1

    def no_library(_):
        raise AssertionError("the library read the file again")

    monkeypatch.setattr(gguf_index, "_read_with_library", no_library)
    assert_same_as_the_library(read_index(path), path)


def test_a_changed_file_is_read_afresh(tmp_path, cache):
    path = tmp_path / "model.gguf"
    write_file(path, seed=0)
    first = read_index(path)
    write_file(path, seed=1)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a rewrite within the clock's tick
    second = read_index(path)
    assert first.metadata["general.name"] == "index test 0"
    assert_same_as_the_library(second, path)
    assert len(list(cache.glob("*.json"))) == 2


def test_a_damaged_cache_entry_is_read_past_and_replaced(tmp_path, cache):
    path = tmp_path / "model.gguf"
    write_file(path)
    read_index(path)
    (entry,) = cache.glob("*.json")
    entry.write_text('{"metadata": {"general.name": "tru')
    assert_same_as_the_library(read_index(path), path)
    assert_same_as_the_library(gguf_index._from_json(path, json.loads(entry.read_text())), path)
