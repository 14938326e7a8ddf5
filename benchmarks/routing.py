"""Routing benchmark: the placement policies side by side on one multi-turn chat workload.

The workload: ``--groups`` groups of conversations, each group sharing a system prompt; every
conversation opens at a Poisson arrival and sends ``--turns`` turns, each after the previous
answer plus an exponential think time, each prompt being the system prompt, the history (with
the answers actually generated) and a new user message. The same seeded workload runs once per
configuration on a fresh local cluster of ``--prefill-workers`` prefill and ``--decode-workers``
decode workers (``DisaggregatedLLM``: Ray actors, KV over gloo, a private Redis registry; every
request goes down the same request path an API ingress drives: the router places it, the decode
worker fetches its KV from the prefill worker, or prefills it itself, and streams the tokens).

The configurations: ``round_robin``, ``least_loaded``, ``prefix_affinity`` and ``slo`` with every
prompt prefilled on a prefill worker unless its decode worker already caches 90% of it
(``router.local_prefill_max_tokens`` 0, ``skip_prefill_fraction`` 0.9); ``slo+local``: ``slo``
with conditional disaggregation (``local_prefill_max_tokens`` ``--local-prefill-max-tokens``): a
decode worker may also prefill a prompt itself when at most that many of its tokens are not
cached there, if the router predicts that is better; and ``slo+remote``: every prompt that is
not cached whole on its decode worker is prefilled on a prefill worker (``skip_prefill_fraction``
1), the pure disaggregation the others are measured against.

For each: prefix-cache hit rate (prompt tokens not recomputed where the prompt was
prefilled), the oracle's hit rate (when the router's placement comes back, the longest prefix
that any worker's cache really holds, asked of every worker directly: the most any placement
could have reused), TTFT and TPOT p50/p90, goodput (requests per second that met both
objectives), SLO attainment and how many requests were prefilled on their decode worker.
Goals: ``slo`` (every row) reaches 90% of the oracle's hit rate and a p90 TTFT at least 2x
better than ``round_robin``.

    .venv/bin/python benchmarks/routing.py            # about 5 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import REPO_ROOT, ensure_checkpoint, machine_rows, percentile, print_table

CONFIGS = ("round_robin", "least_loaded", "prefix_affinity", "slo", "slo+local", "slo+remote")
RESULTS = REPO_ROOT / "benchmarks" / "results"


@dataclass
class Conversation:
    group: int
    system: list[int]
    users: list[list[int]]
    start: float
    thinks: list[float]
    history: list[int] = field(default_factory=list)
    turn: int = 0


def make_workload(args) -> list[Conversation]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 8192) for _ in range(n)]

    systems = [tokens(args.system_tokens) for _ in range(args.groups)]
    conversations, t = [], 0.0
    for i in range(args.groups * args.conversations):
        t += rng.expovariate(args.rate)
        conversations.append(Conversation(
            group=i % args.groups, system=systems[i % args.groups],
            users=[tokens(args.user_tokens) for _ in range(args.turns)], start=t,
            thinks=[rng.expovariate(1.0 / args.think_s) for _ in range(args.turns)]))
    return conversations


@dataclass
class Served:
    request_id: str
    prompt_tokens: int
    hit_tokens: int
    oracle_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    met: bool
    placement: str
    predicted_ttft_s: float | None = None


class OracleRouter:
    """The router as the request path sees it: when a placement comes back, every worker is
    asked how many leading blocks of the prompt its cache holds (read when the request is
    done). Asked before the decode worker starts the request, so its own blocks are not
    counted."""

    def __init__(self, router, workers: list, asked: dict[str, list]):
        self._router, self._workers, self._asked = router, workers, asked

    def __getattr__(self, name: str):
        return getattr(self._router, name)

    async def place(self, request):
        decision = await self._router.place(request)
        prompt = list(request.prompt_token_ids)
        self._asked.setdefault(request.request_id, [w.cached_prefix_blocks.remote(prompt) for w in self._workers])
        return decision


def router_config(name: str, args):
    from router.config import RouterConfig

    policy, _, variant = name.partition("+")
    return RouterConfig.from_mapping({
        "policy": policy,
        "slo_classes": {"chat": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms, "on_overload": "admit"}},
        "default_class": "chat",
        "local_prefill_max_tokens": args.local_prefill_max_tokens if variant == "local" else 0,
        "skip_prefill_fraction": 1.0 if variant == "remote" else 0.9,  # remote: only a prompt cached whole stays
    })


def run_config(name: str, args, model_dir: Path) -> tuple[list[Served], float, dict]:
    import ray

    from cluster.offline.disaggregated import DisaggregatedLLM
    from cluster.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    conversations = make_workload(args)
    served: list[Served] = []
    asked: dict[str, list] = {}
    with DisaggregatedLLM.from_args(str(model_dir), prefill_workers=args.prefill_workers,
                                    decode_workers=args.decode_workers, router_config=router_config(name, args),
                                    cluster_name="bench-routing", num_kv_blocks=args.kv_blocks,
                                    block_size=args.block_size, max_model_len=4096, num_threads=1,
                                    verbose=False) as llm:
        llm.path.router = OracleRouter(llm.path.router, llm.prefill + llm.decode, asked)
        t0 = time.monotonic()
        arrivals = [(c.start, i) for i, c in enumerate(conversations)]
        heapq.heapify(arrivals)
        prompts: dict[str, tuple[int, list[int]]] = {}
        total = len(conversations) * args.turns
        last_report = t0
        while len(served) < total:
            now = time.monotonic() - t0
            while arrivals and arrivals[0][0] <= now:
                _, i = heapq.heappop(arrivals)
                c = conversations[i]
                prompt = c.system + c.history + c.users[c.turn]
                rid = f"c{i}-t{c.turn}"
                prompts[rid] = (i, prompt)
                llm.engine.add_request(rid, prompt, params)
            for rid in [rid for rid, future in llm.pending.items() if future.done()]:
                output = llm.pending.pop(rid).result()
                i, prompt = prompts[rid]
                c = conversations[i]
                decision = llm.decisions.get(rid)
                if decision is not None and decision.prefill is None:
                    hit = output.usage.cached_tokens
                else:
                    hit = next((t.prefill_cached_tokens for t in reversed(llm.transfers) if t.request_id == rid), 0)
                oracle = max(ray.get(asked.pop(rid, [])), default=0) * args.block_size
                ttft = output.first_token_time - output.arrival_time if output.first_token_time else None
                n = output.usage.completion_tokens
                tpot = (output.finish_time - output.first_token_time) / (n - 1) if n >= 2 and ttft else None
                met = (output.error is None and ttft is not None and ttft <= args.ttft_ms / 1000
                       and (tpot is None or tpot <= args.tpot_ms / 1000))
                placement = "-" if decision is None else f"{decision.prefill or 'local'}>{decision.decode}"
                served.append(Served(rid, len(prompt), hit, oracle, ttft, tpot, met, placement,
                                     decision.predicted_ttft_s if decision is not None else None))
                if output.error:
                    print(f"\n[bench] {rid}: {output.error}", file=sys.stderr)
                c.history = prompt[len(c.system):] + output.token_ids
                c.turn += 1
                if c.turn < args.turns:
                    heapq.heappush(arrivals, (time.monotonic() - t0 + c.thinks[c.turn], i))
            if time.monotonic() - last_report > 5:
                last_report = time.monotonic()
                print(f"\r[bench] {name}: {len(served)}/{total} requests", end="", file=sys.stderr, flush=True)
            time.sleep(0.002)
        elapsed = time.monotonic() - t0
        status = llm.router_status()
    print(f"\r[bench] {name}: {total}/{total} requests in {elapsed:.0f}s", file=sys.stderr, flush=True)
    return served, elapsed, status


def summarise(served: list[Served], elapsed: float) -> dict:
    prompt = sum(s.prompt_tokens for s in served)
    ttfts = [s.ttft_s for s in served if s.ttft_s is not None]
    tpots = [s.tpot_s for s in served if s.tpot_s is not None]
    return {
        "requests": len(served),
        "hit_rate": sum(s.hit_tokens for s in served) / prompt,
        "oracle_hit_rate": sum(s.oracle_tokens for s in served) / prompt,
        "ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9),
        "tpot_p50": percentile(tpots, 0.5), "tpot_p90": percentile(tpots, 0.9),
        "goodput_rps": sum(s.met for s in served) / elapsed, "attainment": statistics.mean(s.met for s in served),
        "seconds": elapsed, "ttfts": ttfts,
        "slowest": [vars(s) for s in sorted(served, key=lambda s: -(s.ttft_s or 0))[:8]],
        "served": [vars(s) for s in served],
    }


def plot(path: Path, results: dict[str, dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        values = sorted(r["ttfts"])
        cdf.plot([v * 1000 for v in values], [(i + 1) / len(values) for i in range(len(values))], label=name)
    cdf.axvline(args.ttft_ms, color="grey", linestyle=":", label="TTFT objective")
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT CDF per configuration")
    cdf.legend()
    names = list(results)
    x = range(len(names))
    bars.bar([i - 0.2 for i in x], [results[n]["hit_rate"] for n in names], 0.4, label="prefix-cache hit rate")
    bars.bar([i + 0.2 for i in x], [results[n]["attainment"] for n in names], 0.4, label="SLO attainment")
    bars.set_xticks(list(x), names, rotation=20)
    bars.set_ylim(0, 1.15)
    bars.set_title("hit rate and SLO attainment")
    bars.legend(loc="upper center", ncol=2, fontsize=8)
    fig.suptitle(f"{args.groups} groups x {args.conversations} conversations x {args.turns} turns, "
                 f"{args.prefill_workers} prefill + {args.decode_workers} decode workers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="policies; slo+local: with conditional disaggregation; slo+remote: remote prefill only")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=256,
                        help="slo+local: most uncached prompt tokens a decode worker may prefill itself")
    parser.add_argument("--groups", type=int, default=8, help="conversation groups, each with its system prompt")
    parser.add_argument("--conversations", type=int, default=4, help="conversations per group")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--rate", type=float, default=2.0, help="conversation openings per second (Poisson)")
    parser.add_argument("--think-s", type=float, default=1.0, help="mean think time between turns")
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-ms", type=float, default=150.0)
    parser.add_argument("--prefill-workers", type=int, default=2)
    parser.add_argument("--decode-workers", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=320, help="KV blocks per worker")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", help="checkpoint folder to reuse or build (default: Tandem's cache)")
    args = parser.parse_args()
    if args.prefill_workers < 2 or args.decode_workers < 2:
        parser.error("routing needs a choice: at least 2 prefill and 2 decode workers")

    model_dir, num_params = ensure_checkpoint(args.model_dir)
    results = {}
    for name in args.configs:
        served, elapsed, status = run_config(name, args, model_dir)
        results[name] = summarise(served, elapsed)
        results[name]["router"] = status

    print_table("machine", machine_rows())
    base = results.get("round_robin")
    rows = []
    for name, r in results.items():
        rows.append((
            name, r["requests"], f"{r['hit_rate']:.1%}", f"{r['oracle_hit_rate']:.1%}",
            f"{r['hit_rate'] / r['oracle_hit_rate']:.2f}" if r["oracle_hit_rate"] else "-",
            f"{r['ttft_p50'] * 1e3:.0f}", f"{r['ttft_p90'] * 1e3:.0f}",
            f"{base['ttft_p90'] / r['ttft_p90']:.2f}x" if base else "-",
            f"{r['tpot_p50'] * 1e3:.1f}", f"{r['tpot_p90'] * 1e3:.1f}",
            f"{r['goodput_rps']:.2f}", f"{r['attainment']:.0%}", r["router"]["local_prefills"],
        ))
    print_table(
        f"routing: {args.groups} groups x {args.conversations} conversations x {args.turns} turns "
        f"(system {args.system_tokens}, user {args.user_tokens}, answer {args.answer_tokens} tokens), "
        f"{args.rate}/s openings, think {args.think_s}s; {num_params / 1e6:.0f}M-parameter model; "
        f"SLO TTFT <= {args.ttft_ms:.0f} ms, TPOT <= {args.tpot_ms:.0f} ms",
        rows,
        ("configuration", "requests", "hit rate", "oracle", "of oracle", "TTFT p50 ms", "TTFT p90 ms", "p90 vs rr",
         "TPOT p50 ms", "TPOT p90 ms", "goodput/s", "attainment", "local prefills"),
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / "routing.png"
    plot(png, results, args)
    (RESULTS / "routing.json").write_text(json.dumps(
        {p: {k: v for k, v in r.items() if k != "ttfts"} for p, r in results.items()}, indent=1))
    print(f"\nwrote {png} and {RESULTS / 'routing.json'}")
    for name in ("slo", "slo+local", "slo+remote"):
        if name in results and base:
            r = results[name]
            print(f"goals, {name}: hit rate {r['hit_rate'] / r['oracle_hit_rate']:.0%} of the oracle's (goal 90%); "
                  f"p90 TTFT {base['ttft_p90'] / r['ttft_p90']:.2f}x better than round_robin (goal 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
