"""How long a refused request is told to wait before it tries again, as each API says it: HTTP's
``Retry-After`` (whole seconds, at least 1) with ``retry-after-ms`` (which OpenAI's clients
read first), and gRPC's trailing metadata ``retry-after`` (the same seconds) with
``grpc-retry-pushback-ms`` (what a gRPC client's retry policy honours). The time is the
router's prediction (``router/wait_forecast.py``); a refusal without one carries none."""

from __future__ import annotations

import math

from cluster.protocol.messages import RequestFailed


def whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))


def whole_milliseconds(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


def http_headers(error: RequestFailed) -> dict[str, str]:
    if error.retry_after_s is None:
        return {}
    return {"Retry-After": str(whole_seconds(error.retry_after_s)),
            "retry-after-ms": str(whole_milliseconds(error.retry_after_s))}


def grpc_trailers(error: RequestFailed) -> tuple[tuple[str, str], ...]:
    if error.retry_after_s is None:
        return ()
    return (("retry-after", str(whole_seconds(error.retry_after_s))),
            ("grpc-retry-pushback-ms", str(whole_milliseconds(error.retry_after_s))))
