"""Constrained decoding's parts alone, on a 12-token byte-level tokenizer whose masks can be
written out: a spec's grammar (checked without a tokenizer, errors naming the field), the
backend's compiled-grammar cache, a request's matcher, a step's masks (a verify's rows each at
its own position) and their application to logits in the sampler."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.engine.request import Request
from cluster.engine.request_limits import InvalidRequestError
from cluster.engine.sampler import Sampler, SamplingBatch
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured.backend import GrammarBackend
from cluster.engine.structured.bitmask import apply_token_masks
from cluster.engine.structured.grammars import check
from cluster.engine.structured.masks import StepMasks
from cluster.engine.structured.spec import StructuredOutput

pytestmark = pytest.mark.unit

EOS, A, B, C, AB, OPEN, CLOSE, QUOTE, COLON, SPACE, ONE, COMMA = range(12)
VOCAB = {"<eos>": EOS, "a": A, "b": B, "c": C, "ab": AB, "{": OPEN, "}": CLOSE, '"': QUOTE, ":": COLON, "Ġ": SPACE,
         "1": ONE, ",": COMMA}


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=VOCAB, merges=[("a", "b")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return GrammarBackend(tokenizer.to_str(), len(VOCAB), [EOS], cache_size=2)


def regex(pattern: str) -> StructuredOutput:
    return StructuredOutput("regex", pattern, source="regex")


def constrained(backend, spec: StructuredOutput | None, guesses=()) -> Request:
    request = Request("r", [A], SamplingParams(structured=spec))
    if spec is not None:
        request.grammar = backend.matcher(spec)
    request.spec_token_ids = list(guesses)
    return request


def allowed(bitmask: torch.Tensor) -> list[list[int]]:
    return [[t for t in range(len(VOCAB)) if (int(row[t // 32]) >> (t % 32)) & 1] for row in bitmask]


# -- a spec's grammar, checked without a tokenizer ------------------------------------------------

@pytest.mark.parametrize("spec", [
    StructuredOutput("json_object"),
    StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"enum": [1, 2]}}}'),
    StructuredOutput("regex", "[a-c]+"),
    StructuredOutput("grammar", 'root ::= "yes" | "no"', syntax="ebnf"),
    StructuredOutput("grammar", 'start: "a"+ "b"', syntax="lark"),
    StructuredOutput("choice", json.dumps(["café", 'say "hi"', "東京"])),
    StructuredOutput("structural_tag", json.dumps({"triggers": ["<tool_call>"], "structures": [
        {"begin": "<tool_call>{", "schema": {"type": "object"}, "end": "}</tool_call>"}]})),
])
def test_every_kind_compiles_without_a_tokenizer(spec):
    assert isinstance(check(spec), str)


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput("json_schema", '{"type": "strin"}'),
     "response_format: the JSON schema is not valid: Invalid type: strin"),
    (StructuredOutput("json_schema", '{"type": "object", "if": {}}', source="tools"),
     'tools: the JSON schema is not valid: Unimplemented keys: ["if"]'),
    (StructuredOutput("json_schema", '{"type": '), "response_format: the JSON schema is not valid: the schema is not "
                                                   "valid JSON (Expecting value: line 1 column 10 (char 9))"),
    (StructuredOutput("json_schema", "[1]"), "response_format: the JSON schema is not valid: the schema must be a "
                                             "JSON object"),
    (regex("a(b"), 'regex: the regex is not valid: at 1(8): invalid regex "a(b" (in regex): regex parse error: a(b ^ '
                   "error: unclosed group 1 | start: /a(b/ ^"),
    (StructuredOutput("grammar", "root := x", syntax="ebnf", source="grammar"),
     "grammar: the grammar is not valid: Expected ::= at line 1, 'root ' ^ ':= x'"),
    (StructuredOutput("grammar", 'start: "a" | b', syntax="lark", source="grammar"),
     'grammar: the grammar is not valid: at 1(8): unknown name: "b" 1 | start: "a" | b ^'),
    (StructuredOutput("choice", '["a", ""]', source="choice"),
     "choice: the choice is not valid: the choice must be a non-empty list of non-empty strings"),
    (StructuredOutput("structural_tag", '{"triggers": ["<a>"], "structures": [{"begin": "<b>", "schema": {}, '
                                        '"end": ""}]}', source="tools"),
     "tools: the structural tag is not valid: structures[0].begin must start with one of the triggers"),
    (StructuredOutput("structural_tag", '{"triggers": ["<a>"]}', source="tools"),
     'tools: the structural tag is not valid: the structural tag must have exactly the keys "triggers" and '
     '"structures"'),
])
def test_a_spec_that_does_not_compile_is_refused_naming_its_field_and_the_reason(spec, message):
    with pytest.raises(InvalidRequestError) as caught:
        check(spec)
    assert str(caught.value) == message


def test_the_reason_is_clipped_to_one_short_line():
    pattern = "(" * 5000
    with pytest.raises(InvalidRequestError) as caught:
        check(regex(pattern))
    text = str(caught.value)
    assert "\n" not in text and len(text) < 400 and text.startswith("regex: the regex is not valid: ")


def test_json_has_the_separators_json_dumps_writes_and_no_other_whitespace(backend):
    matcher = backend.matcher(StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": '
                                                              '"integer"}}, "required": ["a"]}'))
    written = [OPEN, QUOTE, A, QUOTE, COLON, SPACE, ONE, CLOSE]  # {"a": 1}
    assert matcher.valid_prefix(written) == len(written)
    assert matcher.valid_prefix([OPEN, SPACE]) == 1
    assert matcher.valid_prefix([OPEN, QUOTE, A, QUOTE, COLON, ONE]) == 5  # no space after the colon: refused


# -- the backend and a request's matcher ----------------------------------------------------------

def test_compiled_grammars_are_cached_by_spec_in_a_bounded_lru(backend):
    first, second, third = regex("a+"), regex("b+"), regex("c+")
    backend.matcher(first)
    backend.matcher(second)
    backend.matcher(StructuredOutput("regex", "a+", source="another field"))  # same grammar: a hit, moved to the end
    backend.matcher(third)  # over the bound of 2: the least recently used (b+) goes
    assert list(backend._compiled) == [("regex", "a+", ""), ("regex", "c+", "")]


def test_each_request_gets_a_matcher_of_its_own(backend):
    spec = StructuredOutput("choice", '["ab", "c"]')
    one, other = backend.matcher(spec), backend.matcher(spec)
    assert one.accept(AB) and one.ended
    assert not other.ended and other.valid_prefix([C, EOS]) == 2


def test_the_grammar_ends_when_nothing_but_the_end_of_sequence_may_follow(backend):
    matcher = backend.matcher(regex("ab?"))
    assert matcher.accept(A) and not matcher.ended  # "a" may end it, or a "b" follow
    assert matcher.accept(B) and matcher.ended


def test_a_refused_token_leaves_the_matcher_in_error(backend):
    matcher = backend.matcher(regex("a"))
    assert not matcher.accept(C)
    assert not matcher.ended and "doesn't satisfy the grammar" in matcher.error


def test_replay_advances_past_tokens_emitted_elsewhere(backend):
    matcher = backend.matcher(regex("abc"))
    assert matcher.replay([A, B]) and matcher.valid_prefix([C, EOS]) == 2
    assert not backend.matcher(regex("abc")).replay([C])


# -- a step's masks -------------------------------------------------------------------------------

def test_a_steps_masks_are_those_of_each_constrained_row_and_skip_free_rows(backend):
    masks = StepMasks(len(VOCAB))
    try:
        free = constrained(backend, None)
        first = constrained(backend, regex("a(b|c)*"))
        second = constrained(backend, regex("(ab|c)"))
        second.grammar.accept(C)  # complete: only the end of sequence may follow
        result = masks.start([free, first, second]).result()
    finally:
        masks.close()
    assert result.rows.tolist() == [1, 2] and result.num_rows == 3
    assert allowed(result.bitmask) == [[A, AB], [EOS]]


def test_a_verify_row_is_masked_at_its_own_position_and_the_matcher_is_left_where_it_was(backend):
    masks = StepMasks(len(VOCAB))
    try:
        verify = constrained(backend, regex("a(b|c)*"), guesses=[A, B])
        decode = constrained(backend, regex("c"))
        rows = [verify, verify, verify, decode]
        result = masks.start(rows).result()
        assert masks.start([constrained(backend, None)]) is None  # nothing constrained: nothing to do
    finally:
        masks.close()
    assert result.rows.tolist() == [0, 1, 2, 3]
    assert allowed(result.bitmask) == [[A, AB], [EOS, B, C], [EOS, B, C], [C]]
    assert verify.grammar.valid_prefix([AB, C]) == 2  # still at its start


def test_the_masks_of_a_verify_cut_short_by_the_budget_cover_only_its_rows(backend):
    masks = StepMasks(len(VOCAB))
    try:
        verify = constrained(backend, regex("a(b|c)*"), guesses=[A, B])  # the scheduler left room for one guess
        result = masks.start([verify, verify]).result()
    finally:
        masks.close()
    assert allowed(result.bitmask) == [[A, AB], [EOS, B, C]]


def test_where_the_grammar_forces_text_the_mask_allows_only_its_canonical_tokens(backend):
    """llguidance's rule: forced bytes ("abc") are masked to the tokens the tokenizer would write
    them with, though the grammar accepts other spellings (a guess of one is checked, never kept)."""
    matcher = backend.matcher(regex("abc"))
    masks = StepMasks(len(VOCAB))
    try:
        result = masks.start([constrained(backend, regex("abc"))]).result()
    finally:
        masks.close()
    assert allowed(result.bitmask) == [[AB]]
    assert matcher.valid_prefix([A, B, C]) == 3 and matcher.valid_prefix([AB, C, EOS]) == 3


# -- masks on logits --------------------------------------------------------------------------------

def pack(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """Token lists as llguidance's packed words (bit t % 32 of word t // 32)."""
    words = torch.zeros(len(rows), -(-vocab // 32), dtype=torch.int64)
    for i, tokens in enumerate(rows):
        for t in tokens:
            words[i, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_a_mask_puts_every_refused_token_of_its_row_at_minus_infinity():
    vocab = 70  # three words, the last partly used
    logits = torch.arange(3 * vocab, dtype=torch.float32).view(3, vocab)
    keep = [[0, 31, 32, 63, 69], [5]]
    masked = apply_token_masks(logits, pack(keep, vocab), torch.tensor([0, 2]))
    expected = logits.clone()
    for row, tokens in zip((0, 2), keep):
        refused = [t for t in range(vocab) if t not in tokens]
        expected[row, refused] = float("-inf")
    assert torch.equal(masked, expected)
    assert torch.equal(apply_token_masks(logits[[0, 2]], pack(keep, vocab), None), expected[[0, 2]])
    assert logits[0, 1] == 1  # the input is left as it was


def test_the_sampler_draws_only_allowed_tokens_and_reports_raw_logprobs():
    vocab = 40
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0, logprobs=1),
              SamplingParams(temperature=1.0, seed=1, logprobs=1)]
    keep = [[3, 7], [39]]  # rows 0 and 2 constrained; row 1 free
    batch = SamplingBatch.build(params, [()] * 3, [()] * 3, [None, None, torch.Generator().manual_seed(1)], vocab,
                                token_bitmask=pack(keep, vocab), masked_rows=torch.tensor([0, 2]))
    out = Sampler()(logits, batch)
    assert out.token_ids[0] == max(keep[0], key=lambda t: logits[0, t])
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.token_ids[2] == 39
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs == pytest.approx([raw[r, t].item() for r, t in enumerate(out.token_ids)], abs=1e-6)
    assert out.top_logprobs[0][0][0] == int(raw[0].argmax())  # the raw distribution's best, masked or not


def test_masks_built_ahead_serve_the_next_step_while_they_still_fit(backend):
    """Built as the step before ended; the next step keeps a prefix of a request's guesses, and a
    request whose matcher moved since, or that was not running then, gets its masks built anew."""
    masks = StepMasks(len(VOCAB))
    try:
        verify = constrained(backend, regex("a(b|c)*"), guesses=[A, B])
        moved = constrained(backend, regex("c(a|b)"))
        masks.build_ahead([verify, moved])
        moved.grammar.accept(C)  # as a prefill worker's first token would be, after the masks were built
        moved.token_ids.append(C)
        verify.spec_token_ids = [A]  # the budget left room for one guess
        joined = constrained(backend, regex("b"))
        result = masks.start([verify, verify, moved, joined]).result()
    finally:
        masks.close()
    assert result.rows.tolist() == [0, 1, 2, 3]
    assert allowed(result.bitmask) == [[A, AB], [EOS, B, C], [A, B], [B]]


def test_masks_all_built_ahead_are_ready_at_the_start_of_the_step(backend):
    masks = StepMasks(len(VOCAB))
    try:
        decode = constrained(backend, regex("a(b|c)*"))
        masks.build_ahead([decode, constrained(backend, None)])
        masks._ahead.result()  # the thread is done with it (as it is by the time the next step starts)
        started = masks.start([decode])
        assert started.done()  # assembled on the spot
        assert allowed(started.result().bitmask) == [[A, AB]]
        assert masks.start([constrained(backend, None)]) is None
    finally:
        masks.close()


def test_a_step_without_constrained_rows_still_waits_for_the_masks_built_ahead(backend):
    """Their matchers are read on the thread: the step may not use them until it is done."""
    masks = StepMasks(len(VOCAB))
    try:
        waiting = constrained(backend, regex("a(b|c)*"))  # running, but not sampled this step
        masks.build_ahead([waiting])
        started = masks.start([constrained(backend, None)])
        assert started.result() is None and waiting.grammar.valid_prefix([A, B]) == 2
    finally:
        masks.close()
