"""IncrementalDetokenizer: incremental text equals a full decode, stop strings are cut at the
token that completes them, and streamed deltas never show (part of) a stop string."""

from __future__ import annotations

import pytest

from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError
from conftest import train_tokenizer

pytestmark = pytest.mark.unit

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. A function returns a value.",
    "accented": "Émile écrit «bonjour» — naïve café déjà vu, ñandú, Ærøskøbing.",
    "cjk": "東京 and 大阪 are cities. 漢字かな交じり文，中文标点。",
    "emoji": "🙂 done 🙂🙂 😀👍🏽 🇫🇷 👩‍💻 end",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(directory)
    return Tokenizer(directory)


def _byte_token_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet), so every multi-byte character is
    split across tokens."""
    # GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256 + n.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    ids = [tokenizer.token_to_id(chars[b]) for b in text.encode("utf-8")]
    assert None not in ids
    return ids


def _feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> tuple[list[bool], list[str]]:
    """Appends each token, taking a streaming delta after each; returns (append results, deltas)."""
    stops, deltas = [], []
    for token_id in token_ids:
        stops.append(detok.append(token_id))
        deltas.append(detok.take_delta(final=False))
    deltas.append(detok.take_delta(final=True))
    return stops, deltas


def test_tokenizer_round_trip_and_missing_file(tokenizer, tmp_path):
    for text in TEXTS.values():
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert 256 < tokenizer.vocab_size <= 512
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_incremental_text_equals_full_decode(tokenizer, kind):
    text = TEXTS[kind]
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    stops, deltas = _feed(detok, ids)
    assert not any(stops)
    assert detok.text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_multibyte_characters_split_across_byte_tokens(tokenizer, kind):
    text = TEXTS[kind]
    ids = _byte_token_ids(tokenizer, text)
    assert len(ids) == len(text.encode("utf-8"))
    detok = IncrementalDetokenizer(tokenizer)
    stops, deltas = _feed(detok, ids)
    assert not any(stops)
    assert detok.text == text
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_trained_tokenizer_really_splits_characters(tokenizer):
    """The natural encoding of the emoji and CJK text has tokens that are not valid UTF-8
    alone: the incremental path above is exercised with real splits, not just byte tokens."""
    ids = tokenizer.encode(TEXTS["emoji"] + TEXTS["cjk"])
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


def _completing_index(tokenizer: Tokenizer, ids: list[int], stop: str) -> int:
    return next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[: k + 1]))


@pytest.mark.parametrize(
    "kind,stop",
    [
        ("ascii", "brown fox"),
        ("ascii", "lazy dog."),
        ("accented", "naïve café"),
        ("cjk", "京 and 大"),
        ("emoji", "🙂🙂 😀"),
    ],
)
def test_stop_string_spanning_tokens_is_cut_at_the_completing_token(tokenizer, kind, stop):
    text = TEXTS[kind]
    for ids in (tokenizer.encode(text), _byte_token_ids(tokenizer, text)):
        k = _completing_index(tokenizer, ids, stop)
        assert stop not in tokenizer.decode(ids[k : k + 1]), "the stop string must span several tokens"
        detok = IncrementalDetokenizer(tokenizer, stop=[stop])
        stops, deltas = _feed(detok, ids)
        assert stops == [False] * k + [True] * (len(ids) - k)
        expected = text[: text.index(stop)]
        assert detok.text == expected
        assert "".join(deltas) == expected
        assert detok.stopped


def test_append_returns_true_exactly_when_stop_completes(tokenizer):
    text = TEXTS["ascii"]
    ids = tokenizer.encode(text)
    stop = "over the"
    k = _completing_index(tokenizer, ids, stop)
    detok = IncrementalDetokenizer(tokenizer, stop=[stop])
    for i, token_id in enumerate(ids[: k + 1]):
        assert detok.append(token_id) is (i == k)
    assert detok.text == "The quick brown fox jumps "


def test_earliest_of_several_stop_strings_wins(tokenizer):
    text = TEXTS["ascii"]
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=["lazy", "quick brown fox jumps over"])
    _feed(detok, ids)
    assert detok.text == "The "


def test_stop_string_inside_one_token_with_text_after_it(tokenizer):
    text = TEXTS["ascii"]
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, stop=["o"])  # 'o' is the middle of a longer token somewhere
    stops, deltas = _feed(detok, ids)
    assert detok.text == "The quick br"
    assert "".join(deltas) == "The quick br"
    assert stops.index(True) == _completing_index(tokenizer, ids, "o")


@pytest.mark.parametrize(
    "kind,stops",
    [
        ("ascii", ["lazy dog"]),
        ("ascii", ["jumps!", "over the lazy"]),  # "jumps" begins a stop that never completes
        ("ascii", ["The quick brown fox jumps over the lazy dog. A function returns a value.!"]),
        ("accented", ["café déjà", "écrit «x"]),
        ("cjk", ["大阪 are", "東京 or"]),
        ("emoji", ["😀👍🏽 🇫🇷", "🙂 don't"]),
    ],
)
def test_streamed_deltas_never_show_the_stop_string(tokenizer, kind, stops):
    text = TEXTS[kind]
    cuts = [text.find(s) for s in stops if s in text]
    expected = text[: min(cuts)] if cuts else text
    for ids in (tokenizer.encode(text), _byte_token_ids(tokenizer, text)):
        detok = IncrementalDetokenizer(tokenizer, stop=stops)
        streamed = ""
        for token_id in ids:
            detok.append(token_id)
            streamed += detok.take_delta(final=False)
            # Nothing streamed is ever taken back: what was sent is a prefix of the answer.
            assert expected.startswith(streamed)
            assert "\ufffd" not in streamed
            # No part of a stop string ever reaches the client while it is still being matched.
            for s in stops:
                assert s not in streamed
        streamed += detok.take_delta(final=True)
        assert streamed == detok.text == expected
        assert detok.take_delta(final=True) == ""


def test_hold_back_releases_a_false_start(tokenizer):
    """A partial stop string is held back, then released once it cannot complete."""
    ids = tokenizer.encode("ab ac ad")
    detok = IncrementalDetokenizer(tokenizer, stop=["a!"])
    streamed = ""
    for token_id in ids:
        detok.append(token_id)
        streamed += detok.take_delta(final=False)
        assert streamed == detok.text[: max(0, len(detok.text) - 1)]  # only the last character waits
    assert streamed + detok.take_delta(final=True) == "ab ac ad"


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_no_stop_strings_hold_nothing_back(tokenizer, kind):
    text = TEXTS[kind]
    for ids in (tokenizer.encode(text), _byte_token_ids(tokenizer, text)):
        detok = IncrementalDetokenizer(tokenizer)
        assert detok.hold_back == 0
        streamed = ""
        for token_id in ids:
            assert detok.append(token_id) is False
            streamed += detok.take_delta(final=False)
            assert streamed == detok.text  # every complete character is streamed at once
        assert detok.take_delta(final=True) == ""
        assert streamed == text


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.token_to_id("</s>")
    ids = tokenizer.encode("Hello world")
    detok = IncrementalDetokenizer(tokenizer)
    for token_id in ids[:2] + [eos] + ids[2:]:
        detok.append(token_id)
    assert detok.text == "Hello world"
