"""KV tiers through the whole cluster: multi-turn conversations whose KV is ~4x the decode workers'
device caches, tiers off against a host tier against a host tier with peer pulls, side by side in
one run.

Each mode is its own ``tandem up`` (the default model, 1 prefill + 2 decode workers on this
machine's CPUs, ``kv.num_blocks`` sized so that the conversations' final KV is ``--kv-factor``
times the two decode workers' device caches) driven through the gRPC API, timed at the client:
``--conversations`` conversations open at Poisson arrivals (``--rate`` a second); each sends
``--turns`` turns, each after the previous answer and an exponential think time, each prompt being
its own context (``--system-tokens``: an agent's instructions and tools, a document), the history
with the answers the model gave, and a new user message. A conversation comes back after others
have taken the device caches, so without tiers its history is computed again (on the prefill
worker: the router sends a long uncached prompt there). The modes:

- ``off``: device caches only (``kv.host_cache`` null);
- ``host``: ``kv.host_cache`` ``--host-cache`` on every worker;
- ``host + peer``: that and ``kv.peer_pull``: a decode worker may pull a prefix the other caches.

Per mode: the prefix hit rate (prompt tokens the placement did not compute: the API's
``cached_tokens``, over prompt tokens), TTFT p50/p90, TPOT p90, goodput (turns a second meeting
both objectives, over the run), the placements (decode worker prefilled itself / a prefill
worker), host-tier loads and peer pulls (``tandem status``), and whether every mode's greedy
tokens equal the ``off`` run's (the host tier holds 8-bit rows on a CPU, so a reloaded block is
within half a code step of what it was: a differing token is counted, not hidden). Goals (issue
27, host + peer against off): hit rate >= 2x, TTFT p90 <= 0.5x, goodput >= 1.5x.

After its run, one mode's router is started again (``--restart-mode``, host + peer): 16
conversations' next turns are sent at once, the ingress replica's process is killed (Ray Serve
starts another, whose router rebuilds its view from the registry), and the same turns are sent
at once again as soon as the API serves: their hit rates before and after, how long the API was
away and the new router's warm-up (``tandem status``). Goal: hit rate back to >= 90% of before
within 1 s.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_tiers.py   # about 8 minutes on a 2-core CPU

``benchmarks/kv_tiers_engine.py`` measures the same tiers in one process, on the engines alone.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

from common import fmt_ms, machine_rows, percentile, print_table
from local_cluster import LocalCluster, free_port, stop_on_sigterm

from cluster.bench.clients import GrpcBackend, SendOptions
from cluster.bench.metrics import RequestResult
from cluster.paths import cache_dir

MODES = ("off", "host", "host + peer")
VOCAB = (100, 40000)  # token ids drawn from here: plain text pieces of the default model's vocabulary


@dataclass(frozen=True)
class Conversation:
    """Its own context, its user messages and when it opens; each later turn waits its think time."""

    index: int
    system: list[int]
    users: list[list[int]]
    start: float
    thinks: list[float]


def make_workload(args) -> list[Conversation]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    conversations, t = [], 0.0
    for i in range(args.conversations):
        t += rng.expovariate(args.rate)
        conversations.append(Conversation(i, tokens(args.system_tokens), [tokens(args.user_tokens) for _ in range(args.turns)],
                                          t, [rng.expovariate(1.0 / args.think_s) for _ in range(args.turns)]))
    return conversations


def final_kv_blocks(args) -> int:
    """Blocks of every conversation's KV after its last turn (its prompt and answer)."""
    tokens = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)
    return args.conversations * -(-tokens // args.block_size)


def topology(args, mode: str) -> dict:
    kv = {"block_size": args.block_size, "num_blocks": args.device_blocks,
          "host_cache": None if mode == "off" else args.host_cache, "peer_pull": mode == "host + peer"}
    return {"server": {"port": free_port(), "http_port": 0},
            "prefill": {"replicas": 1}, "decode": {"replicas": 2}, "kv": kv,
            "router": {"slo_classes": {"chat": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
                                                "on_overload": "admit"}},
                       "default_class": "chat"}}


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


