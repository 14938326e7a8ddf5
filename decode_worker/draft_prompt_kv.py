"""A decode worker's choice, per request, of where its draft model's KV of a prompt is built
(``decode.speculative.draft_prompt_kv``; the rule: ``cluster/engine/speculative/prompt_kv.py``),
with the figures it is made from: the prefill workers' draft per prompt token (each prefill
reports its draft's measured cost, ``PrefillResult.draft_s_per_token``) and this worker's KV
receive rate (the bytes of the latest transfers over their time beyond the prefill worker's own
work: what a transfer adds after the prefill, as the draft's blocks travel after the model's
forward). The share of its remote prefills that asked for the draft's KV goes in its load report
(``WorkerLoad.draft_prompt_share``), so the router counts the prefill worker's extra work.
"""

from __future__ import annotations

from collections import deque

from cluster.engine.speculative.prompt_kv import DraftPromptCosts, build_on_prefill

SAMPLES_KEPT = 16  # the latest transfers the receive rate is taken over
SHARE_WEIGHT = 0.1  # of the latest decision in the reported share


class DraftPromptPlacement:
    def __init__(self, place: str):
        self.place = place
        self.prefill_s_per_token: dict[str, float] = {}  # prefill worker -> its draft's, as it last reported
        self._transfers: deque[tuple[int, float]] = deque(maxlen=SAMPLES_KEPT)  # (bytes, seconds)
        self.share = 0.0  # of remote prefills that asked for the draft's KV, a running mean

    @property
    def bytes_per_s(self) -> float | None:
        transfers = tuple(self._transfers)  # the reporter reads it from its own thread
        seconds = sum(s for _, s in transfers)
        return sum(b for b, _ in transfers) / seconds if seconds > 0 else None

    def transferred(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self._transfers.append((nbytes, seconds))

    def reported(self, prefill: str, s_per_token: float | None) -> None:
        if s_per_token is not None:
            self.prefill_s_per_token[prefill] = s_per_token

    def choose(self, prefill: str, tokens: int, blocks: int, catch_up_s_per_token: float | None,
               block_bytes: int) -> bool:
        """Whether ``prefill`` builds the draft's KV of a prompt whose ``tokens`` (in ``blocks``)
        this worker's draft lacks; the choice moves the reported share."""
        costs = DraftPromptCosts(catch_up_s_per_token, self.prefill_s_per_token.get(prefill), block_bytes,
                                 self.bytes_per_s)
        there = build_on_prefill(self.place, tokens, blocks, costs)
        self.share += SHARE_WEIGHT * ((1.0 if there else 0.0) - self.share)
        return there
