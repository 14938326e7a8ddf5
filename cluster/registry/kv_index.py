"""Which worker holds which KV block: workers publish their block manager's events, readers
look up a prompt's chain of block hashes.

A worker applies each batch of events atomically (MULTI/EXEC) together with the batch's
sequence number. Before applying, it checks that the registry's sequence number is the one it
last wrote: if not (Redis restarted, or keys were lost), it re-publishes its whole state
instead of the delta. Heartbeats are keys with a time to live; a reader ignores workers whose
heartbeat has expired, and ``sweep`` removes their blocks.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import redis

from cluster.engine.block_manager import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cluster.registry.keys import Keys

LOOKUP_CHUNK = 16  # hashes per round trip of the pipelined lookup; it stops after the chunk with the first miss

# The lookup as one server-side script: KEYS are the chain's block keys in order, ARGV the live
# workers; it walks the chain until no live worker holds a block and answers [worker, blocks,
# ...] for those that hold at least one. One round trip and one small reply, however long the
# prompt: parsing a pipeline's replies cost the router more than Redis's work.
PREFIX_SCRIPT = """
local still, left = {}, #ARGV
for _, w in ipairs(ARGV) do still[w] = true end
local matched = {}
for i, key in ipairs(KEYS) do
  if left == 0 then break end
  local now, n = {}, 0
  for _, w in ipairs(redis.call('SMEMBERS', key)) do
    if still[w] then now[w] = true; n = n + 1 end
  end
  for w in pairs(now) do matched[w] = i end
  still, left = now, n