async def drive(api: str, args, mode: str) -> tuple[list[tuple[str, RequestResult]], float, dict[int, list[int]]]:
    """Every conversation's turns through the API: (turn id, result) in the order they ended, the
    seconds it took, and each conversation's last prompt with its answer."""
    backend = GrpcBackend(api)
    conversations = make_workload(args)
    options = SendOptions(ignore_eos=True, temperature=0.0, timeout_s=600)
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    done: list[tuple[str, RequestResult]] = []
    total = len(conversations) * args.turns
    last: dict[int, list[int]] = {}

    async def converse(c: Conversation) -> None:
        await asyncio.sleep(max(0.0, c.start - clock()))
        history: list[int] = []  # the earlier turns' messages and the answers the model gave
        for turn in range(args.turns):
            prompt = c.system + history + c.users[turn]
            result = await backend.send(f"{mode[:4]}-c{c.index}-t{turn}", prompt, args.answer_tokens, "chat",
                                        options, clock)
            done.append((f"c{c.index}-t{turn}", result))
            if not result.ok:
                progress(f"{mode}: c{c.index} turn {turn} ended: {result.error}")
                return  # the conversation cannot go on without its answer
            history = prompt[len(c.system):] + result.output_token_ids
            last[c.index] = prompt + result.output_token_ids
            if turn + 1 < args.turns:
                await asyncio.sleep(c.thinks[turn + 1])

    async def report() -> None:
        while len(done) < total:
            await asyncio.sleep(10)
            progress(f"{mode}: {len(done)}/{total} turns, {clock():.0f} s")

    try:
        reporter = asyncio.ensure_future(report())
        await asyncio.gather(*(converse(c) for c in conversations))
        reporter.cancel()
    finally:
        await backend.close()
    return done, clock(), last


async def send_all(api: str, prompts: list[list[int]], args, tag: str) -> list[RequestResult]:
    """The prompts at once through a new connection, each one more turn of its conversation."""
    backend = GrpcBackend(api)
    options = SendOptions(ignore_eos=True, temperature=0.0, timeout_s=600)
    start = time.perf_counter()
    try:
        return await asyncio.gather(*(backend.send(f"{tag}-{i}", p, args.answer_tokens, "chat", options,
                                                   lambda: time.perf_counter() - start)
                                      for i, p in enumerate(prompts)))
    finally:
        await backend.close()


def hit_rate(results: list[RequestResult]) -> float:
    ok = [r for r in results if r.ok]
    return sum(r.cached_tokens or 0 for r in ok) / max(1, sum(r.prompt_tokens for r in ok))


def restart_router(cluster: LocalCluster, last: dict[int, list[int]], args) -> dict:
    """The ingress replica (and its router) killed and started again by Ray Serve: the same
    returning turns sent at once before and right after, their hit rates compared, with the
    time the API was away and the new router's warm-up from the registry."""
    import psutil

    rng = random.Random(args.seed + 1)
    prompts = [history + [rng.randrange(*VOCAB) for _ in range(args.user_tokens)]
               for _, history in sorted(last.items())[:args.restart_turns]]
    before = asyncio.run(send_all(cluster.api, prompts, args, "before"))
    name = f"ServeReplica:{cluster.name}:grpc-ingress"
    replicas = [p for p in psutil.process_iter(["cmdline"]) if name in " ".join(p.info["cmdline"] or ())]
    if not replicas:
        return {"error": f"no process named {name}"}
    killed = time.perf_counter()
    for process in replicas:
        process.kill()
    progress(f"restart: killed {name} (pid {', '.join(str(p.pid) for p in replicas)}); waiting for the API")
    deadline = killed + 120
    while time.perf_counter() < deadline:
        status = cluster.status() or {}
        routers = status.get("each_router") or []
        if status.get("serving") and routers and all(r.get("warm_up_s") is not None for r in routers):
            break
        time.sleep(0.2)
    else:
        return {"error": "the API did not come back within 120 s"}
    back = time.perf_counter() - killed
    after = asyncio.run(send_all(cluster.api, prompts, args, "after"))
    placed_s = max((r.first_token_at for r in after if r.first_token_at is not None), default=float("nan"))
    return {"turns": len(prompts), "before": hit_rate(before), "after": hit_rate(after), "back_s": back,
            "warm_up_s": max(r["warm_up_s"] for r in routers), "first_tokens_s": placed_s,
            "failed": sum(not r.ok for r in before + after)}


