"""The local-or-remote prefill decision: whether a worker that decodes a request may also
prefill it itself, in a step with its decodes, instead of (or as well as) taking its KV from a
prefill worker.

A colocated worker always prefills itself. A decode worker may when little is left to compute:
it caches nearly all of the prompt (``skip_prefill_fraction``: conditional disaggregation) or at
most ``local_prefill_max_tokens`` of it are not cached; or when it can take KV from no live
prefill worker now (its pairs are being rebuilt). Being allowed to is not being chosen: the
local candidate is scored and admitted beside the remote pairs.
"""

from __future__ import annotations

from router.config import RouterConfig


def mostly_cached(hit_blocks: int, cacheable_blocks: int, skip_prefill_fraction: float) -> bool:
    return bool(cacheable_blocks) and hit_blocks >= skip_prefill_fraction * cacheable_blocks


def prefills_itself(*, colocated: bool, hit_blocks: int, cacheable_blocks: int, uncached_tokens: int,
                    every_pair_cut_off: bool, config: RouterConfig) -> bool:
    """True when the worker may prefill the prompt itself (see the module's docstring)."""
    return (colocated
            or mostly_cached(hit_blocks, cacheable_blocks, config.skip_prefill_fraction)
            or every_pair_cut_off
            or uncached_tokens <= config.local_prefill_max_tokens)