end
local out = {}
for w, blocks in pairs(matched) do out[#out + 1] = w; out[#out + 1] = blocks end
return out
"""


class KVIndexPublisher:
    def __init__(self, client: redis.Redis, cluster: str, worker: str, heartbeat_ttl_s: float = 3.0):
        self.client, self.keys, self.worker = client, Keys(cluster), worker
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.seq = 0
        self.held: set[str] = set()  # this worker's view, for re-publishing after a gap
        self._resync = False

    def heartbeat(self) -> None:
        self.client.set(self.keys.alive(self.worker), "1", px=self.heartbeat_ttl_ms)

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Applies the events; returns True when a full re-publish was needed (a gap)."""
        for event in events:
            if isinstance(event, BlockStored):
                self.held.update(h.hex() for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.held.difference_update(h.hex() for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()
        try:
            stored = self.client.get(self.keys.seq(self.worker))
            gap = self._resync or int(stored or 0) != self.seq
            pipe = self.client.pipeline(transaction=True)
            if gap:
                self._replace_all(pipe)
            else:
                for event in events:
                    self._apply(pipe, event)
            pipe.set(self.keys.seq(self.worker), self.seq + 1)
            pipe.sadd(self.keys.workers, self.worker)
            pipe.set(self.keys.alive(self.worker), "1", px=self.heartbeat_ttl_ms)
            pipe.execute()
        except redis.RedisError:
            self._resync = True  # these events never reached Redis: the next publish sends everything
            raise
        self.seq += 1
        self._resync = False
        return gap

    def _apply(self, pipe, event: KVEvent) -> None:
        k, w = self.keys, self.worker
        if isinstance(event, (BlockStored, BlockRemoved)):
            change = pipe.sadd if isinstance(event, BlockStored) else pipe.srem
            hashes = [h.hex() for h in event.block_hashes]
            for h in hashes:
                change(k.block(h), w)
            if hashes:
                change(k.worker_blocks(w), *hashes)
        elif isinstance(event, AllBlocksCleared):
            self._drop_all(pipe, self.client.smembers(k.worker_blocks(w)))

    def _drop_all(self, pipe, hashes: Iterable[bytes | str]) -> None:
        for h in hashes:
            pipe.srem(self.keys.block(h.decode() if isinstance(h, bytes) else h), self.worker)
        pipe.delete(self.keys.worker_blocks(self.worker))

    def _replace_all(self, pipe) -> None:
        self._drop_all(pipe, self.client.smembers(self.keys.worker_blocks(self.worker)))
        for h in self.held:
            pipe.sadd(self.keys.block(h), self.worker)
        if self.held:
            pipe.sadd(self.keys.worker_blocks(self.worker), *self.held)
        self.seq = int(self.client.get(self.keys.seq(self.worker)) or 0)


class KVIndexReader:
    def __init__(self, client: redis.Redis, cluster: str):
        self.client, self.keys = client, Keys(cluster)
        self._script = client.register_script(PREFIX_SCRIPT)
        self.scripting = True  # False once the server refused the script: pipelined lookups from then on

    def alive_workers(self) -> set[str]:
        workers = sorted(w.decode() for w in self.client.smembers(self.keys.workers))
        if not workers:
            return set()
        pipe = self.client.pipeline(transaction=False)
        for w in workers:
            pipe.exists(self.keys.alive(w))
        return {w for w, alive in zip(workers, pipe.execute()) if alive}

    def prefix_blocks(self, block_hashes: Sequence[bytes], workers: Iterable[str] | None = None) -> dict[str, int]:
        """For each live worker (``workers`` when the caller already knows them), how many
        leading blocks of the chain it holds: one script call (``PREFIX_SCRIPT``), or where the
        server refuses scripts, pipelined round trips of ``LOOKUP_CHUNK`` hashes that end at
        the first chunk in which no live worker holds a block."""
        alive = set(workers) if workers is not None else self.alive_workers()
        if self.scripting and alive and block_hashes:
            try:
                reply = self._script(keys=[self.keys.block(h.hex()) for h in block_hashes], args=sorted(alive))
            except redis.ResponseError:
                self.scripting = False
            else:
                return self.matched(reply, alive)
        return self._prefix_blocks_pipelined(block_hashes, alive)

    def queue_prefix_blocks(self, pipe, block_hashes: Sequence[bytes], workers: Iterable[str]) -> None:
        """Queues the lookup's script on the caller's pipeline (beside its other reads: one round
        trip), by its digest alone (a ``Script`` on a pipeline asks Redis whether it has it first,
        another round trip); ``matched`` reads its reply. A reply that is an error (Redis lost
        its scripts, or refuses them) is the caller's cue to ask ``prefix_blocks``, which loads it."""
        keys = [self.keys.block(h.hex()) for h in block_hashes]
        pipe.evalsha(self._script.sha, len(keys), *keys, *sorted(workers))

    @staticmethod
    def matched(reply: Sequence, workers: Iterable[str]) -> dict[str, int]:
        """The script's reply as leading blocks per worker (0 for those holding none)."""
        matched = dict.fromkeys(workers, 0)
        for i in range(0, len(reply), 2):
            matched[reply[i].decode()] = int(reply[i + 1])
        return matched

    def _prefix_blocks_pipelined(self, block_hashes: Sequence[bytes], alive: set[str]) -> dict[str, int]:
        matched = {w: 0 for w in alive}
        still = set(alive)
        for start in range(0, len(block_hashes), LOOKUP_CHUNK):
            if not still:
                break
            pipe = self.client.pipeline(transaction=False)
            chunk = block_hashes[start:start + LOOKUP_CHUNK]
            for h in chunk:
                pipe.smembers(self.keys.block(h.hex()))
            for offset, holders in enumerate(pipe.execute()):
                holders = {w.decode() for w in holders}
                still &= holders
                if not still:
                    break
                for w in still:
                    matched[w] = start + offset + 1
        return matched

    def sweep(self) -> list[str]:
        """Removes the blocks of workers whose heartbeat expired; returns their ids."""
        workers = {w.decode() for w in self.client.smembers(self.keys.workers)}
        dead = sorted(workers - self.alive_workers())
        for w in dead:
            self.forget(w)
        return dead

    def forget(self, worker: str) -> None:
        """Removes a worker and its blocks at once (its deployment saw it die): its heartbeat,
        load report, blocks and sequence number. One started again under its name re-publishes."""
        k = self.keys
        hashes = self.client.smembers(k.worker_blocks(worker))
        pipe = self.client.pipeline(transaction=True)
        for h in hashes:
            pipe.srem(k.block(h.decode()), worker)
        pipe.delete(k.worker_blocks(worker), k.seq(worker), k.alive(worker), k.load(worker))
        pipe.srem(k.workers, worker)
        pipe.execute()
