"""A prefill worker: a Ray actor holding an engine (and, with TP, its follower ranks).

For each request it computes the part of the prompt its own prefix cache lacks, samples the
first token, and streams each layer's KV to the decode worker while the next layers compute
(the request carries a :class:`TransferTarget`; where it asks, with the draft model's KV of the
prompt too, built beside the model's: ``EngineConfig.prompt_draft_model``); it answers with a
:class:`~cluster.protocol.messages.PrefillResult`. Its blocks are freed as soon as the request
ends; sent messages are copies, so nothing waits on the decode side to free them.

``prefill`` calls run concurrently (a threaded actor): each adds its request and waits, while
one loop thread steps the engine, so concurrent prompts share steps (chunked, token-budgeted
batches) as in the colocated engine.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from cluster.engine.config import EngineConfig
from cluster.engine.request import TransferTarget
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.protocol.messages import PrefillResult
from cluster.worker.engine_worker import EngineWorker

if TYPE_CHECKING:
    from cluster.engine.engine import RequestOutput


class PrefillWorker(EngineWorker):
    prefill_side = True
    role = "prefill"

    def __init__(self, config: EngineConfig, registry_url: str | None = None, profile: bool = True):
        self._done: dict[str, threading.Event] = {}
        self._first: dict[str, tuple[int, float | None, list | None]] = {}
        super().__init__(config, registry_url, profile)

    def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                target: TransferTarget, resumed_tokens: int = 0) -> PrefillResult:
        """``resumed_tokens``: the prompt's last tokens are output an earlier placement streamed
        (a constrained request's first token here obeys its grammar past them)."""
        started = time.perf_counter()
        if target.pair not in self.pairs_joined:  # started again, and not paired with that decode worker yet
            return PrefillResult(request_id=request_id, first_token=None, prompt_tokens=len(prompt_token_ids),
                                 cached_tokens=0, blocks_sent=0,
                                 error=f"{self.name} has no KV transfer group {target.pair} (not paired yet)")
        done = threading.Event()
        with self._lock:
            try:
                request = self.engine.add_request(request_id, prompt_token_ids,
                                                  replace(params, max_tokens=1, stop=()), transfer=target,
                                                  resumed_tokens=resumed_tokens)
            except InvalidRequestError as exc:
                return PrefillResult(request_id=request_id, first_token=None, prompt_tokens=len(prompt_token_ids),
                                     cached_tokens=0, blocks_sent=0, error=str(exc))
            self._done[request_id] = done
            self.arrivals.took(request_id)
        if not done.wait(target.timeout_s + 30):
            with self._lock:
                self.engine.abort_request(request_id)
                self._done.pop(request_id, None)
            return PrefillResult(request_id=request_id, first_token=None, prompt_tokens=request.num_prompt_tokens,
                                 cached_tokens=0, blocks_sent=0, error="prefill did not finish in time")
        with self._lock:
            first_token, logprob, top = self._first.pop(request_id, (None, None, None))
            error = self.engine.transfer_errors.pop(request_id, "the request ended before its KV was sent")
        blocks = -(-request.num_prompt_tokens // self.engine.config.block_size) - target.first_block
        return PrefillResult(request_id=request_id, first_token=first_token, prompt_tokens=request.num_prompt_tokens,
                             cached_tokens=request.num_cached_tokens, blocks_sent=blocks if error is None else 0,
                             error=error or request.error, first_logprob=logprob, first_top_logprobs=top,
                             service_s=time.perf_counter() - started, draft_s_per_token=self._draft_s_per_token())

    def _draft_s_per_token(self) -> float | None:
        """Its draft's measured seconds per prompt token, where it builds prompts' draft KV."""
        draft = self.engine.draft
        with self._lock:
            return draft.prompt_s_per_token() if draft is not None else None

    def ping(self) -> None:
        """Answers at once: a decode worker times its calls' round trip by it when it pairs."""

    def in_flight(self) -> int:
        """Prefill calls not answered yet (each holds its request until its KV is sent)."""
        with self._lock:
            return len(self._done)

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests() or self.engine.loads_in_flight

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.token_ids and output.request_id not in self._first:
                top = (output.top_logprobs or [[]])[0] if output.logprobs else None
                self._first[output.request_id] = (output.token_ids[0],
                                                  output.logprobs[0] if output.logprobs else None, top)
            if output.finished and output.request_id in self._done:
                self._done.pop(output.request_id).set()
