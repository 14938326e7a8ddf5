"""The prefill side's half of one request's transfer: each layer is packed and sent as soon as
the model has written it, while later layers still compute.

The sender is given a way to read the request's block ids (read when the first layer is done,
i.e. after scheduling has allocated them) and one :class:`Destination` per message stream: the receiving rank, which
of this rank's KV heads go there, and the receiver's tag range. ``finish`` waits for every send
within the transfer's deadline and leaves the record done or failed; ``abort`` ends it early.
Sent messages are copies, so the prefill side may free its blocks as soon as the record ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from cluster.kv_transfer.kv_blocks import pack_layer
from cluster.kv_transfer.state import TransferRecord, TransferState
from cluster.kv_transfer.transport import KVTransport, Pending, TransportError


TAG_STRIDE = 8  # tags of one stream: tag_base + layer * TAG_STRIDE + (slice index between one pair of ranks)


def layer_tag(tag_base: int, layer: int) -> int:
    return tag_base + layer * TAG_STRIDE


@dataclass(frozen=True)
class Destination:
    peer: int  # the receiver's rank in the transfer group
    first_head: int  # first of this rank's local KV heads that the receiver takes
    num_heads: int
    tag_base: int  # layer i travels with tag layer_tag(tag_base, i)


class KVSender:
    def __init__(self, transport: KVTransport, kv_cache: torch.Tensor, record: TransferRecord,
                 block_ids: Callable[[], Sequence[int]], destinations: list[Destination], first_block: int = 0):
        """``block_ids()`` gives the request's blocks once scheduled; blocks before
        ``first_block`` are already held by the receiver and are not sent."""
        self.transport = transport
        self.kv_cache = kv_cache
        self.record = record
        self.block_ids = block_ids
        self.first_block = first_block
        self.destinations = destinations
        self.streaming = True  # False: the owner calls after_layer for every layer after the forward pass
        self._ids: torch.Tensor | None = None
        self._pending: list[list[tuple[Pending, torch.Tensor]]] = []

    @property
    def sent_block_ids(self) -> list[int]:
        """This side's block ids whose KV was sent (empty before the first layer)."""
        return [] if self._ids is None else self._ids.tolist()

    def after_layer(self, layer: int) -> None:
        if self.record.state.terminal:
            return
        if self._ids is None:
            self._ids = torch.tensor(list(self.block_ids())[self.first_block:], dtype=torch.long,
                                     device=self.kv_cache.device)
        sends = []
        if not len(self._ids):  # the receiver holds every block already and posts no receive
            self._pending.append(sends)
            return
        try:
            for dest in self.destinations:
                message = pack_layer(self.kv_cache, layer, self._ids, dest.first_head, dest.num_heads)
                sends.append((self.transport.send(message, dest.peer, layer_tag(dest.tag_base, layer)), message))
        except TransportError as exc:
            self.record.fail(str(exc))
            return
        self._pending.append(sends)

    def finish(self) -> TransferState:
        """Waits for all sends until the deadline; returns the final state."""
        for sends in self._pending:
            if self.record.state.terminal:
                break
            try:
                for work, _ in sends:
                    work.wait(max(0.0, self.record.deadline - time.monotonic()))
            except TransportError as exc:
                self.record.fail(str(exc))
                break
            self.record.layer_moved()
        if not self.record.state.terminal:
            self.record.fail(f"only {self.record.layers_done} of {self.record.num_layers} layers were computed")
        self._pending.clear()
        return self.record.state

    def abort(self, reason: str) -> None:
        self.record.abort(reason)
        self._pending.clear()
