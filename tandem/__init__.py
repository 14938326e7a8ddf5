"""Tandem's front door.

    from tandem import LLM, SamplingParams, ChatPrompt  # the engine in this process
    from tandem import StructuredOutput               # SamplingParams(structured=...): constrained output
    from tandem import DisaggregatedLLM               # prefill and decode workers on Ray, no server
    from tandem import TandemClient                   # a running cluster, over its gRPC API

Names are imported when first used, so the client alone (``TandemClient``, ``TandemError``)
needs neither torch nor Ray. ``TandemClient`` speaks the public gRPC API
(``proto/tandem/v1/tandem.proto``); its generated messages and stubs are in ``tandem.v1``.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "LLM": "cluster.offline.llm",
    "SamplingParams": "cluster.engine.sampling_params",
    "ChatPrompt": "cluster.engine.chat_template",
    "StructuredOutput": "cluster.engine.structured.spec",
    "RequestOutput": "cluster.engine.engine",
    "DisaggregatedLLM": "cluster.offline.disaggregated",
    "TandemClient": "tandem.client",
    "TandemError": "tandem.client",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