def summarise(done: list[tuple[str, RequestResult]], wall: float, args, status: dict | None) -> dict:
    results = [r for _, r in done]
    ok = [r for r in results if r.ok]
    met = [r for r in ok if r.ttft_s <= args.ttft_ms / 1000 and (r.tpot_s is None or r.tpot_s <= args.tpot_ms / 1000)]
    workers = (status or {}).get("workers", [])
    host = [w["host_tier"] for w in workers if w.get("host_tier")]
    pulls = [w["pulls"] for w in workers if w.get("pulls")]
    return {
        "turns": len(results), "ok": len(ok), "met": len(met), "wall": wall,
        "hit_rate": sum(r.cached_tokens or 0 for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
        "p50": percentile([r.ttft_s for r in ok], 0.5), "p90": percentile([r.ttft_s for r in ok], 0.9),
        "tpot_p90": percentile([r.tpot_s for r in ok], 0.9), "goodput": len(met) / wall,
        "local": sum(1 for r in ok if r.placement and not r.placement[0]),
        "remote": sum(1 for r in ok if r.placement and r.placement[0]),
        "loaded": sum(h["loaded_blocks"] for h in host), "offloaded": sum(h["offloaded_blocks"] for h in host),
        "load_s": sum(h["load_seconds"] for h in host),
        "pulls": sum(p["pulled"] for p in pulls), "pulls_recomputed": sum(p["recomputed"] for p in pulls),
        "pulled_blocks": sum(p["blocks"] for p in pulls),
        "leaked": sum(w["kv_blocks_used"] for w in workers),
        "tokens": {turn: r.output_token_ids for turn, r in done if r.ok},
    }


def run_mode(args, mode: str) -> dict:
    with LocalCluster(f"bench-kv-tiers-{MODES.index(mode)}", topology(args, mode), cache=cache_dir()) as cluster:
        progress(f"{mode}: the cluster is up; {args.conversations} conversations x {args.turns} turns")
        done, wall, last = asyncio.run(drive(cluster.api, args, mode))
        status = cluster.status()
        restart = restart_router(cluster, last, args) if mode == args.restart_mode else None
    return {**summarise(done, wall, args, status), "restart": restart}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512, help="each conversation's own context")
    parser.add_argument("--user-tokens", type=int, default=32, help="each user message")
    parser.add_argument("--answer-tokens", type=int, default=32, help="each answer (greedy, ignore_eos)")
    parser.add_argument("--rate", type=float, default=0.5, help="conversations opened a second (Poisson)")
    parser.add_argument("--think-s", type=float, default=8.0, help="mean think time before a later turn")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-factor", type=float, default=4.0,
                        help="the conversations' final KV over the 2 decode workers' device caches")
    parser.add_argument("--device-blocks", type=int, default=0, help="KV blocks per worker (default: from --kv-factor)")
    parser.add_argument("--host-cache", default="512MiB", help="kv.host_cache of every worker in the tiered modes")
    parser.add_argument("--ttft-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-ms", type=float, default=200.0)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--restart-mode", default="host + peer", choices=(*MODES, "none"),
                        help="the mode whose router is killed and started again after its run")
    parser.add_argument("--restart-turns", type=int, default=16, help="returning turns sent before and after it")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    longest = -(-(args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens)) // args.block_size)
    args.device_blocks = args.device_blocks or max(2 * longest, round(final_kv_blocks(args) / args.kv_factor / 2))

    stop_on_sigterm()
    started = time.perf_counter()
    results = {mode: run_mode(args, mode) for mode in args.modes}
    took = time.perf_counter() - started

    print_table("machine", machine_rows() + [
        ("cluster", "tandem up: 1 prefill + 2 decode workers on this CPU, the default model (SmolLM2-135M-Instruct, "
                    "Q4_1 GGUF)"),
        ("run", f"{took:.0f} s in all, the modes one after the other")])
    print_table("workload", [
        ("conversations x turns", f"{args.conversations} x {args.turns}, opened at {args.rate:g}/s (Poisson), "
                                  f"think time {args.think_s:g} s (mean)"),
        ("a turn", f"context {args.system_tokens} + history + user {args.user_tokens} tokens; answer "
                   f"{args.answer_tokens} tokens (greedy)"),
        ("final KV / device caches", f"{final_kv_blocks(args)} blocks / 2 x {args.device_blocks} = "
                                     f"{final_kv_blocks(args) / (2 * args.device_blocks):.1f}x"),
        ("host tier", f"{args.host_cache} per worker (host modes)"),
        ("objectives", f"TTFT <= {args.ttft_ms:.0f} ms, TPOT <= {args.tpot_ms:.0f} ms (the router's class too)"),
    ])
    off = results.get("off")

    def ratio(mode: str, key: str) -> str:
        if off is None or mode == "off" or not off[key]:
            return ""
        return f"{results[mode][key] / off[key]:.2f}x"

    rows = []
    for label, key, fmt in [("prefix hit rate", "hit_rate", lambda v: f"{v:.1%}"), ("TTFT p50", "p50", fmt_ms),
                            ("TTFT p90", "p90", fmt_ms), ("TPOT p90", "tpot_p90", fmt_ms),
                            ("goodput (turns/s)", "goodput", lambda v: f"{v:.3f}")]:
        rows.append((label, *(fmt(r[key]) for r in results.values()), *(ratio(m, key) for m in results if m != "off")))
    rows.append(("turns met / ended / offered", *(f"{r['met']}/{r['ok']}/{r['turns']}" for r in results.values())))
    rows.append(("wall", *(f"{r['wall']:.0f} s" for r in results.values()),
                 *(ratio(m, "wall") for m in results if m != "off")))
    rows.append(("prefilled on: decode / prefill worker", *(f"{r['local']} / {r['remote']}" for r in results.values())))
    rows.append(("host blocks loaded / offloaded (load s)",
                 *(f"{r['loaded']} / {r['offloaded']} ({r['load_s']:.2f})" for r in results.values())))
    rows.append(("peer pulls (recomputed) / blocks", *(f"{r['pulls']} ({r['pulls_recomputed']}) / {r['pulled_blocks']}"
                                                       for r in results.values())))
    rows.append(("KV blocks in use after", *(str(r["leaked"]) for r in results.values())))
    if off is not None:
        rows.append(("turns whose tokens equal off's", *(
            f"{sum(1 for t, ids in r['tokens'].items() if off['tokens'].get(t) == ids)}/{len(r['tokens'])}"
            for r in results.values())))
    others = [m for m in results if m != "off"] if off is not None else []
    print_table("tiers off vs host tier vs host + peer pulls", rows,
                headers=("", *results, *(f"{m} / off" for m in others)))
    print("goals (issue 27, host + peer against off): hit rate >= 2x, TTFT p90 <= 0.5x, goodput >= 1.5x.")
    restarted = [(mode, r["restart"]) for mode, r in results.items() if r.get("restart")]
    for mode, r in restarted:
        if "error" in r:
            print(f"\nthe router's restart ({mode}): {r['error']}")
            continue
        print_table(f"the router's restart ({mode}): the ingress replica killed, Ray Serve starts it again", [
            ("returning turns sent at once, before and after", str(r["turns"])),
            ("prefix hit rate before / after", f"{r['before']:.1%} / {r['after']:.1%} "
                                               f"({r['after'] / r['before']:.0%} of before)" if r["before"] else "-"),
            ("API away (kill to serving, the router warm)", f"{r['back_s']:.1f} s"),
            ("the new router's warm-up from the registry", f"{r['warm_up_s'] * 1000:.1f} ms"),
            ("the turns' first tokens after it was back", f"within {r['first_tokens_s']:.2f} s"),
            ("failed turns", str(r["failed"]))])
        print("goal (issue 27): hit rate back to >= 90% of before within 1 s.")


if __name__ == "__main__":
    main()
