"""The pull-or-compute decision: whether a worker that will prefill a prompt itself should first
pull the prefix blocks a peer caches (in either tier) over their KV transfer pair.

A peer acts as a prefill worker whose prefill is only its cached prefix: it pins the blocks,
loads its host-tier ones to the device, and sends them; the receiver computes the rest. The
pull is chosen only where the cost model (``cost_model.pulled_prefill_seconds``) predicts the
KV sooner than the receiver computing it from what it holds itself, and from the peer that
predicts it soonest. A draining peer is pulled from until it is removed (its cache outlives its
placements). Prefill workers are not pulled from: a pair with one already sends its
cached prefix and computes the rest there (``remote_candidates``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from cluster.registry.kv_index import TierHits
from router.candidates import Prompt
from router.cost_model import StepTimeModel, pulled_prefill_seconds


class PeerPull(NamedTuple):
    source: str  # the peer that sends
    blocks: int  # the prompt's leading blocks the receiver holds once the pull is done
    seconds: float  # predicted time to the prompt's KV on the receiver, pull and the rest's prefill


def best_pull(receiver: StepTimeModel, own: TierHits, peers: Sequence[str], hits: Mapping[str, TierHits],
              models: Mapping[str, StepTimeModel], prompt: Prompt, measured_s_per_block: float = 0.0) -> PeerPull | None:
    """The soonest pull from ``peers`` (each with its model in ``models``), or None where none is
    predicted sooner than computing from ``own`` (ties compute: a pull can fail).
    ``measured_s_per_block``: what the receiver's own pulls took per block (0: none yet)."""
    compute_s = receiver.tiered_prefill_seconds(prompt.tokens, prompt.block_size, own)
    best = None
    for peer in peers:
        got = prompt.hit_blocks(hits, peer)
        if got.blocks <= own.blocks:
            continue
        seconds = pulled_prefill_seconds(receiver, models[peer], prompt.tokens, prompt.block_size, own, got,
                                         measured_s_per_block)
        if seconds < compute_s and (best is None or seconds < best.seconds):
            best = PeerPull(peer, got.blocks, seconds)
    return best
