"""Overload without collapse: goodput and SLO attainment per class at 0.5x, 1x, 2x and 4x the
load the cluster can serve, with how fast refusals come and the ``Retry-After`` they carry.

The quick-start cluster (``tandem up`` with the embedded default topology: the built-in
default model, 1 prefill + 1 decode worker on this machine's CPUs; ``--model`` for another
checkpoint) is driven through the gRPC API, timed at the client, by a chat-like workload:
prompts of ``--prompt-tokens`` (+-50%), answers of ``--output-tokens``, a quarter of the
requests ``interactive`` (TTFT <= 1 s, TPOT <= 100 ms, refused at once when they cannot be met),
the rest ``standard`` (TTFT <= 5 s, TPOT <= 250 ms, held at most 5 s). The default classes'
objectives are what each request is judged by (DistServe's goodput: requests per second that met
both).

1. Capacity: a closed-loop ramp (1, 2, 4, ... concurrent clients, ``--ramp-s`` each, until
   goodput stops growing); the cluster's capacity is the highest goodput of the ramp. A closed
   loop never offers more than it is served, so this does not rely on admission control.
2. Open-loop Poisson arrivals at 0.5x, 1x, 2x and 4x that rate, ``--phase-s`` each: goodput and
   attainment per class, requests rejected (HTTP 429 / RESOURCE_EXHAUSTED), the time to a
   rejection and the Retry-After it gave (p50/p90).

Goal: at 2x, goodput >= 90% of goodput at 1x.

    PYTHONPATH=. .venv/bin/python benchmarks/overload.py   # about 8 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from common import machine_rows, print_table
from local_cluster import LocalCluster, free_port, stop_on_sigterm

from cluster.bench.clients import GrpcBackend, SendOptions
from cluster.bench.metrics import Objectives, RequestResult, summarize
from cluster.paths import cache_dir
from router.config import DEFAULT_SLO_CLASSES

CLUSTER = "bench-overload"
CLASSES = {cls.name: Objectives(cls.ttft_s, cls.tpot_s) for cls in DEFAULT_SLO_CLASSES}
LOADS = (0.5, 1.0, 2.0, 4.0)
VOCAB = (100, 40000)  # token ids drawn from here: plain text pieces of the default model's vocabulary


def topology(args) -> dict:
    spec = {"server": {"port": free_port(), "http_port": 0}}
    if args.model:
        spec["model"] = {"path": args.model}
    if args.router:
        spec["router"] = json.loads(args.router)
    return spec


class Load:
    """Requests of the workload, each drawn once from the seed."""

    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.count = 0

    def next(self) -> tuple[str, list[int], str]:
        self.count += 1
        n = max(8, int(self.args.prompt_tokens * self.rng.uniform(0.5, 1.5)))
        prompt = [self.rng.randrange(*VOCAB) for _ in range(n)]
        slo_class = "interactive" if self.rng.random() < self.args.interactive_share else "standard"
        return f"r{self.count}", prompt, slo_class


async def send(backend: GrpcBackend, load: Load, args, clock, out: list[RequestResult]) -> None:
    request_id, prompt, slo_class = load.next()
    out.append(await backend.send(request_id, prompt, args.output_tokens, slo_class,
                                  SendOptions(ignore_eos=True, timeout_s=300), clock))


async def closed_loop(backend: GrpcBackend, load: Load, args, clients: int, seconds: float) -> list[RequestResult]:
    out: list[RequestResult] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731

    async def client() -> None:
        while clock() < seconds:
            await send(backend, load, args, clock, out)

    await asyncio.gather(*(client() for _ in range(clients)))
    return out


async def poisson(backend: GrpcBackend, load: Load, args, rate: float, seconds: float) -> list[RequestResult]:
    out: list[RequestResult] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    arrivals = random.Random(args.seed + int(rate * 1000))
    tasks, at = [], 0.0
    while True:
        at += arrivals.expovariate(rate)
        if at >= seconds:
            break
        await asyncio.sleep(max(0.0, at - clock()))
        tasks.append(asyncio.ensure_future(send(backend, load, args, clock, out)))
    await asyncio.gather(*tasks)
    return out


def judged(results: list[RequestResult], seconds: float) -> dict:
    """The run's figures with goodput over the time requests were offered (not the drain after)."""
    summary = summarize(results, class_objectives=CLASSES)
    for scope in [summary["goodput"], *summary.get("classes", {}).values()]:
        scope["goodput_rps"] = scope["met"] / seconds
    return summary


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


async def run(api: str, args) -> tuple[list[tuple[int, dict]], float, list[tuple[float, float, dict]]]:
    backend = GrpcBackend(api)
    load = Load(args)
    try:
        await closed_loop(backend, load, args, 2, args.warmup_s)  # the workers' step-time fits settle
        ramp, best, clients = [], args.capacity or 0.0, 1
        while clients <= args.max_clients and not args.capacity:
            summary = judged(await closed_loop(backend, load, args, clients, args.ramp_s), args.ramp_s)
            ramp.append((clients, summary))
            progress(f"ramp: {clients} clients, goodput {summary['goodput']['goodput_rps']:.2f} req/s, "
                     f"attainment {summary['goodput']['attainment']:.0%}")
            if summary["goodput"]["goodput_rps"] <= best * 1.05 and clients > 1:
                break
            best = max(best, summary["goodput"]["goodput_rps"])
            clients *= 2
        capacity = best
        phases = []
        for factor in args.loads:
            rate = capacity * factor
            summary = judged(await poisson(backend, load, args, rate, args.phase_s), args.phase_s)
            phases.append((factor, rate, summary))
            progress(f"{factor:g}x ({rate:.2f} req/s): goodput {summary['goodput']['goodput_rps']:.2f} req/s, "
                     f"{summary['rejected']} rejected, {summary['failed']} failed")
        return ramp, capacity, phases
    finally:
        await backend.close()


