"""Where a draft model's KV of a prompt is built, per request: by the decode worker itself (its
draft catches up on the prompt in the forward of the request's first guess) or by the prefill
worker beside the model's (it runs the draft over the same chunks and sends the draft's blocks
after the model's; ``TransferTarget.draft_first_block``).

``draft_prompt_kv`` (``decode.speculative``) says ``decode``, ``prefill``, or ``auto``: then
:func:`build_on_prefill` compares, for the ``tokens`` of the prompt the decode worker's draft lacks
(and the ``blocks`` they fill), what each place costs:

    decode:   catch_up_s_per_token * tokens
    prefill:  prefill_s_per_token * tokens + blocks * block_bytes / transfer_bytes_per_s

``catch_up_s_per_token`` is what the speculative policy charges a token of catch-up (a row of
the decode worker's draft step: ``DraftProposer.catch_up_s_per_token``); ``prefill_s_per_token``
the prefill worker's draft, measured over the prompts it built (``DraftProposer.prompt_s_per_token``,
reported with each prefill); ``transfer_bytes_per_s`` the decode worker's measured receives. The
prefill worker builds it where that is cheaper. A cost not measured yet sends the work to the
prefill worker, which is how its cost gets measured (and a decode worker without a step cost
would guess at once, paying the whole catch-up); a transfer rate not measured yet counts the
draft's blocks as free.

Measured (``benchmarks/draft_prompt_kv.py``, this 2-core CPU, loaded; the default model drafting
for itself): the prefill engine's draft took 1.04 ms a prompt token at 128 tokens and 1.21 at
512 (its prefill 130 -> 265 ms and 623 -> 1,239 ms); the decode engine's catch-up forward 1.17
and 1.25 ms a token (150 and 640 ms in one step of the decode batch), where the policy charges a
catch-up token 0.74 ms (its draft's decode-step row, which a wide forward exceeds here); the
draft's 720 KiB blocks add 0.25 ms a token at the router's default gloo rate. So ``auto`` keeps
that draft's work on the decode worker here (1.04 + 0.25 > 0.74 ms a token): on one machine the
work only moves, and the transfer is extra. It pays where the prefill worker's draft is cheaper
per token than the decode worker's catch-up (a faster prefill device, a decode worker whose
fitted rows are dear).
"""

from __future__ import annotations

from dataclasses import dataclass

PLACES = ("auto", "decode", "prefill")


@dataclass(frozen=True)
class DraftPromptCosts:
    catch_up_s_per_token: float | None  # the decode worker's draft, as the policy charges a catch-up token
    prefill_s_per_token: float | None  # the prefill worker's draft over prompts, measured
    block_bytes: int  # one block of the draft's KV
    transfer_bytes_per_s: float | None  # the decode worker's receives, measured


def build_on_prefill(place: str, tokens: int, blocks: int, costs: DraftPromptCosts) -> bool:
    """Whether the prefill worker builds the draft's KV of a prompt whose ``tokens`` (in
    ``blocks`` blocks) the decode worker's draft lacks (the rule: the module's docstring)."""
    if place not in PLACES:
        raise ValueError(f"draft_prompt_kv must be one of {', '.join(PLACES)}, got {place!r}")
    if place != "auto" or tokens <= 0:
        return place == "prefill"
    if costs.catch_up_s_per_token is None or costs.prefill_s_per_token is None:
        return True
    transfer_s = blocks * costs.block_bytes / costs.transfer_bytes_per_s if costs.transfer_bytes_per_s else 0.0
    return costs.prefill_s_per_token * tokens + transfer_s < costs.catch_up_s_per_token * tokens
