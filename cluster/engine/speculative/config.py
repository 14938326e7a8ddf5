"""How an engine speculates: one frozen, validated object (``EngineConfig.speculative``)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.request_limits import quote
from cluster.engine.speculative.prompt_kv import PLACES

METHODS = ("ngram", "draft")
MAX_NUM_TOKENS = 16
# The most guesses a step, by method, where num_tokens is not given: a prompt lookup's guesses cost
# a dictionary lookup and come in long runs on text that repeats its input (workload (a) of
# benchmarks/speculative.py at batch 1, the engines side by side, 4 rounds: up to 8 guesses made
# 1.95x off's tokens/s, up to 4 1.88x); a draft's each cost a step of the draft.
DEFAULT_NUM_TOKENS = {"ngram": 8, "draft": 4}
MAX_NGRAM = 64  # the longest suffix looked up


class SpeculativeConfigError(ValueError):
    """A speculative setting that cannot work; the message names it."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_tokens``: the most tokens guessed for a request in one step (None: the method's
    ``DEFAULT_NUM_TOKENS``, filled in at construction); ``adaptive``: the policy (``policy.py``)
    guesses fewer, or none, where guessing would not pay (off: every proposal is checked in full,
    up to ``num_tokens``); ``ngram_min``..``ngram_max``: the lengths of the suffix looked up
    earlier in the request's tokens, longest first (``ngram``);
    ``draft_model``: the checkpoint (a path, as the target model is named) whose greedy tokens are
    the guesses (``draft``; ``speculative/draft.py``); ``draft_prompt_kv``: where the draft's KV of
    a prompt that arrives from a prefill worker is built (``speculative/prompt_kv.py``)."""

    method: str = "ngram"
    num_tokens: int | None = None
    adaptive: bool = True
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    draft_prompt_kv: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative.method must be one of {', '.join(METHODS)}, got {quote(self.method)}")
        if self.num_tokens is None:
            object.__setattr__(self, "num_tokens", DEFAULT_NUM_TOKENS[self.method])
        if self.method == "draft" and (not isinstance(self.draft_model, str) or not self.draft_model.strip()):
            raise SpeculativeConfigError("speculative.draft_model must name the draft checkpoint (a model directory or "
                                         f".gguf file) with method draft, got {quote(self.draft_model)}")
        if self.method != "draft" and self.draft_model is not None:
            raise SpeculativeConfigError(f"speculative.draft_model is read only with method draft (method is "
                                         f"{quote(self.method)}): remove it or set method: draft")
        if self.draft_prompt_kv not in PLACES:
            raise SpeculativeConfigError(f"speculative.draft_prompt_kv must be one of {', '.join(PLACES)}, got "
                                         f"{quote(self.draft_prompt_kv)}")
        if self.method != "draft" and self.draft_prompt_kv != "auto":
            raise SpeculativeConfigError(f"speculative.draft_prompt_kv is read only with method draft (method is "
                                         f"{quote(self.method)}): remove it or set method: draft")
        for name, low, high in (("num_tokens", 1, MAX_NUM_TOKENS), ("ngram_min", 1, MAX_NGRAM), ("ngram_max", 1, MAX_NGRAM)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise SpeculativeConfigError(f"speculative.{name} must be an integer in [{low}, {high}], got {quote(value)}")
        if not isinstance(self.adaptive, bool):
            raise SpeculativeConfigError(f"speculative.adaptive must be true or false, got {quote(self.adaptive)}")
        if self.ngram_min > self.ngram_max:
            raise SpeculativeConfigError(
                f"speculative.ngram_min ({self.ngram_min}) must not exceed speculative.ngram_max ({self.ngram_max})")
