"""The model's tokenizer (a Hugging Face ``tokenizer.json``, or the vocabulary in a GGUF file),
its chat template, and incremental detokenization with stop strings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from cluster.engine.chat_template import ChatTemplate, ChatTemplateError, template_source
from cluster.engine.models.source import ModelSource, ModelSourceError, resolve_model_source


class TokenizerError(ValueError):
    pass


class Tokenizer:
    """``Tokenizer(path)`` for a model directory or GGUF file (see
    :func:`~cluster.engine.models.source.resolve_model_source`). ``chat_template`` is None when
    the model has none."""

    def __init__(self, model: str | Path | ModelSource):
        given = model.path if isinstance(model, ModelSource) else Path(model).expanduser()
        if (given / "tokenizer.json").is_file():  # a tokenizer folder needs no config.json
            self._load_directory(given)
        else:
            try:
                source = resolve_model_source(model)
            except ModelSourceError:
                if given.is_dir():
                    raise TokenizerError(f"{given} has no tokenizer.json; pass prompt_token_ids instead of text") from None
                raise
            if source.is_gguf:
                self._load_gguf(source)
            else:
                self._load_directory(source.path)
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        # Whether plain encoding puts BOS first: a chat prompt gets it too (once) when so.
        self.adds_bos = self.bos_token_id is not None and self._tok.encode("").ids[:1] == [self.bos_token_id]

    def _load_directory(self, directory: Path) -> None:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{directory} has no tokenizer.json; pass prompt_token_ids instead of text")
        self._tok = _HFTokenizer.from_file(str(path))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.bos_token, self.eos_token = special["bos_token"], special["eos_token"]
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            text, origin = jinja_path.read_text(), str(jinja_path)
        else:
            text, origin = template_source(config.get("chat_template")), str(config_path)
        self.chat_template = self._template(text, special, origin)

    def _load_gguf(self, source: ModelSource) -> None:
        from cluster.engine.gguf_tokenizer import GGUFTokenizerError, build_gguf_tokenizer, tokenizer_spec
        from cluster.engine.models.gguf_index import read_index

        try:
            spec = tokenizer_spec(read_index(source.gguf_file).metadata)
        except (ValueError, OSError, IndexError, KeyError) as exc:
            raise TokenizerError(f"{source.gguf_file}: not a readable GGUF file ({exc})") from None
        if spec is None:
            raise TokenizerError(f"{source.gguf_file} has no vocabulary; pass prompt_token_ids instead of text")
        try:
            self._tok = build_gguf_tokenizer(spec)
        except GGUFTokenizerError as exc:
            raise TokenizerError(f"{source.gguf_file}: {exc}") from None

        def text_of(token_id: int | None) -> str | None:
            return spec.tokens[token_id] if token_id is not None and 0 <= token_id < len(spec.tokens) else None

        self.bos_token, self.eos_token = text_of(spec.bos_token_id), text_of(spec.eos_token_id)
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        self.chat_template = self._template(spec.chat_template, special, str(source.gguf_file))

    @staticmethod
    def _template(text: str | None, special: dict[str, str | None], origin: str) -> ChatTemplate | None:
        if not text:
            return None
        return ChatTemplate(text, {k: v for k, v in special.items() if v is not None}, origin)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id, added tokens included (two tokenizers with the same map
        split any text into the same ids)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as Hugging Face ``tokenizer.json`` text (what the grammar backend reads)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            tools: list | None = None, tool_format: str = "hermes") -> list[int]:
        """The token ids of the templated chat: the text is tokenized as the template wrote it
        (special tokens in it are matched whole, none added), and BOS is put first only where
        the tokenizer adds one and the template did not write it. Raises ChatTemplateError."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a prompt instead of messages")
        text = self.chat_template.render(messages, add_generation_prompt, tools, tool_format)
        ids = self.encode(text, add_special_tokens=False)
        if self.adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids


def _token_text(value: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string, or an AddedToken's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


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
