"""Which worker holds which KV block in which tier: workers publish their block manager's
events, readers look up a prompt's chain of block hashes.

A block's key is a hash of worker -> the best tier it holds the block in (``device`` over
``host``; :mod:`cluster.engine.kv_tiers.tier`): a block offloaded to the host tier moves there,
and one the worker holds in both (loaded back) stays ``device`` until the device evicts it. The
publisher keeps the worker's view of both tiers and writes each changed hash's best tier.

A worker applies each batch of events atomically (MULTI/EXEC) together with the batch's
sequence number. Before applying, it checks that the registry's sequence number is the one it
last wrote: if not (Redis restarted, or keys were lost), it re-publishes its whole state
instead of the delta. Heartbeats are keys with a time to live; a reader ignores workers whose
heartbeat has expired, and ``sweep`` removes their blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import redis

from cluster.engine.block_manager import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from cluster.engine.kv_tiers.tier import DEVICE, HOST, TIERS
from cluster.registry.keys import Keys

LOOKUP_CHUNK = 16  # hashes per round trip of the pipelined lookup; it stops after the chunk with the first miss



@dataclass(frozen=True)
class TierHits:
    """A worker's usable prefix of a prompt: ``device`` leading blocks in its KV cache, then
    ``host`` blocks in its host tier (loaded back before the forward; a block after them is
    computed, as the engine does)."""

    device: int
    host: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host


# The lookup as one server-side script: KEYS are the chain's block keys in order, ARGV the live
# workers; it walks the chain while some live worker still holds it, each worker first through
# blocks it holds on the device, then through blocks it holds on the host only, and answers
# [worker, device blocks, host blocks, ...] for those that hold at least one. One round trip and
# one small reply, however long the prompt: parsing a pipeline's replies cost the router more
# than Redis's work.
PREFIX_SCRIPT = """
local still, left = {}, #ARGV
for _, w in ipairs(ARGV) do still[w] = 'device' end
local dev, host = {}, {}
for i, key in ipairs(KEYS) do
  if left == 0 then break end
  local now, n = {}, 0
  local held = redis.call('HGETALL', key)
  for j = 1, #held, 2 do
    local w, tier = held[j], held[j + 1]
    local phase = still[w]
    if phase == 'device' and tier == 'device' then
      now[w] = 'device'; dev[w] = i; n = n + 1
    elseif phase and tier == 'host' then
      now[w] = 'host'; host[w] = i - (dev[w] or 0); n = n + 1
    end
  end
  still, left = now, n
