"""Tokenizer (``tokenizer.json`` through the ``tokenizers`` library) and incremental
detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir} has no tokenizer.json; pass prompt_token_ids instead of text")
        self._tok = _HFTokenizer.from_file(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Appends tokens and yields text deltas, decoding only a short window each time.

    Two offsets bound the window: decoding from ``prefix_offset`` both up to ``read_offset``
    and up to the end, and taking the difference, keeps spacing right for tokenizers whose
    decoders depend on the previous token. A delta that ends in an incomplete UTF-8 sequence
    waits for the next token. Stop strings are searched only where the new text could complete
    one; the text is cut before the stop string, and the last ``len(longest stop) - 1``
    characters are held back from streaming until they cannot start one.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def append(self, token_id: int) -> bool:
        """Adds a token; returns True when a stop string was completed."""
        self.token_ids.append(token_id)
        if self.stopped:
            return True
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self.prefix_offset :], self.skip_special_tokens)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return False
        before = len(self.text)
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._check_stop(before)

    def _check_stop(self, before: int) -> bool:
        search_from = max(0, before - self.hold_back)
        cut = min((i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
        return self.stopped

    def take_delta(self, final: bool) -> str:
        """Text not yet streamed; while unfinished, what might still begin a stop string waits."""
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
