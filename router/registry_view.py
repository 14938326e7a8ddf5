"""The router's view of the Redis registry: live workers' load reports and prompt prefix hits.
Any Redis failure becomes :class:`RegistryUnavailable`, which the router answers by placing
by load only."""

from __future__ import annotations

from typing import Sequence

import redis

from cluster.registry.kv_index import KVIndexReader, TierHits
from cluster.registry.load import WorkerLoad, read_loads
from router.router import RegistryUnavailable


class RedisRegistryView:
    def __init__(self, client: redis.Redis, cluster: str):
        self.client, self.cluster = client, cluster
        self.index = KVIndexReader(client, cluster)

    def loads(self, workers: Sequence[str]) -> dict[str, WorkerLoad]:
        try:
            return read_loads(self.client, self.cluster, workers, lost=True)
        except redis.RedisError as exc:
            raise RegistryUnavailable(f"reading load reports: {exc}") from None

    def prefix_tiers(self, block_hashes: Sequence[bytes], workers: Sequence[str]) -> dict[str, TierHits]:
        try:
            return self.index.prefix_tiers(block_hashes, workers)
        except redis.RedisError as exc:
            raise RegistryUnavailable(f"looking up prefix blocks: {exc}") from None

    def sweep(self) -> list[str]:
        try:
            return self.index.sweep()
        except redis.RedisError:
            return []
