"""A draft model's KV through the model's transfer pairs.

A draft runs as one rank beside rank 0 of each engine (``cluster/engine/speculative/draft.py``),
whatever the engines' TP degrees, so its KV of a prompt travels whole from the prefill engine's
rank 0 to the decode engine's rank 0: no re-sharding, only the model's own KV is re-sharded by
the pair's layout. It rides the model's transfer: the same pair (transport and group), its
layers' tags after the model's (``tag_base + (model layers + i) * TAG_STRIDE`` for draft layer
``i``), so one tag range per request carries both; a decode worker spaces its requests' tag bases
by the layers of both models (``LLMEngine.transfer_layers``).
"""

from __future__ import annotations

import torch

from cluster.kv_transfer.agent import TransferAgent
from cluster.kv_transfer.resharding import HeadSlice
from cluster.kv_transfer.sender import TAG_STRIDE


class DraftTransferAgent(TransferAgent):
    """The draft's KV port of rank 0, sharing ``model``'s pairs (joined and left through it)."""

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
