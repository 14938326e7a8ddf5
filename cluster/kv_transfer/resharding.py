"""Which KV heads travel between which ranks when prefill and decode use different TP degrees.

A rank of a TP-``n`` group holds the KV heads that ``QKVParallelLinear`` gives it: a contiguous
range of ``kv_heads / n`` heads, or, with fewer KV heads than ranks, one head shared by
``n / kv_heads`` ranks. For each decode rank, each head it needs comes from one prefill rank
that holds it (replicas take turns, so the load spreads); consecutive heads from one sender
travel as one slice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    sender: int  # prefill rank
    receiver: int  # decode rank
    first_head: int  # global KV head index
    num_heads: int
    sender_offset: int  # index of first_head among the sender's local heads
    receiver_offset: int  # ... among the receiver's local heads


def heads_of_rank(num_kv_heads: int, tp_size: int, rank: int) -> range:
    local = max(1, num_kv_heads // tp_size)
    replicas = max(1, tp_size // num_kv_heads)
    first = (rank // replicas) * local
    return range(first, first + local)


def plan_head_slices(num_kv_heads: int, sender_tp: int, receiver_tp: int) -> list[HeadSlice]:
    holders: dict[int, list[int]] = {}
    for rank in range(sender_tp):
        for head in heads_of_rank(num_kv_heads, sender_tp, rank):
            holders.setdefault(head, []).append(rank)
    slices: list[HeadSlice] = []
    for receiver in range(receiver_tp):
        wanted = heads_of_rank(num_kv_heads, receiver_tp, receiver)
        for head in wanted:
            options = holders[head]
            sender = options[receiver % len(options)]
            last = slices[-1] if slices else None
            if last and last.receiver == receiver and last.sender == sender and last.first_head + last.num_heads == head:
                slices[-1] = HeadSlice(sender, receiver, last.first_head, last.num_heads + 1,
                                       last.sender_offset, last.receiver_offset)
            else:
                sender_heads = heads_of_rank(num_kv_heads, sender_tp, sender)
                slices.append(HeadSlice(sender, receiver, head, 1, head - sender_heads.start, head - wanted.start))
    return slices
