"""A prefill worker: a Ray actor holding an engine (and, with TP, its follower ranks).

For each request it computes the part of the prompt its own prefix cache lacks, samples the
first token, and streams each layer's KV to the decode worker while the next layers compute
(the request carries a :class:`TransferTarget`). Its blocks are freed as soon as the request
ends; sent messages are copies, so nothing waits on the decode side to free them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.request import TransferTarget
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.kv_transfer.agent import PairLayout
from cluster.parallel.group import GroupSpec


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int | None
    prompt_tokens: int
    cached_tokens: int  # hits in this prefill worker's own prefix cache
    blocks_sent: int
    error: str | None
    first_logprob: float | None = None  # when the request asked for logprobs
    first_top_logprobs: list[tuple[int, float]] | None = None


class PrefillWorker:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config, verbose=False)

    def describe(self) -> dict:
        return {"num_kv_heads": self.engine.model_config.num_kv_heads, "tp": self.engine.config.tensor_parallel_size,
                "num_layers": self.engine.model_config.num_layers, "free_blocks": self.engine.block_manager.num_free_blocks}

    def join_pair(self, layout: PairLayout, spec: GroupSpec) -> None:
        self.engine.runner.join_transfer(layout, spec, prefill_side=True)

    def leave_pair(self, name: str) -> None:
        self.engine.runner.transfers.leave(name)

    def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                target: TransferTarget) -> PrefillResult:
        engine = self.engine
        try:
            request = engine.add_request(request_id, prompt_token_ids, replace(params, max_tokens=1, stop=()),
                                         transfer=target)
        except InvalidRequestError as exc:
            return PrefillResult(request_id, None, len(prompt_token_ids), 0, 0, str(exc))
        first_token, logprob, top = None, None, None
        while not request.finished:
            for output in engine.step():
                if output.request_id == request_id and output.token_ids:
                    first_token = output.token_ids[0]
                    if output.logprobs:
                        logprob, top = output.logprobs[0], (output.top_logprobs or [[]])[0]
        error = engine.transfer_errors.pop(request_id, "the request ended before its KV was sent")
        blocks = -(-request.num_prompt_tokens // engine.config.block_size) - target.first_block
        return PrefillResult(request_id, first_token, request.num_prompt_tokens, request.num_cached_tokens,
                             blocks if error is None else 0, error or request.error, logprob, top)

    def free_blocks(self) -> int:
        return self.engine.block_manager.num_free_blocks

    def shutdown(self) -> None:
        self.engine.shutdown()
