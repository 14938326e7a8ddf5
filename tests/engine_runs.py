"""Running an engine in a test: one request stepped to its end."""

from __future__ import annotations

from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.engine.sampling_params import SamplingParams


def run_one(llm: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams) -> RequestOutput | None:
    """Adds the request and steps the engine until nothing is unfinished: its final output."""
    llm.add_request(request_id, prompt, params)
    finished = None
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished = output
    return finished
