"""The router's view of the Redis registry: live workers' load reports and prompt prefix hits.
Any Redis failure becomes :class:`RegistryUnavailable`, which the router answers by placing
by load only."""

from __future__ import annotations

from typing import Sequence

import redis

from cluster.registry.kv_index import KVIndexReader, TierHits
from cluster.registry.load import WorkerLoad, load_keys, parse_loads, read_loads
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

    def loads_and_prefix_tiers(self, workers: Sequence[str], block_hashes: Sequence[bytes]
                               ) -> tuple[dict[str, WorkerLoad], dict[str, TierHits]]:
        """``loads`` and ``prefix_tiers`` in one round trip (a pipeline of the MGET and the
        lookup's script), as a placement that needs fresh reports asks them."""
        if not (self.index.scripting and workers and block_hashes):
            return self.loads(workers), self.prefix_tiers(block_hashes, workers)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.mget(load_keys(self.cluster, workers))
            self.index.queue_prefix_tiers(pipe, block_hashes, workers)
            raw, reply = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            raise RegistryUnavailable(f"reading load reports and prefix blocks: {exc}") from None
        if isinstance(raw, Exception):
            raise RegistryUnavailable(f"reading load reports: {raw}")
        loads = parse_loads(workers, raw, lost=True)
        if isinstance(reply, Exception):  # its script not loaded (Redis restarted) or refused: asked on its own
            return loads, self.prefix_tiers(block_hashes, workers)
        return loads, self.index.matched(reply, workers)

    def sweep(self) -> list[str]:
        try:
            return self.index.sweep()
        except redis.RedisError:
            return []
