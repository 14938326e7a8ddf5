"""The one block hash of the cluster.

A full block's hash is SHA-256 over its parent's hash, its token ids and the extra keys
(model, adapter, tenant salt). The encoding is fixed byte for byte, so the router, every
worker and the registry compute the same 32 bytes in every process on every machine
(Python's ``hash()`` is salted per process and would not).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BlockHash = bytes
ExtraKey = str | int | bytes

HASH_BYTES = 32
_ROOT = bytes(HASH_BYTES)


def _encode_extra_key(key: ExtraKey) -> bytes:
    if isinstance(key, bool):
        raise TypeError("extra keys are str, int or bytes, not bool")
    if isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8")
    elif isinstance(key, int):
        tag, payload = b"i", str(key).encode("ascii")
    elif isinstance(key, bytes):
        tag, payload = b"b", key
    else:
        raise TypeError(f"extra keys are str, int or bytes, got {type(key).__name__}")
    return tag + struct.pack("<I", len(payload)) + payload


def _extra_keys_bytes(extra_keys: Sequence[ExtraKey]) -> bytes:
    return struct.pack("<I", len(extra_keys)) + b"".join(_encode_extra_key(key) for key in extra_keys)


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[ExtraKey] = ()
) -> BlockHash:
    """Hash of one full block, chained to ``parent`` (None for the first block of a prompt)."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else _ROOT)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(_extra_keys_bytes(extra_keys))
    return h.digest()


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[ExtraKey] = (),
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` from ``start_block`` on.

    ``parent`` must be the hash of block ``start_block - 1`` when ``start_block > 0``. The
    partial last block, if any, gets no hash: only full blocks are cached. The same bytes as
    :func:`hash_block` block by block, with the tokens packed and the extra keys encoded once.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    end = len(token_ids) // block_size
    if start_block >= end:
        return []
    packed = struct.pack(f"<{(end - start_block) * block_size}q", *token_ids[start_block * block_size:end * block_size])
    header, suffix = struct.pack("<I", block_size), _extra_keys_bytes(extra_keys)
    stride = 8 * block_size
    hashes: list[BlockHash] = []
    for offset in range(0, len(packed), stride):
        parent = hashlib.sha256(b"".join((parent if parent is not None else _ROOT, header,
                                          packed[offset:offset + stride], suffix))).digest()
        hashes.append(parent)
    return hashes


def chain_key(parent: BlockHash | None, extra_keys: Sequence[ExtraKey] = ()) -> BlockHash:
    """What a block's cached KV depends on besides its own tokens: its parent's hash, or for a
    prompt's first block its extra keys (a tenant's salt keeps its first blocks its own). Blocks
    under one chain key whose tokens begin alike hold the same KV for those tokens."""
    if parent is not None:
        return parent
    return hashlib.sha256(_ROOT + b"chain" + _extra_keys_bytes(extra_keys)).digest()


def request_hash_keys(extra_keys: Sequence[ExtraKey], cache_salt: str | None = None) -> tuple[ExtraKey, ...]:
    """The extra keys of a request's blocks: the engine's (model), then its tenant salt if any."""
    return tuple(extra_keys) + ((cache_salt,) if cache_salt else ())


def cacheable_prefix_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most leading blocks of a prompt that can be cache hits: the last token is always computed."""
    return max(0, (num_prompt_tokens - 1) // block_size)
