"""What constrained decoding costs: a JSON-schema request against the same request without a
schema, through the cluster's OpenAI API on the default model, side by side in one run; and what
compiling a schema costs.

The quick-start cluster (``tandem up --detach`` of the embedded default topology: 1 prefill + 1
decode worker, the default model SmolLM2-135M-Instruct Q4_1) in a private cache folder serves
streamed ``/v1/completions`` requests, greedy, ``--max-tokens`` out, on a few prompts asking for a
record of a book (cycled):

- ``free``: no schema, ``ignore_eos`` (every request makes ``--max-tokens`` tokens);
- ``schema``: ``response_format`` ``json_schema`` with a nested schema (objects in objects, enums,
  an array of objects; strings bounded), ending where the JSON does (or at ``--max-tokens``).

At each concurrency level (closed loop, ``--concurrency`` streams, ``--requests-per-stream`` x
streams requests of each kind, at least 8 at one stream) the two kinds run in the order free,
schema, schema, free, ``--rounds`` times, the requests shared out among the runs (each run at
least one per stream), so that a drift of the machine's load weighs on both. Reported
at the client: TPOT p50 (per request, the time after its first token over its tokens after the
first), TTFT p50, tokens per request and aggregate tokens/s; then schema over free, against the
goal: TPOT at 32 streams at most 1.10x.

Compile time (in this process, on the default model's tokenizer, through the engine's grammar
backend): a schema's first request (cold: the grammar built from the schema, checked and bound to
the tokenizer; a different schema each time) and a later one (cached: a copy of the compiled
matcher), p50 and p99; and the ingress's check, without a tokenizer (cold).

    .venv/bin/python benchmarks/structured.py                          # 1 and 32 streams, 128 tokens
    .venv/bin/python benchmarks/structured.py --concurrency 1,2 --max-tokens 24 --requests-per-stream 1  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import httpx

from common import machine_rows, median, percentile, positive_ints, print_table
from local_cluster import stop_on_sigterm
from quantized import (CONNECT_TIMEOUT_S, Level, log, one_request, run_level, tandem_server, tandem_threads)

PROMPTS = [f"Here is a record of the book {title}, as JSON:\n" for title in (
    "Pride and Prejudice", "Moby-Dick", "The Count of Monte Cristo", "Don Quixote")]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 30},
            "born": {"type": "integer", "minimum": 1000, "maximum": 2024},
            "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                         "continent": {"enum": ["Europe", "Americas", "Asia",
                                                                                "Africa", "Oceania"]}},
                        "required": ["name", "continent"], "additionalProperties": False}},
            "required": ["name", "born", "country"], "additionalProperties": False},
        "genre": {"enum": ["novel", "poem", "essay", "play"]},
        "characters": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                             "role": {"enum": ["hero", "villain", "friend", "other"]}},
            "required": ["name", "role"], "additionalProperties": False}},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "author", "genre", "characters", "summary"],
    "additionalProperties": False,
}
GOAL_TPOT = 1.10  # schema over free, at GOAL_STREAMS
GOAL_STREAMS = 32
MIN_SINGLE_STREAM_REQUESTS = 8
FREE, CONSTRAINED = "free", "schema"
CLUSTER = "bench-structured"


def bodies(model: str, kind: str, max_tokens: int) -> list[dict]:
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    extra = ({"ignore_eos": True} if kind == FREE else
             {"response_format": {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}})
    return [{**common, "prompt": prompt, **extra} for prompt in PROMPTS]


async def measure(base: str, args) -> dict[tuple[str, int], list[Level]]:
    """Every level's runs of both kinds (free, schema, schema, free), after a warm-up of each."""
    runs: dict[tuple[str, int], list[Level]] = {}
    timeout = httpx.Timeout(args.request_timeout, connect=CONNECT_TIMEOUT_S)
    limits = httpx.Limits(max_connections=max(args.concurrency), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model = (await client.get(f"{base}/models")).raise_for_status().json()["data"][0]["id"]
        kinds = {kind: bodies(model, kind, args.max_tokens) for kind in (FREE, CONSTRAINED)}
        log("warm-up: every prompt of both kinds (their KV cached, the grammar backend made)")
        for kind in (FREE, CONSTRAINED):
            for body in kinds[kind]:
                if not (await one_request(client, base, body, args.request_timeout)).ok:
                    raise RuntimeError(f"the warm-up request ({kind}) failed")
        for streams in args.concurrency:
            total = max(MIN_SINGLE_STREAM_REQUESTS if streams == 1 else 1, args.requests_per_stream * streams)
            for kind in (FREE, CONSTRAINED, CONSTRAINED, FREE) * args.rounds:
                level = await run_level(client, base, kinds[kind], streams, max(streams, total // (2 * args.rounds)),
                                        f"{kind}, {streams} streams", args.request_timeout)
                runs.setdefault((kind, streams), []).append(level)
    return runs


def tpot_p50(levels: list[Level]) -> float:
    """Seconds per token after the first, median over the requests of ``levels``."""
    return median(1 / r.decode_rate for level in levels for r in level.done if r.decode_rate > 0)


def level_rows(runs: dict[tuple[str, int], list[Level]], args) -> list[tuple]:
    rows = []
    for streams in args.concurrency:
        for kind in (FREE, CONSTRAINED):
            levels = runs[(kind, streams)]
            done = [r for level in levels for r in level.done]
            seconds = sum(level.seconds for level in levels)
            rows.append((kind, streams, len(done), sum(level.failed for level in levels),
                         f"{median(r.tokens for r in done):.0f}", f"{median(r.ttft_s for r in done) * 1e3:.1f}",
                         f"{tpot_p50(levels) * 1e3:.2f}", f"{sum(r.tokens for r in done) / seconds:.1f}"))
    return rows


def ratio_rows(runs, args) -> list[tuple]:
    rows = []
    for streams in args.concurrency:
        free, constrained = runs[(FREE, streams)], runs[(CONSTRAINED, streams)]
        ratio = tpot_p50(constrained) / tpot_p50(free)
        goal = f"<= {GOAL_TPOT:.2f}x: " + ("met" if ratio <= GOAL_TPOT else "NOT met") if streams == GOAL_STREAMS \
            else ""
        rows.append((streams, f"{ratio:.3f}x", goal))
    return rows


# -- compile time -----------------------------------------------------------------------------

def compile_rows(args) -> list[tuple]:
    """p50 and p99 (ms) of a schema's compilation: cold (new schemas), cached, and the ingress's
    tokenizer-free check."""
    from cluster.default_model import default_model_path
    from cluster.engine.models.read_config import load_model_config
    from cluster.engine.structured.backend import GrammarBackend
    from cluster.engine.structured.grammars import check
    from cluster.engine.structured.spec import StructuredOutput
    from cluster.engine.tokenizer import Tokenizer

    model = default_model_path()
    config = load_model_config(model)
    started = time.perf_counter()
    backend = GrammarBackend(Tokenizer(model).to_json(), config.vocab_size, config.eos_token_ids,
                             cache_size=args.compiles + 1)
    setup_s = time.perf_counter() - started

    def schema(index: int) -> StructuredOutput:  # a new schema: one property renamed
        properties = dict(SCHEMA["properties"])
        properties[f"title_{index}"] = properties.pop("title")
        required = [f"title_{index}" if name == "title" else name for name in SCHEMA["required"]]
        return StructuredOutput("json_schema", json.dumps({**SCHEMA, "properties": properties,
                                                           "required": required}))

    def timed(call, specs) -> list[float]:
        times = []
        for spec in specs:
            started = time.perf_counter()
            call(spec)
            times.append(time.perf_counter() - started)
        return times

    cold = timed(backend.matcher, [schema(i) for i in range(args.compiles)])
    cached = timed(backend.matcher, [schema(i % args.compiles) for i in range(5 * args.compiles)])
    edge = timed(check, [schema(args.compiles + i) for i in range(args.compiles)])

    def row(name: str, times: list[float], note: str) -> tuple:
        return (name, len(times), f"{percentile(times, 0.5) * 1e3:.3f}", f"{percentile(times, 0.99) * 1e3:.3f}", note)

    return [row("cold", cold, "a new schema: grammar built, checked, bound to the tokenizer"),
            row("cached", cached, "a schema seen before: the compiled matcher copied"),
            row("ingress check (cold)", edge, "without a tokenizer, before routing"),
            ("tokenizer set-up", 1, f"{setup_s * 1e3:.0f}", "", "once per engine, at its first constrained request")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 32],
                        help="concurrent streams per level, comma-separated (default 1,32)")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help=f"requests per level and kind: this x its streams (at least {MIN_SINGLE_STREAM_REQUESTS} "
                             "at one stream)")
    parser.add_argument("--rounds", type=int, default=1, help="times the order free, schema, schema, free is run")
    parser.add_argument("--max-tokens", type=int, default=128, help="the most tokens of a request")
    parser.add_argument("--request-timeout", type=float, default=900.0, help="seconds a request may take")
    parser.add_argument("--compiles", type=int, default=200, help="schemas compiled cold (and 5x as many cached)")
    args = parser.parse_args()
    stop_on_sigterm()

    from cluster.default_model import default_model_path

    model = default_model_path()
    with tandem_server(model, CLUSTER) as (base, startup_s):
        log(f"the cluster answers at {base} after {startup_s:.1f}s")
        runs = asyncio.run(measure(base, args))
    compiles = compile_rows(args)
    print_table("machine", machine_rows() + [
        ("model file", f"{model} ({model.stat().st_size / 2**20:.0f} MiB)"),
        ("cluster", tandem_threads()),
        ("workload", f"{len(PROMPTS)} prompts, greedy, at most {args.max_tokens} tokens, streamed /v1/completions; "
                     "free: ignore_eos; schema: response_format json_schema (nested objects, enums, an array)")])
    print_table("per kind and level (closed loop; at the client)", level_rows(runs, args),
                ("kind", "streams", "requests", "failed", "tokens p50", "TTFT p50 ms", "TPOT p50 ms",
                 "aggregate tok/s"))
    print_table("schema / free (TPOT p50: lower is better)", ratio_rows(runs, args),
                ("streams", "TPOT", f"goal at {GOAL_STREAMS} streams"))
    print_table("schema compilation (ms)", compiles, ("", "count", "p50", "p99", "what"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
