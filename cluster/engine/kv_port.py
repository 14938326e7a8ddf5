"""How the engine hands KV to another process without knowing how it travels.

The engine decides which blocks of which request leave during a step (a :class:`KVStream` in
the step's plan) and which reserved blocks a request's KV lands in; a *KV port* moves them.
The port is given to the engine from above (``cluster/kv_transfer/agent.py``'s
``TransferAgent``, by the workers), so the engine imports no transport and no transfer
group: an engine built without one (``tandem.LLM``) simply moves no KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch


@dataclass(frozen=True)
class KVStream:
    """Part of a step plan: send these blocks of a request over a pair, each layer as soon as
    it is computed (``streaming``), or all layers once the forward pass is over."""

    pair: str
    request_id: str
    src_blocks: tuple[int, ...]
    tag_base: int
    timeout_s: float
    streaming: bool = True


class LayerSender(Protocol):
    """One request's KV on its way out during a step."""

    streaming: bool

    def after_layer(self, layer: int) -> None: ...


class KVPort(Protocol):
    """One engine rank's KV moves: the pairs it joined, sends during a step, receives."""

    def join(self, layout, spec, prefill_side: bool) -> None: ...

    def leave(self, pair: str) -> None:
        """Closes the pair's group (its peer is being removed): its connections and, on the side
        that hosts it, its rendezvous store's port. A pair never joined is ignored."""

    def senders(self, streams: Sequence[KVStream]) -> list[LayerSender]: ...

    def finish(self, senders: Sequence[LayerSender]) -> dict[str, str | None]:
        """Sends what is left and waits; request id -> None when sent, else the error."""

    def receive(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int,
                timeout_s: float) -> str | None:
        """Receives a request's KV into ``dst_blocks``; None, or the error (never raises)."""

    def draft_port(self, kv_cache: torch.Tensor) -> "KVPort":
        """A port over a draft model's KV cache (rank 0's only) through this port's pairs: its
        blocks travel whole between the engines' first ranks, with tags after the model's layers
        (a transfer's tag range spans both models' layers)."""


KVPortFactory = Callable[[torch.Tensor, int, str], KVPort]  # (this rank's KV cache, TP rank, device)


class NoKVPort(Exception):
    """The engine was built without a KV port, and was asked to move KV."""