end
local out = {}
for w, blocks in pairs(dev) do out[#out + 1] = w; out[#out + 1] = blocks; out[#out + 1] = host[w] or 0 end
for w, blocks in pairs(host) do
  if not dev[w] then out[#out + 1] = w; out[#out + 1] = 0; out[#out + 1] = blocks end
end
return out
"""


def _walk(phase: str | None, tier: str) -> str | None:
    """A worker's phase after one block of the chain (the script's rule): device blocks lead,
    then host blocks; anything else ends its prefix (None)."""
    if phase == DEVICE and tier == DEVICE:
        return DEVICE
    return HOST if phase is not None and tier == HOST else None


class KVIndexPublisher:
    def __init__(self, client: redis.Redis, cluster: str, worker: str, heartbeat_ttl_s: float = 3.0):
        self.client, self.keys, self.worker = client, Keys(cluster), worker
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self.seq = 0
        self.held: dict[str, set[str]] = {tier: set() for tier in TIERS}  # this worker's view, by tier
        self._resync = False

    def tier_of(self, block_hash: str) -> str | None:
        """The best tier this worker holds the (hex) hash in, None if neither."""
        return next((tier for tier in TIERS if block_hash in self.held[tier]), None)

    def heartbeat(self) -> None:
        self.client.set(self.keys.alive(self.worker), "1", px=self.heartbeat_ttl_ms)

    def publish(self, events: Sequence[KVEvent]) -> bool:
        """Applies the events; returns True when a full re-publish was needed (a gap)."""
        changed: set[str] = set()
        for event in events:
            if isinstance(event, AllBlocksCleared):
                for held in self.held.values():
                    changed |= held
                    held.clear()
                continue
            hashes = [h.hex() for h in event.block_hashes]
            changed.update(hashes)
            if isinstance(event, BlockStored):
                self.held[event.tier].update(hashes)
            else:
                self.held[event.tier].difference_update(hashes)
        try:
            stored = self.client.get(self.keys.seq(self.worker))
            gap = self._resync or int(stored or 0) != self.seq
            pipe = self.client.pipeline(transaction=True)
            if gap:
                self._replace_all(pipe)
            else:
                self._write(pipe, sorted(changed))
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

    def _write(self, pipe, hashes: Sequence[str]) -> None:
        """Each hash's best tier now, or its removal."""
        k, w = self.keys, self.worker
        held, gone = [], []
        for h in hashes:
            tier = self.tier_of(h)
            if tier is None:
                pipe.hdel(k.block(h), w)
                gone.append(h)
            else:
                pipe.hset(k.block(h), w, tier)
                held.append(h)
        if held:
            pipe.sadd(k.worker_blocks(w), *held)
        if gone:
            pipe.srem(k.worker_blocks(w), *gone)

    def _replace_all(self, pipe) -> None:
        for h in self.client.smembers(self.keys.worker_blocks(self.worker)):
            pipe.hdel(self.keys.block(h.decode()), self.worker)
        pipe.delete(self.keys.worker_blocks(self.worker))
        self._write(pipe, sorted(set().union(*self.held.values())))
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
        """``prefix_tiers`` counted in blocks, whatever their tier."""
        return {w: hits.blocks for w, hits in self.prefix_tiers(block_hashes, workers).items()}

    def prefix_tiers(self, block_hashes: Sequence[bytes], workers: Iterable[str] | None = None) -> dict[str, TierHits]:
        """For each live worker (``workers`` when the caller already knows them), how many
        leading blocks of the chain it holds on its device, and how many after those on its
        host tier: one script call (``PREFIX_SCRIPT``), or where the server refuses scripts,
        pipelined round trips of ``LOOKUP_CHUNK`` hashes that end at the first chunk in which
        no live worker's prefix goes on."""
        alive = set(workers) if workers is not None else self.alive_workers()
        if self.scripting and alive and block_hashes:
            try:
                reply = self._script(keys=[self.keys.block(h.hex()) for h in block_hashes], args=sorted(alive))
            except redis.ResponseError:
                self.scripting = False
            else:
                return self.matched(reply, alive)
        return self._prefix_tiers_pipelined(block_hashes, alive)

    def queue_prefix_tiers(self, pipe, block_hashes: Sequence[bytes], workers: Iterable[str]) -> None:
        """Queues the lookup's script on the caller's pipeline (beside its other reads: one round
        trip), by its digest alone (a ``Script`` on a pipeline asks Redis whether it has it first,
        another round trip); ``matched`` reads its reply. A reply that is an error (Redis lost
        its scripts, or refuses them) is the caller's cue to ask ``prefix_tiers``, which loads it."""
        keys = [self.keys.block(h.hex()) for h in block_hashes]
        pipe.evalsha(self._script.sha, len(keys), *keys, *sorted(workers))

    @staticmethod
    def matched(reply: Sequence, workers: Iterable[str]) -> dict[str, TierHits]:
        """The script's reply as leading device and host blocks per worker (none for those holding none)."""
        matched = dict.fromkeys(workers, TierHits(0))
        for i in range(0, len(reply), 3):
            matched[reply[i].decode()] = TierHits(int(reply[i + 1]), int(reply[i + 2]))
        return matched

    def _prefix_tiers_pipelined(self, block_hashes: Sequence[bytes], alive: set[str]) -> dict[str, TierHits]:
        counts = {w: [0, 0] for w in alive}  # device, host
        phase: dict[str, str | None] = dict.fromkeys(alive, DEVICE)
        for start in range(0, len(block_hashes), LOOKUP_CHUNK):
            if not any(phase.values()):
                break
            pipe = self.client.pipeline(transaction=False)
            for h in block_hashes[start:start + LOOKUP_CHUNK]:
                pipe.hgetall(self.keys.block(h.hex()))
            for holders in pipe.execute():
                tiers = {w.decode(): t.decode() for w, t in holders.items()}
                for w, now in phase.items():
                    phase[w] = _walk(now, tiers.get(w, ""))
                    if phase[w] is not None:
                        counts[w][phase[w] == HOST] += 1
                if not any(phase.values()):
                    break
        return {w: TierHits(*n) for w, n in counts.items()}

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
            pipe.hdel(k.block(h.decode()), worker)
        pipe.delete(k.worker_blocks(worker), k.seq(worker), k.alive(worker), k.load(worker))
        pipe.srem(k.workers, worker)
        pipe.execute()
