"""A decode worker: a Ray actor holding an engine that generates from KV computed elsewhere.

Requests arrive in three calls: ``reserve`` holds blocks (reusing the prompt's full blocks
this worker already caches, so only the rest travel), ``receive`` takes the KV straight into
those blocks, and ``admit`` joins the request into the running batch with the first token the
prefill worker sampled. A background thread steps the engine whenever requests are running, so
receives proceed while other requests decode (they write only blocks reserved for them). A
receive that fails or passes its deadline frees the request's blocks at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from cluster.engine.config import EngineConfig
from cluster.engine.engine import RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.engine_worker import EngineWorker


class DecodeWorker(EngineWorker):
    prefill_side = False
    role = "decode"

    def __init__(self, config: EngineConfig, registry_url: str | None = None, profile: bool = True):
        self._outbox: list[RequestOutput] = []
        self._outbox_lock = threading.Lock()  # so that polling never waits for a step
        self._streamed: set[str] = set()  # requests whose every new token is reported, not just the end
        super().__init__(config, registry_url, profile)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                priority: int = 0) -> tuple[int, list[int]] | None:
        """(blocks already cached here, block ids for the KV), or None when blocks are short.
        Raises InvalidRequestError for a request that can never run."""
        with self._lock:
            return self.engine.reserve_transfer(request_id, prompt_token_ids, params, priority)

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, stream: bool = False) -> None:
        """Runs a request here from its prompt: the router's choice when this worker already
        caches nearly all of it, so a remote prefill would save little and cost a transfer."""
        with self._lock:
            self.engine.add_request(request_id, prompt_token_ids, params, priority)
            if stream:
                self._streamed.add(request_id)

    def receive(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int,
                timeout_s: float) -> str | None:
        """Blocks until the KV is in place; None, or the error (the request is then aborted)."""
        started = time.perf_counter()
        error = self.engine.receive_transfer(pair, request_id, dst_blocks, tag_base, timeout_s)
        if error is not None:
            self.release(request_id)
        else:
            self.metrics.received(len(dst_blocks) * self.engine.runner.block_bytes, time.perf_counter() - started)
        return error

    def admit(self, request_id: str, first_token: int, logprob: float | None = None,
              top_logprobs: list[tuple[int, float]] | None = None, stream: bool = False) -> None:
        with self._lock:
            if stream:
                self._streamed.add(request_id)
            self._on_outputs([self.engine.admit_transfer(request_id, first_token, logprob, top_logprobs)])

    def release(self, request_id: str) -> None:
        """Aborts a reserved or running request and frees its blocks."""
        with self._lock:
            self.engine.abort_request(request_id)
            self._streamed.discard(request_id)

    def poll(self) -> list[RequestOutput]:
        """Outputs since the last poll: every finished request, and the new tokens of streamed ones."""
        with self._outbox_lock:
            out, self._outbox = self._outbox, []
        return out

    def _has_work(self) -> bool:
        # Requests still receiving their KV are not schedulable yet.
        return bool(self.engine.scheduler.running or self.engine.scheduler.waiting)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        with self._outbox_lock:
            for output in outputs:
                if output.finished:
                    self._streamed.discard(output.request_id)
                    self._outbox.append(output)
                elif output.request_id in self._streamed:
                    self._outbox.append(_delta(output))


def _delta(output: RequestOutput) -> RequestOutput:
    """An unfinished output slimmed to what is new (not the prompt, nor the tokens sent before)."""
    new = len(output.new_token_ids)
    return replace(output, prompt_token_ids=[], token_ids=[], text="",
                   logprobs=output.logprobs[-new:] if output.logprobs is not None else None,
                   top_logprobs=output.top_logprobs[-new:] if output.top_logprobs is not None else None)
