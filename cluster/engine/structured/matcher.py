"""One request's place in its grammar, advanced by the tokens the request emits."""

from __future__ import annotations

from typing import Sequence

from llguidance import LLMatcher


class Matcher:
    """Wraps the backend's matcher: ``parser`` is what the step's mask building reads
    (``masks.py``); the engine advances it with each emitted token and asks whether the grammar
    has ended (nothing but the end of sequence may follow)."""

    __slots__ = ("parser",)

    def __init__(self, parser: LLMatcher):
        self.parser = parser

    def accept(self, token: int) -> bool:
        """Advances past ``token``; False when the grammar refuses it (the matcher is then in error)."""
        return self.parser.consume_token(token)

    def replay(self, tokens: Sequence[int]) -> bool:
        """Advances past tokens emitted elsewhere (a prefill worker's first token, the output a
        failed placement already streamed); False when the grammar refuses one."""
        return self.parser.consume_tokens(list(tokens)) if tokens else True

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar accepts from here (nothing is consumed)."""
        return self.parser.validate_tokens(list(tokens)) if tokens else 0

    @property
    def ended(self) -> bool:
        """The grammar is complete and nothing but the end of sequence may follow."""
        return self.parser.is_stopped() and not self.parser.is_error()

    @property
    def error(self) -> str:
        return self.parser.get_error()
