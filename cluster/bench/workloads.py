"""What a benchmark sends: sessions of one or more turns, each turn a prompt of token ids and an
output length.

A single request is a session of one turn. A multi-turn chat is a session whose turn ``k``
prompt is its shared system prompt, every earlier turn (the user's tokens and the answer the
server gave) and the new user tokens, sent ``think_s`` after the previous answer ended: so a
server with a prefix cache reuses the conversation's KV, and conversations that share a
system prompt share its blocks. The same sessions drive ``tandem bench`` against a real
cluster and ``tandem plan``'s simulator.

Sources:

- ``synthetic``: random token ids, input and output lengths drawn from distributions
  (:func:`parse_length`: ``128``, ``64-512`` uniform, ``normal:256,64``, ``exp:256``);
- ``chat``: shared-prefix multi-turn conversations (system prompts, turns, think time);
- ``mooncake``: a Mooncake trace (JSONL of ``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``), whose prompts are built so that equal hash ids give equal
  token blocks (:func:`mooncake_prompt`);
- ``sharegpt``: a ShareGPT-style JSON file (a list of ``{"conversations": [{"from": "human" |
  "gpt", "value": ...}]}``), tokenized with the caller's tokenizer.

Every error a user can cause is a ``WorkloadError`` of one line naming what to fix.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

from cluster.engine.request_limits import quote

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace format
FIRST_TOKEN_ID = 10  # random prompts avoid the lowest ids, where special tokens usually sit


class WorkloadError(ValueError):
    """A workload that cannot be built; the message names the flag, file or line."""


@dataclass(frozen=True)
class Turn:
    user: tuple[int, ...]  # the tokens this turn adds (a single-turn session's whole prompt)
    max_tokens: int


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    prefix: tuple[int, ...] = ()  # a shared system prompt, before the first turn
    think_s: float = 0.0  # between an answer's end and the next turn
    at_s: float | None = None  # a trace's own arrival time (seconds from its first record)
    slo_class: str | None = None

    def prompt(self, turn: int, history: Sequence[Sequence[int]]) -> list[int]:
        """Turn ``turn``'s prompt, given the answers (token ids) to the earlier turns."""
        tokens = list(self.prefix)
        for k in range(turn):
            tokens += self.turns[k].user
            tokens += history[k]
        return tokens + list(self.turns[turn].user)

    def request_id(self, turn: int) -> str:
        return self.session_id if len(self.turns) == 1 else f"{self.session_id}.t{turn}"


@dataclass(frozen=True)
class Workload:
    """Sessions plus how they were made (``describe``: the signature measurements and
    predictions are matched by)."""

    sessions: tuple[Session, ...]
    describe: str
    has_timestamps: bool = False
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


# -- lengths ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Length:
    """A distribution of token counts, always >= ``minimum``."""

    kind: str  # fixed, uniform, normal, exp
    a: float
    b: float = 0.0
    minimum: int = 1

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = rng.expovariate(1.0 / self.a)
        return max(self.minimum, int(round(value)))

    def __str__(self) -> str:
        return {"fixed": f"{self.a:g}", "uniform": f"{self.a:g}-{self.b:g}", "normal": f"normal:{self.a:g},{self.b:g}",
                "exp": f"exp:{self.a:g}"}[self.kind]


def parse_length(text: str, what: str = "length") -> Length:
    """``128`` (fixed), ``64-512`` (uniform, both ends included), ``normal:MEAN,STD`` or
    ``exp:MEAN``; WorkloadError naming ``what`` otherwise."""
    text = str(text).strip()
    usage = f"{what}: expected N, MIN-MAX, normal:MEAN,STD or exp:MEAN, got {quote(text)}"
    try:
        if text.startswith("normal:"):
            mean, std = (float(x) for x in text[7:].split(","))
            if mean < 1 or std < 0:
                raise WorkloadError(f"{what}: normal needs MEAN >= 1 and STD >= 0, got {quote(text)}")
            return Length("normal", mean, std)
        if text.startswith("exp:"):
            mean = float(text[4:])
            if mean < 1:
                raise WorkloadError(f"{what}: exp needs MEAN >= 1, got {quote(text)}")
            return Length("exp", mean)
        if "-" in text:
            low, high = (int(x) for x in text.split("-"))
            if not 1 <= low <= high:
                raise WorkloadError(f"{what}: needs 1 <= MIN <= MAX, got {quote(text)}")
            return Length("uniform", low, high)
        value = int(text)
    except WorkloadError:
        raise
    except ValueError:
        raise WorkloadError(usage) from None
    if value < 1:
        raise WorkloadError(f"{what}: must be at least 1, got {quote(text)}")
    return Length("fixed", value)


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n))


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= FIRST_TOKEN_ID + 1:
        raise WorkloadError(f"vocab_size must be above {FIRST_TOKEN_ID + 1}, got {vocab_size}")