def ms(distribution: dict, key: str) -> str:
    value = distribution.get(key)
    return "-" if value is None else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a checkpoint directory (default: the quick start's built-in model)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--interactive-share", type=float, default=0.25)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    parser.add_argument("--ramp-s", type=float, default=20.0)
    parser.add_argument("--max-clients", type=int, default=64)
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router", help="the topology's router section as JSON (default: the quick start's)")
    parser.add_argument("--capacity", type=float, help="req/s the cluster serves (skips the ramp)")
    parser.add_argument("--loads", type=float, nargs="+", default=list(LOADS), help="multiples of the capacity")
    args = parser.parse_args()

    stop_on_sigterm()
    started = time.perf_counter()
    with LocalCluster(CLUSTER, topology(args), cache=cache_dir()) as cluster:
        ramp, capacity, phases = asyncio.run(run(cluster.api, args))
        status = cluster.status()
    took = time.perf_counter() - started

    model = args.model or "the quick start's built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF)"
    print_table("machine", machine_rows() + [
        ("cluster", "the quick start's embedded default topology: 1 prefill + 1 decode worker, CPU"),
        ("model", model),
        ("workload", f"prompts {args.prompt_tokens} tokens +-50%, {args.output_tokens} output tokens, "
                     f"{args.interactive_share:.0%} interactive, the rest standard; Poisson arrivals"),
        ("run", f"{took:.0f} s in all")])
    print_table("capacity: closed-loop ramp", [
        (clients, f"{s['goodput']['goodput_rps']:.2f}", f"{s['goodput']['attainment']:.0%}",
         f"{s['request_throughput_rps']:.2f}", ms(s["ttft"], "p90_ms"), ms(s["tpot"], "p90_ms"))
        for clients, s in ramp], ("clients", "goodput req/s", "attainment", "throughput req/s", "TTFT p90 ms",
                                  "TPOT p90 ms"))
    rows = []
    for factor, rate, s in phases:
        for name in ("interactive", "standard"):
            c = s.get("classes", {}).get(name)
            if c is None:
                continue
            rows.append((f"{factor:g}x", f"{rate:.2f}", name, c["requests"], f"{c['goodput_rps']:.2f}",
                         f"{c['attainment']:.0%}", c["rejected"], c["failed"]))
        g = s["goodput"]
        rows.append((f"{factor:g}x", f"{rate:.2f}", "all", g["requests"], f"{g['goodput_rps']:.2f}",
                     f"{g['attainment']:.0%}", g["rejected"], g["failed"]))
    print_table(f"open loop at multiples of the capacity ({capacity:.2f} req/s), {args.phase_s:.0f} s each", rows,
                ("load", "offered req/s", "class", "requests", "goodput req/s", "attainment", "rejected", "failed"))
    print_table("rejections (client-side)", [
        (f"{factor:g}x", s["rejected"], ms(s["time_to_reject"], "p50_ms"), ms(s["time_to_reject"], "p90_ms"),
         ms(s["retry_after"], "p50_ms"), ms(s["retry_after"], "p90_ms"), ms(s["ttft"], "p90_ms"), ms(s["tpot"], "p90_ms"))
        for factor, _, s in phases],
        ("load", "rejected", "time to 429 p50 ms", "p90 ms", "Retry-After p50 ms", "p90 ms", "kept: TTFT p90 ms",
         "TPOT p90 ms"))
    at = {factor: s["goodput"]["goodput_rps"] for factor, _, s in phases}
    if at.get(1.0):
        ratios = ", ".join(f"at {f:g}x {g / at[1.0]:.2f}" for f, g in at.items() if f > 1)
        print(f"goodput against goodput at 1x: {ratios} (goal at 2x: >= 0.90)")
    if status:
        workers = status["workers"]
        router = status["router"]
        error = router.get("ttft_prediction_error")
        print(f"after the run: {sum(w['kv_blocks_used'] for w in workers)} KV blocks in use; router: rejections by "
              f"class {router.get('rejected_by_class')}, mean TTFT prediction error "
              f"{'-' if error is None else f'{error:.0%}'}, learned correction {router.get('ttft_correction_s')}")
        minute = (status.get("goodput") or {}).get("last_minute", {}).get("classes", {})
        print("server-side, last minute (the registry's records, TTFT from arrival at the API): " + "; ".join(
            f"{name} {c['met']}/{c['requests']} met, mean TTFT {c['mean_ttft_s'] or 0:.2f} s, mean TPOT "
            f"{(c['mean_tpot_s'] or 0) * 1000:.0f} ms" for name, c in minute.items()))


if __name__ == "__main__":
    main()
