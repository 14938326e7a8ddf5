"""How loaded each worker is, as it reports itself: queue, running batch, free KV blocks and its
recent steps' shapes and times.

A report is one JSON string per worker under ``worker:<w>:load``, rewritten a few times a
second and expiring with the heartbeat, so a dead worker's load disappears with it. The steps
are raw measurements; the router fits its cost model to them (``router/cost_model.py``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import redis

from cluster.registry.keys import Keys

STEPS_REPORTED = 64


@dataclass(frozen=True)
class StepSample:
    """One engine step: tokens prefilled, their attention term, decodes, their context, time."""

    prefill_tokens: int
    prefill_attention: int
    decodes: int
    decode_context: int
    seconds: float
    kv_blocks_sent: int = 0
    transfer_tail_s: float = 0.0
    guess_tokens: int = 0  # speculative decoding: rows that checked a guess (beyond one per decode) ...
    accepted_tokens: int = 0  # ... and the guesses kept


@dataclass(frozen=True)
class WorkerLoad:
    worker: str
    role: str  # "prefill", "decode" or "colocated"
    waiting: int
    running: int
    receiving: int
    queued_prefill_tokens: int  # prompt tokens of waiting and running requests not computed yet
    decode_context_tokens: int  # KV tokens of the running decodes
    free_blocks: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    steps: tuple[StepSample, ...] = ()
    updated_at: float = field(default_factory=time.time)
    next_slot_tokens: int = 0  # most steps until a running sequence ends and frees a slot (0: none running)
    unpaired: tuple[str, ...] = ()  # a decode worker's prefill workers it cannot take KV from now (pair rebuilding)
    node_id: str = ""  # the Ray node it runs on ...
    node_address: str = ""  # ... and that node's address
    incarnation: str = ""  # its actor's id: a worker started again under its name reports another
    prefill_call_s: float = 0.0  # a decode worker's calls to prefill workers: their time beyond the prefill's own

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "WorkerLoad":
        data = json.loads(raw)
        data["steps"] = tuple(StepSample(**s) for s in data.get("steps", ()))
        data["unpaired"] = tuple(data.get("unpaired", ()))
        return cls(**data)


def publish_load(client: redis.Redis, cluster: str, load: WorkerLoad, ttl_s: float) -> None:
    client.set(Keys(cluster).load(load.worker), load.to_json(), px=int(ttl_s * 1000))


def read_loads(client: redis.Redis, cluster: str, workers: Iterable[str]) -> dict[str, WorkerLoad]:
    """The current reports of ``workers`` (one round trip); workers without one are left out."""
    workers = list(workers)
    if not workers:
        return {}
    return parse_loads(workers, client.mget(load_keys(cluster, workers)))


def load_keys(cluster: str, workers: Sequence[str]) -> list[str]:
    """The keys of ``workers``' reports, for an MGET (in a pipeline of the caller's, too)."""
    keys = Keys(cluster)
    return [keys.load(w) for w in workers]


def parse_loads(workers: Sequence[str], raw: Sequence[bytes | None]) -> dict[str, WorkerLoad]:
    """The reports an MGET of ``load_keys(workers)`` answered; workers without one are left out."""
    return {w: WorkerLoad.from_json(r) for w, r in zip(workers, raw) if r is not None}