# -- synthetic -------------------------------------------------------------------------------


def synthetic(count: int, input_len: Length, output_len: Length, vocab_size: int, seed: int = 0,
              slo_class: str | None = None) -> Workload:
    """``count`` independent requests of random tokens."""
    _check_vocab(vocab_size)
    rng = random.Random(seed)
    sessions = []
    for i in range(count):
        n, out = input_len.draw(rng), output_len.draw(rng)
        sessions.append(Session(f"s{i}", (Turn(_random_tokens(rng, n, vocab_size), out),), slo_class=slo_class))
    return Workload(tuple(sessions), f"synthetic input={input_len} output={output_len} seed={seed}")


# -- shared-prefix multi-turn chat -----------------------------------------------------------


def chat(conversations: int, turns: Length, system_prompts: int, system_len: Length, user_len: Length,
         output_len: Length, think_s: float, vocab_size: int, seed: int = 0,
         slo_class: str | None = None) -> Workload:
    """``conversations`` multi-turn chats; each opens with one of ``system_prompts`` shared
    system prompts (chosen at random), then ``turns`` turns of ``user_len`` new tokens."""
    _check_vocab(vocab_size)
    if system_prompts < 1:
        raise WorkloadError(f"system prompts: must be at least 1, got {system_prompts}")
    if think_s < 0:
        raise WorkloadError(f"think time: must be >= 0 seconds, got {think_s}")
    rng = random.Random(seed)
    systems = [_random_tokens(rng, system_len.draw(rng), vocab_size) for _ in range(system_prompts)]
    sessions = []
    for i in range(conversations):
        system = systems[rng.randrange(system_prompts)]
        n_turns = turns.draw(rng)
        chat_turns = tuple(Turn(_random_tokens(rng, user_len.draw(rng), vocab_size), output_len.draw(rng))
                           for _ in range(n_turns))
        sessions.append(Session(f"c{i}", chat_turns, prefix=system, think_s=think_s, slo_class=slo_class))
    return Workload(tuple(sessions), f"chat turns={turns} systems={system_prompts}x{system_len} user={user_len} "
                                     f"output={output_len} think={think_s:g}s seed={seed}")


# -- Mooncake traces -------------------------------------------------------------------------


def hash_block_tokens(hash_id: int, block_tokens: int, vocab_size: int, seed: int = 0) -> tuple[int, ...]:
    """The token block of one trace hash id: the same id always gives the same tokens."""
    rng = random.Random(f"mooncake:{seed}:{hash_id}")
    return _random_tokens(rng, block_tokens, vocab_size)


def mooncake_prompt(input_length: int, hash_ids: Sequence[int], vocab_size: int, block_tokens: int = 512,
                    seed: int = 0, unique: str = "") -> tuple[int, ...]:
    """A prompt of ``input_length`` tokens: the blocks of its hash ids in order (equal ids,
    equal blocks, so prompts sharing leading hash ids share a prefix), cut to the length; past
    the last hash id, tokens unique to the request (seeded by ``unique``)."""
    tokens: list[int] = []
    for hash_id in hash_ids:
        if len(tokens) >= input_length:
            break
        tokens += hash_block_tokens(hash_id, block_tokens, vocab_size, seed)
    if len(tokens) < input_length:
        rng = random.Random(f"mooncake-tail:{seed}:{unique}")
        tokens += _random_tokens(rng, input_length - len(tokens), vocab_size)
    return tuple(tokens[:input_length])


