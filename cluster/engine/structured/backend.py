"""The grammar backend: llguidance, bound to the model's tokenizer, with compiled grammars
cached by spec.

Why llguidance (1.9.1) and not xgrammar (0.2.8): measured on the default model's tokenizer
(SmolLM2, 49,152 tokens) on this 2-core AMD EPYC, for a nested JSON schema (objects three deep,
an enum, arrays of strings and of objects; a 90-token document), one thread each
(``benchmarks/grammar_backends.py``):

==========================================  =================  ===================
                                            llguidance         xgrammar
==========================================  =================  ===================
per-token mask, mean / p50 / p99            37 / 7 / 417 us    216 / 1.5 / 3,259 us
schema compile, cold, p50 / p99             0.75 / 1.4 ms      2.4 / 112 ms
compiled grammar to a new matcher (cached)  0.5 us             12 us
tokenizer set-up (once per engine)          0.17 s             0.10 s
==========================================  =================  ===================

xgrammar's masks are faster where its per-state cache hits and far slower where it does not
(inside strings: its p99 is eight times llguidance's), its cold compile is slower and more
variable, and it brings ``transformers`` as a runtime dependency; llguidance needs nothing
else, compiles (and checks) grammars without a tokenizer (the ingress refuses a bad schema
before routing: ``grammars.py``), computes a batch's masks, a verify's guessed positions
included, in one call that releases the GIL (``masks.py``), and has lazy triggered grammars
for structural tags. Both mask a row with only the end of sequence once the grammar ended.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from llguidance import LLMatcher, LLTokenizer

from cluster.engine.request_limits import InvalidRequestError
from cluster.engine.structured.grammars import check, one_line
from cluster.engine.structured.matcher import Matcher
from cluster.engine.structured.spec import StructuredOutput

CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class GrammarBackend:
    """Compiles specs against one tokenizer. ``tokenizer_json``: the tokenizer as Hugging Face
    ``tokenizer.json`` text; ``vocab_size``: the model's (the masks' width); the end-of-sequence
    ids are what a mask allows where the grammar may end."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE):
        eos = sorted(eos_token_ids)
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._compiled: OrderedDict[tuple[str, str, str], LLMatcher] = OrderedDict()

    def matcher(self, spec: StructuredOutput) -> Matcher:
        """A fresh matcher at the start of ``spec``'s grammar; InvalidRequestError naming
        ``spec.source`` when the grammar does not compile for this tokenizer."""
        key = (spec.kind, spec.value, spec.syntax)
        pristine = self._compiled.get(key)
        if pristine is None:
            pristine = LLMatcher(self.tokenizer, check(spec), log_level=0)
            if pristine.is_error():
                raise InvalidRequestError(f"{spec.source}: the {spec.kind} does not compile for this model's "
                                          f"tokenizer: {one_line(pristine.get_error())}")
            self._compiled[key] = pristine
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return Matcher(pristine.deep_copy())

    @property
    def cached(self) -> int:
        return len(self._compiled)
