"""Filters: which workers, and which (prefill, decode) pairs, can take a request at all.

Each is one rule, applied before anything is scored: a worker is live while it reports its load,
no call to it has failed and it is not draining (its deployment is removing it: its requests in
flight finish, no new one goes to it); a pair is out of use while its decode worker cannot take KV from
that prefill worker (the pair is being rebuilt, or the request's transfer already failed on it);
past ``prefill_shortlist`` workers, only the prefill workers soonest done are paired at all; a
prompt its decode worker may prefill itself is not sent to a prefill worker that takes turns with
it on the same CPU cores (:func:`on_cores_of_their_own`); and a decode worker has room when the request fits in its KV blocks and running batch. Room does not
remove a candidate: the picker prefers those with room (``picker.with_room``), and admission
explains a full cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Container, Mapping, Sequence

from cluster.registry.load import WorkerLoad
from cluster.runtime.cpu_cores import share_cores


def reporting(pool: Sequence[str], loads: Mapping[str, WorkerLoad]) -> list[str]:
    """The pool's workers with a load report (in pool order)."""
    return [w for w in pool if w in loads]


def not_failed(pool: Sequence[str], failed: Container[str]) -> list[str]:
    """The pool's workers no call has failed on (in pool order)."""
    return [w for w in pool if w not in failed]


def not_draining(pool: Sequence[str], draining: Container[str]) -> list[str]:
    """The pool's workers that take new placements: not draining (in pool order)."""
    return [w for w in pool if w not in draining]


@dataclass(frozen=True)
class LivePools:
    """The workers of each pool that can take a request now: reporting, not failed, not draining."""

    prefill: list[str]
    decode: list[str]
    colocated: list[str]

    @classmethod
    def of(cls, prefill: Sequence[str], decode: Sequence[str], colocated: Sequence[str],
           loads: Mapping[str, WorkerLoad], failed: Container[str], draining: Container[str] = ()) -> "LivePools":
        return cls(*(not_draining(not_failed(reporting(pool, loads), failed), draining)
                     for pool in (prefill, decode, colocated)))

    @property
    def generating(self) -> list[str]:
        """The workers that decode: the decode pool, then the colocated one."""
        return self.decode + self.colocated

    @property
    def everyone(self) -> list[str]:
        return self.prefill + self.decode + self.colocated


def cut_off(decode: str, load: WorkerLoad, avoid: Sequence[tuple[str, str]], prefill: Container[str]) -> set[str]:
    """The live prefill workers (``prefill``) that cannot send ``decode`` KV now: those its
    report lists as unpaired (the pair is being rebuilt), and those the request avoids with it
    (its KV transfer failed there). Read from the few names given, not by walking the pool."""
    return ({p for p in load.unpaired if p in prefill}
            | {p for p, avoided in avoid if avoided == decode and p in prefill})


def soonest_prefill(prefill: list[str], prefill_side: Mapping[str, tuple], limit: int,
                    turn: str | None = None) -> list[str]:
    """The prefill workers to pair with decode workers: all of them, or past ``limit`` the ones
    whose queue and prefill end soonest (more cached blocks, then pool order, break ties), and
    the one whose turn it is in the rotation. The pairs are what a placement costs: 128 x 128
    workers would be 16,384 of them. ``prefill_side`` holds each worker's
    (model, cached blocks by tier, queue seconds, prefill seconds, ...)."""
    if len(prefill) <= limit:
        return prefill
    order = {p: i for i, p in enumerate(prefill)}
    soonest = sorted(prefill, key=lambda p: (prefill_side[p][2] + prefill_side[p][3], -prefill_side[p][1].blocks,
                                             order[p]))
    return sorted(set(soonest[:limit]) | ({turn} if turn is not None else set()), key=order.__getitem__)


def paired_prefill(shortlist: list[str], prefill: list[str], cut: Collection[str],
                   prefill_side: Mapping[str, tuple], limit: int) -> list[str]:
    """The prefill workers a decode worker pairs with: the shortlist's, less those cut off; when
    the shortlist's are all cut off but some live worker is not, the soonest of the others."""
    paired = [p for p in shortlist if p not in cut]
    if not paired and len(cut) < len(prefill):
        paired = soonest_prefill([p for p in prefill if p not in cut], prefill_side, limit)
    return paired


def on_cores_of_their_own(paired: list[str], loads: Mapping[str, WorkerLoad], decode: str) -> list[str]:
    """The prefill workers of ``paired`` that do not take turns with ``decode`` on its CPU cores
    (``cluster/runtime/cpu_cores.py``), for a prompt the decode worker may prefill itself. A
    prefill worker on the same cores gives the prompt no cores the decode worker would not have
    given it, and adds the call and the KV transfer; a short prefill inside a decode step holds
    the decodes only briefly. Measured on the quick start (1 prefill + 1 decode worker, 2
    threads each on 2 cores), 20-token prompts through the OpenAI API, TTFT p50 with both paths
    open against with this rule, one session: 19.4 / 16.1 ms at 1 stream, 60.3 / 46.5 ms at 8,
    205.9 / 143.4 ms at 32, decode rates unchanged (in a burst of 32 the router had split them,
    and the remote half waited 350 ms: both workers' steps at half pace, 30 sends per request).
    A prompt too long to prefill locally still goes to a prefill worker: there the decodes go on
    beside it, at the shared cores' pace, rather than wait for it."""
    mine = loads[decode]
    return [p for p in paired
            if not (loads[p].node_id == mine.node_id
                    and share_cores(loads[p].cpus, loads[p].threads, mine.cpus, mine.threads))]


def first_in_line(sequences: int, max_num_seqs: int, on_overload: str) -> bool:
    """A class that may not wait may take the first place in a full worker's line, where the
    wait is known: until the running sequence closest to its end has finished."""
    return sequences == max_num_seqs + 1 and on_overload == "reject"


def has_room(free_blocks: int, needed_blocks: int, sequences: int, max_num_seqs: int, in_line: bool) -> bool:
    """The blocks the request will need, and a slot in the running batch (or the first place in
    line). Without room it would wait inside the worker for others to finish, which the
    step-time model does not predict; it waits in the router instead, offered again when one
    ends."""
    return free_blocks >= needed_blocks and (sequences <= max_num_seqs or in_line)