def read_mooncake(path: str | Path, vocab_size: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0,
                  limit: int | None = None, max_input: int | None = None, max_output: int | None = None,
                  slo_class: str | None = None) -> Workload:
    """A Mooncake trace as single-turn sessions at the trace's times. ``block_tokens`` below 512
    scales every length down by ``block_tokens / 512`` (a trace made for large models replayed
    on a small one keeps its sharing structure); ``max_input``/``max_output`` cap the lengths."""
    _check_vocab(vocab_size)
    scale = block_tokens / MOONCAKE_BLOCK_TOKENS
    sessions, first = [], None
    for number, record in _jsonl(path, limit):
        where = f"{path}:{number}"
        try:
            timestamp = float(record["timestamp"])
            input_length = int(record["input_length"])
            output_length = int(record["output_length"])
            hash_ids = [int(h) for h in record.get("hash_ids", [])]
        except KeyError as exc:
            raise WorkloadError(f"{where}: a Mooncake record needs {exc.args[0]!r}") from None
        except (TypeError, ValueError):
            raise WorkloadError(f"{where}: timestamp, input_length, output_length must be numbers and hash_ids a "
                                f"list of integers") from None
        if input_length < 1 or output_length < 1:
            raise WorkloadError(f"{where}: input_length and output_length must be at least 1")
        first = timestamp if first is None else first
        n = max(1, round(input_length * scale))
        out = max(1, round(output_length * scale))
        n, out = min(n, max_input or n), min(out, max_output or out)
        prompt = mooncake_prompt(n, hash_ids, vocab_size, block_tokens, seed, unique=str(number))
        sessions.append(Session(f"m{number}", (Turn(prompt, out),), at_s=(timestamp - first) / 1000.0,
                                slo_class=slo_class))
    if not sessions:
        raise WorkloadError(f"{path}: no records")
    return Workload(tuple(sessions), f"mooncake {Path(path).name} block={block_tokens} seed={seed}", has_timestamps=True)


def _jsonl(path: str | Path, limit: int | None) -> Iterable[tuple[int, dict]]:
    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from None
    with handle:
        count = 0
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if limit is not None and count >= limit:
                return
            try:
                record = json.loads(line)
            except ValueError:
                raise WorkloadError(f"{path}:{number}: not valid JSON") from None
            if not isinstance(record, dict):
                raise WorkloadError(f"{path}:{number}: each line must be a JSON object")
            count += 1
            yield number, record


# -- ShareGPT --------------------------------------------------------------------------------


def read_sharegpt(path: str | Path, tokenize: Callable[[str], list[int]], limit: int | None = None,
                  max_input: int | None = None, max_output: int | None = None, multi_turn: bool = False,
                  seed: int = 0, slo_class: str | None = None) -> Workload:
    """A ShareGPT-style file: each conversation's human turns are prompts, the length of the
    gpt answer that follows is the output length. One turn per conversation (the first)
    unless ``multi_turn``. Conversations are shuffled with ``seed``."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkloadError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError:
        raise WorkloadError(f"{path}: not valid JSON") from None
    if not isinstance(data, list):
        raise WorkloadError(f"{path}: expected a JSON list of conversations")
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    sessions = []
    for index in order:
        if limit is not None and len(sessions) >= limit:
            break
        entry = data[index]
        messages = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(messages, list):
            raise WorkloadError(f"{path}: conversation {index} has no 'conversations' list")
        turns = []
        for i in range(len(messages) - 1):
            ask, answer = messages[i], messages[i + 1]
            if not (isinstance(ask, dict) and isinstance(answer, dict)):
                continue
            if ask.get("from") in ("human", "user") and answer.get("from") in ("gpt", "assistant"):
                prompt = tuple(tokenize(str(ask.get("value", ""))))
                out = len(tokenize(str(answer.get("value", ""))))
                if not prompt or out < 1:
                    continue
                if max_input:
                    prompt = prompt[:max_input]
                turns.append(Turn(prompt, min(out, max_output or out)))
                if not multi_turn:
                    break
        if turns:
            sessions.append(Session(f"g{index}", tuple(turns), slo_class=slo_class))
    if not sessions:
        raise WorkloadError(f"{path}: no conversation with a human turn followed by a gpt answer")
    return Workload(tuple(sessions), f"sharegpt {Path(path).name} multi_turn={multi_turn} seed={seed}")


def cap(workload: Workload, max_requests: int | None) -> Workload:
    """The workload's first sessions holding at most ``max_requests`` requests (turns)."""
    if max_requests is None:
        return workload
    kept, total = [], 0
    for session in workload.sessions:
        if total >= max_requests:
            break
        if total + len(session.turns) > max_requests:
            session = Session(session.session_id, session.turns[:max_requests - total], session.prefix,
                              session.think_s, session.at_s, session.slo_class)
        kept.append(session)
        total += len(session.turns)
    return Workload(tuple(kept), workload.describe, workload.has_timestamps, workload.meta)
