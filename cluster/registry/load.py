"""How loaded each worker is, as it reports itself: queue, running batch, free KV blocks and its
recent steps' shapes and times.

A report is one JSON string per worker under ``worker:<w>:load``, rewritten a few times a
second and expiring with the heartbeat, so a dead worker's load disappears with it. The steps
are raw measurements; the router fits its cost model to them (``router/cost_model.py``). Each step
goes as a row of its fields' values, in ``StepSample``'s field order, not as an object: a
placement reads every worker's report, and the quick start's two reports (76 steps) were 20.6 KB
and parsed in 0.29-0.42 ms as objects, 5.3 KB and 0.14 ms as rows (2 cores). A report whose
steps are objects (a worker of an earlier version) is read as well.

A worker Ray finds dead has its report replaced at once by its deployment with one marked
``lost`` (``mark_lost``): routers keep placing for a while on a worker whose report merely
lapsed (one starved of CPU misses a few), but cut a lost one from placement as soon as they read
it. Only those who ask (``read_loads(..., lost=True)``: routers) see lost reports; a worker
started again under the name overwrites it with its own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import redis

from cluster.registry.keys import Keys

STEPS_REPORTED = 64
LOST_MARK_S = 30.0  # how long a lost worker's report says so (longer than a router's grace for a lapsed one)
ARRIVALS_KEPT_S = 1.0  # a report names the requests its worker took this long before it (``WorkerLoad.arrived``)


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
    host_loaded_blocks: int = 0  # blocks loaded from the host tier (prefix hits) since the step before ...
    host_load_s: float = 0.0  # ... and those loads' waits, each from queued to copied (not in ``seconds``)
    draft_tokens: int = 0  # prompt tokens a prefill worker's draft model was fed (prompts' draft KV to send) ...
    draft_s: float = 0.0  # ... and, of ``seconds``, the draft's forwards

    def row(self) -> list:
        """Its fields' values in field order: how reports and kept step models write a step."""
        return list(self.__dict__.values())


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
    lost: bool = False  # Ray found this incarnation dead (written by its deployment: ``mark_lost``)
    pull_from: tuple[str, ...] = ()  # peers it can pull cached KV from now (a peer pair built with each)
    prefill_call_s: float = 0.0  # a decode worker's calls to prefill workers: their time beyond the prefill's own
    pull_s_per_block: float = 0.0  # a decode worker's pulls from peers: the receive per block (0: none yet)
    draft_prompt_share: float = 0.0  # of a decode worker's remote prefills, those asked for the draft's KV too
    cpus: str = ""  # where it computes on the CPU: the cores its threads may run on (a Linux cpulist, "0-3") ...
    threads: int = 0  # ... and its compute threads, every rank's ("", 0: it computes on a GPU)
    # The requests it took within ``ARRIVALS_KEPT_S`` before ``updated_at`` (``cluster/worker/arrivals.py``):
    # a placement made just before the report is in it only if named here (``shows``). None: a
    # worker of an earlier version, which does not say.
    arrived: frozenset[str] | None = None

    def shows(self, request_id: str, placed_at: float) -> bool:
        """Whether this report counts a request placed on the worker at ``placed_at`` (a router's
        clock against the worker's): placed before it, and taken by the worker by then, which
        the report says for placements less than ``ARRIVALS_KEPT_S`` before it (earlier ones,
        and every one where it does not say, count as taken)."""
        if placed_at >= self.updated_at:
            return False
        if self.arrived is None or self.updated_at - placed_at >= ARRIVALS_KEPT_S:
            return True
        return request_id in self.arrived

    def to_json(self) -> str:
        data = {**self.__dict__, "steps": [step.row() for step in self.steps]}
        if self.arrived is not None:
            data["arrived"] = sorted(self.arrived)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> "WorkerLoad":
        data = json.loads(raw)
        data["steps"] = tuple(_step(s) for s in data.get("steps", ()))
        data["unpaired"] = tuple(data.get("unpaired", ()))
        data["pull_from"] = tuple(data.get("pull_from", ()))
        if data.get("arrived") is not None:
            data["arrived"] = frozenset(data["arrived"])
        return cls(**data)


_STEPS_KEPT = 4096
_steps_seen: dict[tuple, StepSample] = {}


def _step(fields: list | dict) -> StepSample:
    """A reported step (a row, or an object as an earlier version wrote it), the one made before
    when a report held the same (a report's steps are a window that slides by a few steps:
    building 88 anew took 179 us of a placement's read, the lookups 19, 2 cores)."""
    key = tuple(fields) if isinstance(fields, list) else tuple(fields.items())
    step = _steps_seen.get(key)
    if step is None:
        if len(_steps_seen) >= _STEPS_KEPT:
            _steps_seen.clear()
        step = _steps_seen[key] = StepSample(*fields) if isinstance(fields, list) else StepSample(**fields)
    return step


def publish_load(client: redis.Redis, cluster: str, load: WorkerLoad, ttl_s: float) -> None:
    client.set(Keys(cluster).load(load.worker), load.to_json(), px=int(ttl_s * 1000))


def read_loads(client: redis.Redis, cluster: str, workers: Iterable[str], lost: bool = False) -> dict[str, WorkerLoad]:
    """The current reports of ``workers`` (one round trip); workers without one are left out, and
    so are lost ones unless ``lost``."""
    workers = list(workers)
    if not workers:
        return {}
    return parse_loads(workers, client.mget(load_keys(cluster, workers)), lost)


def load_keys(cluster: str, workers: Sequence[str]) -> list[str]:
    """The keys of ``workers``' reports, for an MGET (in a pipeline of the caller's, too)."""
    keys = Keys(cluster)
    return [keys.load(w) for w in workers]


def parse_loads(workers: Sequence[str], raw: Sequence[bytes | None], lost: bool = False) -> dict[str, WorkerLoad]:
    """The reports an MGET of ``load_keys(workers)`` answered; workers without one are left out,
    and so are lost ones unless ``lost``."""
    loads = {w: WorkerLoad.from_json(r) for w, r in zip(workers, raw) if r is not None}
    return loads if lost else {w: load for w, load in loads.items() if not load.lost}


def mark_lost(client: redis.Redis, cluster: str, worker: str, role: str, last: WorkerLoad | None,
              ttl_s: float = LOST_MARK_S) -> None:
    """Writes ``worker``'s report as lost (its ``last`` one, or an empty one of ``role``), for
    ``ttl_s``: routers cut it from placement at once."""
    last = last or WorkerLoad(worker, role, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1)
    lost = replace(last, lost=True, steps=(), updated_at=time.time())
    client.set(Keys(cluster).load(worker), lost.to_json(), px=int(ttl_s * 1000))
