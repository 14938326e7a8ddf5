"""Each engine rank's side of KV transfer: the pairs it has joined, and the moves it makes.

A *pair* is one transfer group joining every rank of one prefill engine (group ranks
0..P-1, its TP ranks in order) and every rank of one decode engine (P..P+D-1). Both sides
derive from :func:`plan_head_slices` who sends which KV heads to whom, so no negotiation is
needed per request: the prefill side streams its slices of each layer as the layer finishes,
the decode side posts matching receives straight into the blocks it reserved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cluster.engine.kv_port import KVStream
from cluster.kv_transfer.kv_blocks import layer_message_shape, unpack_layer
from cluster.kv_transfer.resharding import HeadSlice, plan_head_slices
from cluster.kv_transfer.sender import TAG_STRIDE, Destination, KVSender, layer_tag
from cluster.kv_transfer.state import TransferRecord, TransferState
from cluster.kv_transfer.transport import KVTransport, TransportError
from cluster.kv_transfer.transports import create_transport
from cluster.parallel.group import GroupSpec


@dataclass(frozen=True)
class PairLayout:
    name: str
    prefill_tp: int
    decode_tp: int
    num_kv_heads: int
    transport: str = "torch_distributed"

    @property
    def size(self) -> int:
        return self.prefill_tp + self.decode_tp

    def slices(self) -> list[tuple[HeadSlice, int]]:
        """Every head slice with its index among the slices between the same two ranks."""
        seen: dict[tuple[int, int], int] = {}
        out = []
        for s in plan_head_slices(self.num_kv_heads, self.prefill_tp, self.decode_tp):
            index = seen.get((s.sender, s.receiver), 0)
            seen[(s.sender, s.receiver)] = index + 1
            out.append((s, index))
        return out


class TransferAgent:
    """One engine rank's KV port (``cluster/engine/kv_port.py``): the workers give the engine
    this class, and each rank makes one over its KV cache."""

    def __init__(self, kv_cache: torch.Tensor, tp_rank: int, device: str = "cpu"):
        self.kv_cache = kv_cache
        self.tp_rank = tp_rank
        self.device = device
        self.pairs: dict[str, tuple[PairLayout, KVTransport]] = {}

    def join(self, layout: PairLayout, spec: GroupSpec, prefill_side: bool) -> None:
        """Blocks until every rank of both engines has joined ``spec``'s group."""
        rank = self.tp_rank if prefill_side else layout.prefill_tp + self.tp_rank
        self.pairs[layout.name] = (layout, create_transport(layout.transport, spec=spec, rank=rank, device=self.device))

    def leave(self, pair: str) -> None:
        joined = self.pairs.pop(pair, None)
        if joined is not None:
            joined[1].close()

    def slices(self, layout: PairLayout) -> list[tuple[HeadSlice, int]]:
        """The head slices this agent's cache travels in (the model's: re-sharded by the layout)."""
        return layout.slices()

    def tag_base(self, tag_base: int) -> int:
        """The first tag of this agent's messages in a transfer that starts at ``tag_base``."""
        return tag_base

    def draft_port(self, kv_cache: torch.Tensor) -> "TransferAgent":
        """A port over a draft model's KV cache through this agent's pairs (:class:`DraftTransferAgent`)."""
        return DraftTransferAgent(self, kv_cache)

    def senders(self, streams: list[KVStream]) -> list[KVSender]:
        num_layers = self.kv_cache.shape[0]
        out = []
        for stream in streams:
            layout, transport = self.pairs[stream.pair]
            tag_base = self.tag_base(stream.tag_base)
            destinations = [
                Destination(layout.prefill_tp + s.receiver, s.sender_offset, s.num_heads, tag_base + index)
                for s, index in self.slices(layout) if s.sender == self.tp_rank
            ]
            record = TransferRecord.start(stream.request_id, num_layers, stream.timeout_s)
            blocks = list(stream.src_blocks)
            sender = KVSender(transport, self.kv_cache, record, lambda blocks=blocks: blocks, destinations)
            sender.streaming = stream.streaming
            out.append(sender)
        return out

    def finish(self, senders: list[KVSender]) -> dict[str, str | None]:
        return finish_all(senders)

    def receive(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int,
                timeout_s: float) -> str | None:
        """Receives this rank's head slices of every layer into ``dst_blocks``; returns None,
        or the error (a failure never raises, so the caller frees the blocks)."""
        return self.receive_record(pair, request_id, dst_blocks, tag_base, timeout_s).error

    def receive_record(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int,
                       timeout_s: float) -> TransferRecord:
        """The receive, as its record (done or failed)."""
        layout, transport = self.pairs[pair]
        num_layers = self.kv_cache.shape[0]
        record = TransferRecord.start(request_id, num_layers, timeout_s)
        if not dst_blocks:
            for _ in range(num_layers):
                record.layer_moved()
            return record
        ids = torch.tensor(dst_blocks, dtype=torch.long, device=self.kv_cache.device)
        mine = [(s, index) for s, index in self.slices(layout) if s.receiver == self.tp_rank]
        tag_base = self.tag_base(tag_base)
        try:
            pending = []
            for layer in range(num_layers):
                for s, index in mine:
                    shape = layer_message_shape(self.kv_cache, len(dst_blocks), s.num_heads)
                    buffer = torch.empty(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
                    work = transport.recv(buffer, s.sender, layer_tag(tag_base + index, layer))
                    pending.append((layer, s, buffer, work))
            done_in_layer = 0
            for layer, s, buffer, work in pending:
                work.wait(max(0.0, record.deadline - time.monotonic()))
                unpack_layer(self.kv_cache, layer, ids, s.receiver_offset, buffer)
                done_in_layer += 1
                if done_in_layer == len(mine):
                    record.layer_moved()
                    done_in_layer = 0
        except TransportError as exc:
            record.fail(str(exc))
        return record


class DraftTransferAgent(TransferAgent):
    """A draft model's KV port of rank 0, sharing ``model``'s pairs (joined and left through it).

    A draft runs as one rank beside rank 0 of each engine (``cluster/engine/speculative/draft.py``),
    whatever the engines' TP degrees, so its KV of a prompt travels whole from the prefill engine's
    rank 0 to the decode engine's rank 0: no re-sharding, only the model's own KV is re-sharded by
    the pair's layout. It rides the model's transfer: the same pair (transport and group), its
    layers' tags after the model's (``tag_base + (model layers + i) * TAG_STRIDE`` for draft layer
    ``i``), so one tag range per request carries both; a decode worker spaces its requests' tag bases
    by the layers of both models (``LLMEngine.transfer_layers``).
    """

    def __init__(self, model: TransferAgent, kv_cache: torch.Tensor):
        if model.tp_rank != 0:
            raise ValueError(f"a draft model's KV moves from and to rank 0 only, not rank {model.tp_rank}")
        super().__init__(kv_cache, 0, model.device)
        self.pairs = model.pairs  # the same dict: pairs the model joins later are the draft's too
        self._model_layers = model.kv_cache.shape[0]

    def join(self, layout, spec, prefill_side: bool) -> None:
        raise RuntimeError("a draft's KV port uses the model's pairs: join them through the model's port")

    def leave(self, pair: str) -> None:
        raise RuntimeError("a draft's KV port uses the model's pairs: leave them through the model's port")

    def slices(self, layout) -> list[tuple[HeadSlice, int]]:
        heads = self.kv_cache.shape[4]
        return [(HeadSlice(sender=0, receiver=0, first_head=0, num_heads=heads, sender_offset=0, receiver_offset=0), 0)]

    def tag_base(self, tag_base: int) -> int:
        return tag_base + self._model_layers * TAG_STRIDE


def finish_all(senders: list[KVSender]) -> dict[str, str | None]:
    """Sends the layers of non-streaming senders, then waits for every stream's sends;
    request id -> None when done, else the error."""
    for sender in senders:
        if not sender.streaming:
            for layer in range(sender.kv_cache.shape[0]):
                sender.after_layer(layer)
    results = {}
    for sender in senders:
        state = sender.finish()
        results[sender.record.request_id] = None if state is TransferState.DONE else (sender.record.error or state.value)
    return results
