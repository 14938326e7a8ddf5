"""The host tier's size as written in a topology or an engine config: a block count or bytes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cluster.engine.request_limits import quote

_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)\s*$")


@dataclass(frozen=True)
class HostCacheSize:
    """Exactly one of ``blocks`` (a positive block count) and ``bytes`` (a memory budget)."""

    blocks: int | None = None
    bytes: int | None = None

    def num_blocks(self, block_bytes: int) -> int:
        return self.blocks if self.blocks is not None else self.bytes // block_bytes


def parse_host_cache(value: object) -> HostCacheSize | None:
    """None (off), a positive integer (blocks) or a size string like ``512MiB`` / ``2GiB``.
    Raises ValueError with the one line that says what to write instead."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return HostCacheSize(blocks=value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and float(match.group(1)) > 0:
            return HostCacheSize(bytes=int(float(match.group(1)) * _UNITS[match.group(2)]))
    raise ValueError(f"must be null, a positive number of blocks or a size such as '512MiB' or '2GiB'; "
                     f"got {quote(value)}")
