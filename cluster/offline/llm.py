"""Offline generation: give prompts, get every result back in order."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from typing import Sequence

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.engine.sampling_params import SamplingParams
from cluster.parallel.tp_runner import engine_runner


class LLM:
    """``LLM("path/to/model").generate(["Hello"], SamplingParams(max_tokens=20))``.

    Keyword arguments are ``EngineConfig`` fields (dtype, block_size, num_kv_blocks, ...).
    """

    def __init__(self, model: str | None = None, verbose: bool = True, **engine_args):
        if model is None:
            from cluster.default_model import default_model_path

            model = str(default_model_path())
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args), verbose=verbose,
                                make_runner=engine_runner())

    def shutdown(self) -> None:
        """Stops the engine's other processes (tensor-parallel ranks); also on leaving ``with``."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        priorities = priorities or [0] * len(prompts)
        base = f"gen-{time.monotonic_ns()}-"
        ids = [f"{base}{i}" for i in range(len(prompts))]
        for request_id, prompt, p, priority in zip(ids, prompts, params, priorities):
            self.engine.add_request(request_id, prompt, p, priority=priority)
        return self.run_until_done(ids, progress)

    def run_until_done(self, request_ids: Sequence[str], progress: bool = False) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        started = time.perf_counter()
        last_report = started
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
            if progress and time.perf_counter() - last_report > 2.0:
                last_report = time.perf_counter()
                tokens = self.engine.stats.generated_tokens
                print(
                    f"\r[tandem] {len(results)}/{len(request_ids)} requests done, {tokens} tokens, "
                    f"{tokens / (last_report - started):.1f} tok/s",
                    end="", file=sys.stderr, flush=True,
                )
        if progress:
            print(file=sys.stderr)
        return [results[i] for i in request_ids]


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return replace(SamplingParams(temperature=0.0, max_tokens=max_tokens), **kwargs)
