"""Constrained decoding through the engine, on a tiny random checkpoint.

Greedy constrained output equals ``transformers``' greedy output under the same grammar's masks
(applied here by llguidance directly, token by token); sampled output parses and validates;
free and constrained requests share a batch without changing each other's tokens; with n-gram
speculation the guesses are cut to what the grammar accepts and the greedy output is the output
without speculation; a structural tag leaves text free until its trigger; logprobs stay those
of the model's raw distribution; a spec that does not compile is refused when added.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from llguidance import LLMatcher, LLTokenizer

from cluster.engine.request_limits import InvalidRequestError
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.speculative.config import SpeculativeConfig
from cluster.engine.structured.grammars import check
from cluster.engine.structured.matcher import Matcher
from cluster.engine.structured.spec import StructuredOutput
from cluster.engine.tokenizer import Tokenizer
from cluster.offline.llm import LLM
from conftest import random_prompts
from reference_checks import assert_equivalent

pytestmark = pytest.mark.integration

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["fox", "dog", "cat"]},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "city": {"type": "string", "maxLength": 5}},
                  "required": ["age", "city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "owner", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
REGEX = StructuredOutput("regex", r"(fox|dog) [0-9]{1,3}", source="regex")
CHOICE = StructuredOutput("choice", json.dumps(["yes", "no", "maybe"]), source="choice")
GBNF = StructuredOutput("grammar", 'root ::= "(" [a-c]+ ")"', syntax="ebnf", source="grammar")
MAX_TOKENS = 96  # room for the longest output SCHEMA allows


def llm(model_dir, **engine_args) -> LLM:
    return LLM(str(model_dir), verbose=False, num_kv_blocks=64, **engine_args)


def greedy(spec: StructuredOutput | None, **params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=spec, **params)


def reference_constrained(model, tokenizer: Tokenizer, spec: StructuredOutput, prompt: list[int], eos: int):
    """``transformers``' greedy tokens with llguidance's mask of ``spec`` applied to each step's
    logits, until the grammar ends or EOS; and the masked logits (ties are told apart there)."""
    matcher = LLMatcher(LLTokenizer(tokenizer.to_json(), n_vocab=model.config.vocab_size, eos_token=eos),
                        check(spec), log_level=0)
    tokens, scores, inputs, past = [], [], torch.tensor([prompt]), None
    with torch.no_grad():
        while len(tokens) < MAX_TOKENS:
            out = model(input_ids=inputs, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
            logits = logits.masked_fill(allowed[: logits.shape[0]] == 0, float("-inf"))
            token = int(logits.argmax())
            tokens.append(token)
            scores.append(logits)
            assert matcher.consume_token(token)
            if token == eos or matcher.is_stopped():
                break
            inputs = torch.tensor([[token]])
    return tokens, torch.stack(scores)


def test_constrained_greedy_equals_transformers_greedy_under_the_same_masks(checkpoint, reference_model):
    model_dir = checkpoint("llama")
    prompts = random_prompts([5, 17, 40, 9], seed=2)
    specs = [JSON, REGEX, CHOICE, GBNF]
    with llm(model_dir) as engine:
        outputs = engine.generate(prompts, [greedy(spec) for spec in specs])
        eos = min(engine.engine.eos_token_ids)
        tokenizer = engine.engine.tokenizer
        assert engine.engine.block_manager.num_free_blocks == 64
    reference = reference_model(model_dir)
    for prompt, spec, output in zip(prompts, specs, outputs):
        wanted, scores = reference_constrained(reference, tokenizer, spec, prompt, eos)
        assert_equivalent(output.token_ids, wanted, scores, torch.float32, spec.kind)
        assert output.finish_reason == "stop" and output.error is None
    document, matched, chosen, grammar = (o.text for o in outputs)
    jsonschema.validate(json.loads(document), SCHEMA)
    assert re.fullmatch(r"(fox|dog) [0-9]{1,3}", matched)
    assert chosen in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([a-c]+\)", grammar)


def test_sampled_outputs_parse_and_validate(checkpoint):
    with llm(checkpoint("llama")) as engine:
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured=JSON)
                  for seed in range(8)]
        outputs = engine.generate(random_prompts([6] * 8, seed=5), params)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        jsonschema.validate(json.loads(output.text), SCHEMA)
    assert len({o.text for o in outputs}) > 1  # sampled, not all alike


def test_free_and_constrained_requests_share_a_batch_without_changing_each_others_tokens(checkpoint):
    prompts = random_prompts([12, 30, 7, 21], seed=8)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled_free = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    mixed = [free, greedy(JSON), sampled_free, greedy(REGEX)]
    with llm(checkpoint("llama")) as engine:
        together = engine.generate(prompts, mixed)
        assert engine.engine.stats.num_steps < sum(len(o.token_ids) for o in together)  # they shared steps
        alone = [engine.generate([prompt], params)[0] for prompt, params in zip(prompts, mixed)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in together] == ["length", "stop", "length", "stop"]


def test_with_speculation_guesses_are_cut_by_the_grammar_and_greedy_output_is_unchanged(checkpoint, monkeypatch):
    """Prompts that repeat themselves: the n-gram proposer guesses from them, the grammar cuts
    each guess where it refuses a token, the kept guesses save steps, and the tokens are those
    without speculation."""
    model_dir = checkpoint("llama")
    prompts = [p + p for p in random_prompts([10, 16, 25], seed=4)]
    spec = StructuredOutput("regex", "[a-z ]{1,40}\\.", source="regex")
    params = [greedy(spec), greedy(JSON), greedy(spec)]
    with llm(model_dir) as plain:
        expected = plain.generate(prompts, params)
    cuts = []
    valid_prefix = Matcher.valid_prefix
    monkeypatch.setattr(Matcher, "valid_prefix", lambda self, tokens: cuts.append(
        (len(tokens), valid_prefix(self, tokens))) or cuts[-1][1])
    with llm(model_dir, speculative=SpeculativeConfig(num_tokens=4, adaptive=False)) as engine:
        outputs = engine.generate(prompts, params)
        stats = engine.engine.stats
        assert stats.proposed_tokens > 0 and stats.accepted_tokens > 0, "no guess was kept: nothing was tested"
        assert engine.engine.block_manager.num_free_blocks == 64
    assert any(kept < proposed for proposed, kept in cuts), "no guess was cut by the grammar"
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in expected]


def test_a_structural_tag_leaves_text_free_until_its_trigger_opens_a_constrained_part(checkpoint):
    """Trigger ``e`` (frequent in the tokenizer's text): after each ``e`` comes ``=`` and a JSON
    value of the schema, then ``;``; the text around is free."""
    tag = {"triggers": ["e"], "structures": [{"begin": "e=", "schema": {"enum": [1, 22]}, "end": ";"}]}
    spec = StructuredOutput("structural_tag", json.dumps(tag), source="tools")
    with llm(checkpoint("llama")) as engine:
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, ignore_eos=True, structured=spec)
                  for seed in range(4)]
        outputs = engine.generate(random_prompts([8] * 4, seed=9), params)
    texts = [o.text for o in outputs]
    assert sum(t.count("e=") for t in texts) >= 2, texts  # the trigger came, and so did the constrained parts
    for text in texts:
        head, _, tail = text.rpartition(";")  # what follows the last part may be an unfinished one
        assert re.fullmatch(r"([^e]*e=(1|22);)*[^e]*", head + ";" if head else ""), text
        assert re.fullmatch(r"[^e]*(e(=(2?2?|1))?)?", tail), text


def test_logprobs_stay_those_of_the_raw_distribution(checkpoint, reference_model):
    model_dir = checkpoint("llama")
    prompt = random_prompts([11], seed=6)[0]
    with llm(model_dir) as engine:
        output = engine.generate([prompt], greedy(CHOICE, logprobs=2))[0]
    with torch.no_grad():
        logits = reference_model(model_dir)(torch.tensor([prompt + output.token_ids])).logits[0].float()
    raw = logits[len(prompt) - 1: -1].log_softmax(dim=-1)
    assert output.logprobs == pytest.approx([raw[i, t].item() for i, t in enumerate(output.token_ids)], abs=1e-4)
    assert [[t for t, _ in top] for top in output.top_logprobs] == raw.topk(2).indices.tolist()


def test_a_spec_that_does_not_compile_is_refused_when_added(checkpoint):
    with llm(checkpoint("llama")) as engine:
        bad = StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}')
        with pytest.raises(InvalidRequestError, match="^response_format: the JSON schema is not valid: "
                                                      "Invalid type: strin$"):
            engine.engine.add_request("bad", [5, 6, 7], greedy(bad))
        with pytest.raises(InvalidRequestError, match="^regex: the regex is not valid: "):
            engine.engine.add_request("bad", [5, 6, 7], greedy(StructuredOutput("regex", "(", source="regex")))
        assert not engine.engine.has_unfinished_requests()
        assert engine.generate([[5, 6, 7]], greedy(CHOICE))[0].finish_reason == "stop"
