"""Cache entries (start-up profiles, GGUF indexes): written whole or not at all, and kept to the
most recently used."""

from __future__ import annotations

import os

import pytest

from cluster.paths import keep_newest, read_cache_file, write_cache_file

pytestmark = pytest.mark.unit


def test_an_entry_is_written_whole_and_nothing_else_is_left(tmp_path):
    target = tmp_path / "folder" / "entry.json"
    assert write_cache_file(target, '{"a": 1}')
    assert read_cache_file(target) == '{"a": 1}'
    assert [p.name for p in target.parent.iterdir()] == ["entry.json"]


def test_an_unwritable_folder_is_no_error(tmp_path):
    (tmp_path / "file").write_text("")
    assert not write_cache_file(tmp_path / "file" / "entry.json", "{}")


def test_the_most_recently_used_entries_are_kept(tmp_path):
    for age, name in enumerate(["newest", "middle", "oldest"]):
        path = tmp_path / f"{name}.json"
        path.write_text(name)
        os.utime(path, ns=(0, (100 - age) * 1_000_000_000))
    read_cache_file(tmp_path / "oldest.json")  # used now: the newest of all
    keep_newest(tmp_path, 2)
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["newest", "oldest"]
