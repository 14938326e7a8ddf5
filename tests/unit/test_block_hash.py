import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.engine.block_hash import HASH_BYTES, hash_block, hash_token_blocks

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(1, 13))
EXTRA = ("model-a", 7, b"salt")


def test_pinned_digests():
    """The encoding is part of the cluster's wire contract: these bytes must never drift."""
    assert hash_block(None, [1, 2, 3, 4]).hex() == (
        "ad8f8678dbb13f11cee81341a708e06324b4cc44be31deb72ead64bc4c946209"
    )
    assert [h.hex() for h in hash_token_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, EXTRA)] == [
        "46f9c45cc1c09cd887fd6d4650cab3e76ae5835394560c30ee840f48b0b1f395",
        "34ae8eec571bf099feb2fc117e70a0cc875691371dee0030e12530b9af1890e9",
    ]


def test_stable_across_processes():
    code = (
        "from cluster.engine.block_hash import hash_token_blocks\n"
        f"print(','.join(h.hex() for h in hash_token_blocks({TOKENS!r}, 4, {EXTRA!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out.split(",") == [h.hex() for h in hash_token_blocks(TOKENS, 4, EXTRA)]


def test_hashes_are_32_bytes_and_distinct():
    hashes = hash_token_blocks(TOKENS, 4)
    assert len(hashes) == 3
    assert all(len(h) == HASH_BYTES for h in hashes)
    assert len(set(hashes)) == 3


def test_changing_block_zero_changes_every_later_hash():
    base = hash_token_blocks(TOKENS, 4)
    changed = hash_token_blocks([99] + TOKENS[1:], 4)
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_changing_a_later_block_keeps_earlier_hashes():
    base = hash_token_blocks(TOKENS, 4)
    changed = hash_token_blocks(TOKENS[:4] + [99] + TOKENS[5:], 4)
    assert changed[0] == base[0]
    assert changed[1] != base[1] and changed[2] != base[2]


def test_identical_blocks_at_different_positions_hash_differently():
    hashes = hash_token_blocks([5, 5, 5, 5] * 3, 4)
    assert len(set(hashes)) == 3


@pytest.mark.parametrize(
    "extra", [("model-a",), ("model-b",), (7,), ("7",), (b"7",), ("model-a", "lora-1")]
)
def test_extra_keys_change_the_hash(extra):
    plain = hash_token_blocks(TOKENS, 4)
    keyed = hash_token_blocks(TOKENS, 4, extra)
    assert all(a != b for a, b in zip(plain, keyed, strict=True))


def test_extra_keys_of_different_types_do_not_collide():
    assert len({hash_block(None, [1], (k,)) for k in ("7", 7, b"7")}) == 3
    assert hash_block(None, [1], ("ab", "c")) != hash_block(None, [1], ("a", "bc"))


def test_bool_extra_key_is_rejected():
    with pytest.raises(TypeError):
        hash_block(None, [1], (True,))


def test_partial_last_block_gets_no_hash():
    assert len(hash_token_blocks(TOKENS[:11], 4)) == 2
    assert hash_token_blocks(TOKENS[:11], 4) == hash_token_blocks(TOKENS[:8], 4)
    assert hash_token_blocks(TOKENS[:3], 4) == []
    assert hash_token_blocks([], 4) == []


def test_continuation_from_parent_equals_full_computation():
    full = hash_token_blocks(TOKENS, 4, EXTRA)
    head = hash_token_blocks(TOKENS[:4], 4, EXTRA)
    tail = hash_token_blocks(TOKENS, 4, EXTRA, parent=head[-1], start_block=1)
    assert head + tail == full


def test_hash_block_chain_equals_hash_token_blocks():
    parent = None
    chained = []
    for i in range(3):
        parent = hash_block(parent, TOKENS[i * 4 : (i + 1) * 4], EXTRA)
        chained.append(parent)
    assert chained == hash_token_blocks(TOKENS, 4, EXTRA)


def test_non_positive_block_size_is_rejected():
    with pytest.raises(ValueError):
        hash_token_blocks(TOKENS, 0)
