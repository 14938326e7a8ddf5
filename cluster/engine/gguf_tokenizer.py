"""A ``tokenizers`` Tokenizer built from a GGUF file's vocabulary (byte-level BPE).

A GGUF has no ``tokenizer.json``: it stores the tokens, their types, the merges and the special
token ids as metadata, and names its pre-tokenizer (``tokenizer.ggml.pre``): the regular
expressions that cut text into words before BPE, as llama.cpp applies them. Tokens marked
CONTROL become special tokens (matched whole in text, skipped when decoding); USER_DEFINED ones
become plain added tokens (matched whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

CONTROL, USER_DEFINED = 3, 4


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """The tokenizer a GGUF file describes, as its metadata gives it."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (sentencepiece), ...
    pre: str  # tokenizer.ggml.pre: names the pre-tokenizer's split rule
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def tokenizer_spec(metadata: Mapping[str, Any]) -> GGUFTokenizerSpec | None:
    """The tokenizer in a GGUF file's metadata, or None when the file has no vocabulary."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    model = metadata.get("tokenizer.ggml.model", "gpt2")
    add_bos_default = model == "llama"  # llama.cpp adds BOS to a sentencepiece vocabulary unless told not to
    return GGUFTokenizerSpec(
        model=model,
        pre=metadata.get("tokenizer.ggml.pre", "default"),
        tokens=list(tokens),
        token_types=list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)),
        merges=list(metadata.get("tokenizer.ggml.merges") or []),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the splits applied in order (each piece of one split is cut by the next).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "gpt-2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
    # Digits one by one, then GPT-2's rule.
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
}

# Pre-tokenizers whose BPE keeps a word that is itself in the vocabulary whole (llama.cpp's
# ignore_merges, as Llama 3's tokenizer.json has it).
_IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe"})


class GGUFTokenizerError(ValueError):
    pass


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def _spelled(token: str, alphabet: set[str]) -> str:
    """A token as the byte-level vocabulary spells it (tokens outside the alphabet are raw text)."""
    if set(token) <= alphabet:
        return token
    spelling = byte_alphabet()
    return "".join(spelling[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    splits = PRE_TOKENIZER_SPLITS.get(pre)
    if splits is None:
        raise GGUFTokenizerError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    steps = [pre_tokenizers.Split(Regex(rule), behavior="isolated") for rule in splits]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _post_processor(spec: GGUFTokenizerSpec, tokens: list[str]) -> processors.TemplateProcessing:
    before, after, special = [], [], []
    for wanted, token_id, where in ((spec.add_bos, spec.bos_token_id, before), (spec.add_eos, spec.eos_token_id, after)):
        if wanted and token_id is not None:
            where.append(tokens[token_id])
            special.append((tokens[token_id], token_id))
    single = " ".join([*before, "$A", *after])
    pair = " ".join([*before, "$A", *after, *before, "$B:1", *after])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(dict.fromkeys(special)))


def build_gguf_tokenizer(spec: GGUFTokenizerSpec) -> HFTokenizer:
    """The tokenizer a GGUF's metadata describes; raises GGUFTokenizerError for a kind we do not build."""
    if spec.model != "gpt2":
        raise GGUFTokenizerError(
            f"GGUF tokenizer model {spec.model!r} is not supported (byte-level BPE, 'gpt2', is); "
            "send prompt_token_ids instead of text"
        )
    alphabet = set(byte_alphabet().values())
    tokens = [_spelled(t, alphabet) for t in spec.tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=spec.pre in _IGNORE_MERGES)
    tokenizer = HFTokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(spec.pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(spec, tokens)
    types = spec.token_types
    # Added tokens are matched in raw text, so only those the vocabulary spells as raw text can be;
    # a CONTROL token spelled otherwise is a mislabelled ordinary one.
    control = [t for t, raw, k in zip(tokens, spec.tokens, types) if k == CONTROL and t == raw]
    user = [t for t, raw, k in zip(tokens, spec.tokens, types) if k == USER_DEFINED and t == raw]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tokenizer
