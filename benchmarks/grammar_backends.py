"""The two grammar libraries Tandem could build constrained decoding on, llguidance (chosen:
``cluster/engine/structured/backend.py``) and xgrammar, side by side on the default model's
tokenizer (SmolLM2, 49,152 tokens), one thread each:

- per-token mask time along a 90-token document of a nested JSON schema (objects three deep, an
  enum, arrays of strings and of objects), mean / p50 / p99 / max over ``--passes`` passes;
- schema compile time, cold (a new schema each time: one property renamed), p50 / p99;
- a compiled grammar to a fresh matcher (the cache hit: what a request pays when its schema was
  seen before);
- the tokenizer's set-up (once per engine).

Both generate compact JSON (``,`` and ``:`` with no whitespace) so that they walk the same
tokens. xgrammar is not a Tandem dependency: ``pip install xgrammar`` (it brings ``transformers``).

    .venv/bin/python benchmarks/grammar_backends.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from common import machine_rows, percentile, print_table

DOCUMENT = {"name0": "Ada Lovelace", "age": 36, "status": "active",
            "address": {"street": "12 St James Square", "city": "London", "geo": {"lat": 51.5, "lon": -0.13}},
            "tags": ["math", "poet"], "friends": [{"name": "Charles", "since": 1833}, {"name": "Mary", "since": 1834}]}


def schema(index: int) -> str:
    return json.dumps({"type": "object", "properties": {
        f"name{index}": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "banned"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"]}},
            "required": ["street", "city", "geo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
        "friends": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "since": {"type": "integer"}}, "required": ["name", "since"]}}},
        "required": [f"name{index}", "age", "status", "address", "tags", "friends"],
        "additionalProperties": False})


def timed(call, count: int) -> list[float]:
    times = []
    for index in range(count):
        started = time.perf_counter()
        call(index)
        times.append(time.perf_counter() - started)
    return times


def llguidance_rows(tokenizer_json: str, vocab: int, eos: int, tokens: list[int], args) -> dict:
    import llguidance.torch as ll_torch
    from llguidance import LLMatcher, LLTokenizer

    started = time.perf_counter()
    tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - started
    compact = {"whitespace_flexible": False}

    def compile_(index: int) -> LLMatcher:
        matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_json_schema(schema(index), defaults=compact), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    cold = timed(compile_, args.compiles)
    pristine = compile_(0)
    cached = timed(lambda _: pristine.deep_copy(), 10 * args.compiles)
    bitmask = ll_torch.allocate_token_bitmask(1, vocab)
    masks = []
    for _ in range(args.passes):
        matcher = pristine.deep_copy()
        for token in tokens:
            started = time.perf_counter()
            ll_torch.fill_next_token_bitmask(matcher, bitmask, 0)
            masks.append(time.perf_counter() - started)
            assert matcher.consume_token(token), matcher.get_error()
    return {"setup": setup, "cold": cold, "cached": cached, "masks": masks}


def xgrammar_rows(hf_tokenizer, vocab: int, eos: int, tokens: list[int], args) -> dict:
    import transformers
    import xgrammar

    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer)
    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=[eos])
    setup = time.perf_counter() - started
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile_(index: int):
        return compiler.compile_json_schema(schema(index), any_whitespace=False, separators=(",", ":"))

    cold = timed(compile_, args.compiles)
    compiled = compile_(0)
    cached = timed(lambda _: xgrammar.GrammarMatcher(compile_(0)), 10 * args.compiles)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    masks = []
    for _ in range(args.passes):
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            masks.append(time.perf_counter() - started)
            assert matcher.accept_token(token)
    return {"setup": setup, "cold": cold, "cached": cached, "masks": masks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiles", type=int, default=30, help="cold compiles (and 10x as many cached)")
    parser.add_argument("--passes", type=int, default=5, help="passes along the document")
    args = parser.parse_args()
    from cluster.default_model import default_model_path
    from cluster.engine.models.read_config import load_model_config
    from cluster.engine.tokenizer import Tokenizer

    model = default_model_path()
    config = load_model_config(model)
    tokenizer = Tokenizer(model)
    eos = min(config.eos_token_ids)
    tokens = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    results = {"llguidance": llguidance_rows(tokenizer.to_json(), config.vocab_size, eos, tokens, args)}
    try:
        results["xgrammar"] = xgrammar_rows(tokenizer._tok, config.vocab_size, eos, tokens, args)
    except ImportError:
        print("[bench] xgrammar is not installed (pip install xgrammar): its column is left out", file=sys.stderr)

    def us(values, q=None) -> str:
        return f"{(statistics.mean(values) if q is None else percentile(values, q)) * 1e6:,.1f}"

    rows = []
    for name, r in results.items():
        rows.append((name, f"{us(r['masks'])} / {us(r['masks'], 0.5)} / {us(r['masks'], 0.99)} / "
                           f"{max(r['masks']) * 1e6:,.0f}",
                     f"{percentile(r['cold'], 0.5) * 1e3:.2f} / {percentile(r['cold'], 0.99) * 1e3:.2f}",
                     us(r["cached"], 0.5), f"{r['setup']:.2f}"))
    print_table("machine", machine_rows() + [("tokenizer", f"{model.name}: {config.vocab_size} tokens"),
                                             ("document", f"{len(tokens)} tokens, {args.passes} passes")])
    print_table("per library", rows, ("", "mask us: mean / p50 / p99 / max", "cold compile ms: p50 / p99",
                                      "cached to a matcher us (p50)", "tokenizer set-up s"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
