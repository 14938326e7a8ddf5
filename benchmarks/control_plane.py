"""The router's cost per placement against a real Redis holding fake workers' registry entries.

A private ``redis-server`` (``cluster.registry.local_redis.LocalRedis``) is filled as a
cluster of ``N`` workers (half prefill, half decode) would fill it: each worker's load report
(``publish_load``: queue, batch, free blocks and 64 measured steps, as a real report carries)
and its KV blocks (``KVIndexPublisher``: shared system prompts held, at varying lengths, by a
few workers of each role, plus unrelated blocks). A ``router.router.Router`` over
``RedisRegistryView`` then places a seeded stream of prompts (most a system prompt plus a user
message, some with no cached prefix), with a bounded window of placements in flight (the
oldest is told finished as a new one is placed), and every ``route()`` is timed.

Two report regimes: ``static`` (reports never change: the router reads them every
``load_refresh_s`` but never refits a step-time model) and ``live`` (a second process rewrites
every worker's report every 100 ms with a new step, as busy workers' reporters do, so the router
reparses and refits). Placements per second count the time inside ``route()``; per
CPU-second, the benchmark process's CPU time (on a busy machine: what it would do with a core
of its own, the Redis server's part left out). Redis commands per placement come from the
server's INFO commandstats (those a script runs included), round trips from counting the
client's calls (in a separate pass, so the counting is not timed).

    .venv/bin/python benchmarks/control_plane.py                   # 16, 64, 256 workers, both regimes
    .venv/bin/python benchmarks/control_plane.py --workers 16 --regimes static --profile   # where the time goes
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.engine.block_hash import hash_token_blocks  # noqa: E402
from cluster.engine.block_manager import BlockStored  # noqa: E402
from cluster.registry.kv_index import KVIndexPublisher  # noqa: E402
from cluster.registry.load import STEPS_REPORTED, StepSample, WorkerLoad, publish_load  # noqa: E402
from cluster.registry.local_redis import LocalRedis  # noqa: E402
from cluster.registry.reporter import connect  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.registry_view import RedisRegistryView  # noqa: E402
from router.router import RouteRequest, Router, Topology  # noqa: E402

CLUSTER = "bench-control-plane"
BLOCK_SIZE = 16
HASH_KEYS = ("LlamaForCausalLM", "bench-model")
VOCAB = 32000
REPORT_TTL_S = 3600.0
LIVE_REPORT_EVERY_S = 0.1  # the workers' reporter interval


@dataclass(frozen=True)
class Workload:
    system_prompts: int = 64
    system_tokens: int = 512
    user_tokens: int = 64
    miss_fraction: float = 0.1  # prompts with no cached prefix anywhere
    holders_per_role: int = 2  # workers of each role holding (part of) each system prompt
    unrelated_blocks: int = 256  # other blocks each worker holds
    max_tokens: int = 64
    seed: int = 0


@dataclass
class RunResult:
    workers: int
    regime: str
    placements: int
    route_s: float  # summed time inside route()
    cpu_s: float  # process CPU time over the timed loop
    wall_s: float
    actions: dict[str, int]
    local: int
    commands: dict[str, float]  # per placement, by Redis command
    round_trips: float  # per placement
    p50_us: float
    p99_us: float

    @property
    def per_second(self) -> float:
        return self.placements / self.route_s

    @property
    def commands_per_placement(self) -> float:
        return sum(self.commands.values())


def worker_names(n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    half = n // 2
    return tuple(f"prefill-{i}" for i in range(half)), tuple(f"decode-{i}" for i in range(n - half))


def fake_steps(role: str, rng: random.Random, count: int = STEPS_REPORTED) -> tuple[StepSample, ...]:
    """Measured-looking steps: prefills of varied length (every role prefills), and on a decode
    worker decode batches too; times from a linear model with a little noise."""
    steps = []
    for i in range(count):
        if role == "decode" and i % 2:
            seqs = rng.randint(1, 32)
            context = seqs * rng.randint(64, 600)
            seconds = 0.004 + 0.0004 * seqs + 0.000002 * context
            steps.append(StepSample(0, 0, seqs, context, seconds * rng.uniform(0.95, 1.05)))
        else:
            tokens = rng.choice((16, 64, 128, 256, 512))
            seconds = 0.003 + 0.00008 * tokens
            steps.append(StepSample(tokens, tokens * tokens // 2, 0, 0, seconds * rng.uniform(0.95, 1.05),
                                    kv_blocks_sent=tokens // BLOCK_SIZE if role == "prefill" else 0,
                                    transfer_tail_s=0.0002 * tokens / BLOCK_SIZE if role == "prefill" else 0.0))
    return tuple(steps)


def fake_load(worker: str, role: str, rng: random.Random) -> WorkerLoad:
    running = rng.randint(0, 24) if role == "decode" else 0
    return WorkerLoad(worker, role, waiting=0, running=running, receiving=rng.randint(0, 2),
                      queued_prefill_tokens=rng.choice((0, 0, 128, 512, 2048)),
                      decode_context_tokens=running * rng.randint(100, 700), free_blocks=rng.randint(2000, 8000),
                      num_blocks=8192, block_size=BLOCK_SIZE, max_num_batched_tokens=2048, max_num_seqs=128,
                      steps=fake_steps(role, rng), next_slot_tokens=rng.randint(0, 64) if running else 0)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def populate(client, prefill: tuple[str, ...], decode: tuple[str, ...], workload: Workload) -> list[list[int]]:
    """Writes every worker's load report and KV blocks; returns the system prompts."""
    rng = random.Random(workload.seed)
    client.flushdb()
    systems = [tokens(rng, workload.system_tokens) for _ in range(workload.system_prompts)]
    held: dict[str, list[bytes]] = {w: [] for w in prefill + decode}
    for system in systems:
        chain = hash_token_blocks(system, BLOCK_SIZE, HASH_KEYS)
        for pool in (prefill, decode):
            for w in rng.sample(pool, min(workload.holders_per_role, len(pool))):
                held[w] += chain[:rng.randint(len(chain) // 2, len(chain))]
    for w in held:
        held[w] += hash_token_blocks(tokens(rng, workload.unrelated_blocks * BLOCK_SIZE), BLOCK_SIZE, HASH_KEYS)
        role = "prefill" if w in prefill else "decode"
        KVIndexPublisher(client, CLUSTER, w, heartbeat_ttl_s=REPORT_TTL_S).publish([BlockStored(tuple(held[w]))])
        publish_load(client, CLUSTER, fake_load(w, role, rng), REPORT_TTL_S)
    return systems


def prompts(systems: list[list[int]], count: int, workload: Workload) -> list[list[int]]:
    rng = random.Random(workload.seed + 1)
    out = []
    for _ in range(count):
        if rng.random() < workload.miss_fraction:
            out.append(tokens(rng, workload.system_tokens // 2))
        else:
            out.append(rng.choice(systems) + tokens(rng, workload.user_tokens))
    return out


def republish_loads(url: str, workers: list[tuple[str, str]], interval_s: float, stop, seed: int) -> None:
    """The ``live`` regime's reporters: every worker's report rewritten every ``interval_s``,
    each time with one new step (so the router refits its model), until ``stop`` is set."""
    client = connect(url, timeout_s=5.0)
    rng = random.Random(seed)
    loads = {w: fake_load(w, role, rng) for w, role in workers}
    while not stop.is_set():
        started = time.monotonic()
        pipe = client.pipeline(transaction=False)
        for w, role in workers:
            old = loads[w]
            loads[w] = replace(old, steps=old.steps[1:] + fake_steps(role, rng, 1), updated_at=time.time())
            pipe.set(f"tandem:{CLUSTER}:worker:{w}:load", loads[w].to_json(), px=int(REPORT_TTL_S * 1000))
        pipe.execute()
        stop.wait(max(0.0, interval_s - (time.monotonic() - started)))


class RoundTrips:
    """Counts a Redis client's round trips: each command it sends on its own (a script call
    included) and each pipeline's execute."""

    def __init__(self, client):
        self.count = 0
        send, pipeline = client.execute_command, client.pipeline

        def counted_send(*args, **kwargs):
            self.count += 1
            return send(*args, **kwargs)

        def counted_pipeline(*args, **kwargs):
            pipe = pipeline(*args, **kwargs)
            execute = pipe.execute

            def counted_execute(*a, **k):
                self.count += 1
                return execute(*a, **k)

            pipe.execute = counted_execute
            return pipe

        client.execute_command, client.pipeline = counted_send, counted_pipeline


def command_counts(client) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in client.info("commandstats").items()}


def new_router(client, prefill, decode, config: RouterConfig) -> Router:
    topology = Topology(prefill, decode, BLOCK_SIZE, HASH_KEYS)
    return Router(topology, RedisRegistryView(client, CLUSTER), config)


def place_all(router: Router, requests: list[list[int]], inflight: int, workload: Workload,
              timings: list[float] | None = None, actions: dict[str, int] | None = None,
              deadline: float = float("inf")) -> int:
    """Routes the prompts (until ``deadline``, a ``perf_counter`` time), keeping at most
    ``inflight`` placements open (the oldest is told finished, with a service TTFT near its
    prediction, when a new one is placed); returns how many it routed."""
    open_ids: list[str] = []
    for i, prompt in enumerate(requests):
        if time.perf_counter() > deadline:
            return i
        request = RouteRequest(request_id=f"r{i}", prompt_token_ids=prompt, max_tokens=workload.max_tokens, arrival=time.time())
        started = time.perf_counter()
        decision = router.route(request)
        if timings is not None:
            timings.append(time.perf_counter() - started)
        if actions is not None:
            actions[decision.action] = actions.get(decision.action, 0) + 1
        if decision.action == "place":
            open_ids.append(request.request_id)
            if len(open_ids) > inflight:
                done = open_ids.pop(0)
                placed = router.inflight.get(done)
                predicted = placed.decision.predicted_ttft_s if placed else None
                router.finished(done, predicted * 1.1 if predicted else None)
    return len(requests)


def measure(url: str, n_workers: int, regime: str, placements: int, seconds: float, workload: Workload,
            config: RouterConfig, progress: bool = True, profile: str | None = None) -> RunResult:
    """One row: fills the registry for ``n_workers``, counts Redis traffic over a short pass,
    then times ``placements`` routes (or as many as fit in ``seconds``); ``profile`` (a
    pstats sort key) prints where the timed pass spent its time."""
    client = connect(url, timeout_s=10.0)
    prefill, decode = worker_names(n_workers)
    systems = populate(client, prefill, decode, workload)
    stop = multiprocessing.get_context("spawn").Event() if regime == "live" else None
    reporter = None
    if regime == "live":
        roles = [(w, "prefill") for w in prefill] + [(w, "decode") for w in decode]
        reporter = multiprocessing.get_context("spawn").Process(
            target=republish_loads, args=(url, roles, LIVE_REPORT_EVERY_S, stop, workload.seed), daemon=True)
        reporter.start()
        time.sleep(2 * LIVE_REPORT_EVERY_S)
    inflight = 8 * len(decode)
    try:
        # Redis traffic: a counted pass on its own router, with the counting wrapper.
        counted = connect(url, timeout_s=10.0)
        trips = RoundTrips(counted)
        count_requests = prompts(systems, min(400, placements), workload)
        warm = new_router(counted, prefill, decode, config)
        place_all(warm, count_requests[:20], inflight, workload)
        before, trips_before = command_counts(client), trips.count
        n = max(1, place_all(warm, count_requests[20:], inflight, workload,
                             deadline=time.perf_counter() + seconds / 3))
        after = command_counts(client)
        commands = {name: (after[name] - before.get(name, 0)) / n for name in after
                    if name != "info" and after[name] - before.get(name, 0)}
        if regime == "live":  # the reporters' writes are theirs, not the router's
            commands.pop("set", None)
        round_trips = (trips.count - trips_before) / n

        # The timed pass.
        router = new_router(client, prefill, decode, config)
        requests = prompts(systems, placements, workload)
        warm_up = place_all(router, requests[:50], inflight, workload,  # models fitted, connections open
                            deadline=time.perf_counter() + seconds / 5)
        timings: list[float] = []
        actions: dict[str, int] = {}
        profiler = None
        if profile:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        deadline = wall0 + seconds
        chunk = 200
        for start in range(warm_up, len(requests), chunk):
            place_all(router, requests[start:start + chunk], inflight, workload, timings, actions, deadline)
            if progress:
                print(f"\r[bench] control plane, {n_workers} workers, {regime} reports: {len(timings)} placements, "
                      f"{len(timings) / sum(timings):.0f}/s   ", end="", file=sys.stderr, flush=True)
            if time.perf_counter() > deadline:
                break
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        if profiler is not None:
            import pstats

            profiler.disable()
            print(file=sys.stderr)
            pstats.Stats(profiler, stream=sys.stdout).sort_stats(profile).print_stats(25)
        if progress:
            print(file=sys.stderr)
    finally:
        if reporter is not None:
            stop.set()
            reporter.join(timeout=10)
            if reporter.is_alive():
                reporter.terminate()
    ordered = sorted(timings)
    return RunResult(n_workers, regime, len(timings), sum(timings), cpu_s, wall_s, actions,
                     router.counters.local_prefills, commands, round_trips,
                     ordered[len(ordered) // 2] * 1e6, ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6)


def run_sweep(worker_counts: list[int], regimes: list[str], placements: int, seconds: float,
              workload: Workload = Workload(), config: RouterConfig | None = None, profile: str | None = None
              ) -> list[RunResult]:
    config = config or RouterConfig()
    results = []
    with LocalRedis() as redis_server:
        for n in worker_counts:
            for regime in regimes:
                results.append(measure(redis_server.url, n, regime, placements, seconds, workload, config,
                                       profile=profile))
    return results


def result_rows(results: list[RunResult]) -> list[tuple]:
    rows = []
    for r in results:
        top = sorted(r.commands.items(), key=lambda kv: -kv[1])[:3]
        rows.append((r.workers, r.regime, r.placements, f"{r.per_second:,.0f}", f"{r.placements / r.cpu_s:,.0f}",
                     f"{r.p50_us:,.0f}", f"{r.p99_us:,.0f}", f"{r.cpu_s / r.wall_s:.0%}",
                     f"{r.commands_per_placement:.1f}",
                     f"{r.round_trips:.2f}", ", ".join(f"{k} {v:.1f}" for k, v in top),
                     " ".join(f"{k} {v}" for k, v in sorted(r.actions.items())), r.local))
    return rows


RESULT_HEADERS = ("workers", "reports", "placements", "placements/s", "per CPU-s", "p50 us", "p99 us", "CPU of wall",
                  "Redis cmds/placement", "round trips", "top commands", "decisions", "local prefills")


def plot(path: Path, results: list[RunResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, ops) = plt.subplots(1, 2, figsize=(11, 4.2))
    for regime in sorted({r.regime for r in results}):
        mine = [r for r in results if r.regime == regime]
        xs = [r.workers for r in mine]
        rate.plot(xs, [r.per_second for r in mine], marker="o", label=f"{regime} reports")
        ops.plot(xs, [r.commands_per_placement for r in mine], marker="o", label=f"Redis commands, {regime}")
        ops.plot(xs, [r.round_trips for r in mine], marker="s", linestyle="--", label=f"round trips, {regime}")
    rate.axhline(2000, color="grey", linestyle=":", label="goal at 16 workers")
    for axis in (rate, ops):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("workers (half prefill, half decode)")
        axis.legend(fontsize=8)
    rate.set_yscale("log")
    rate.set_ylabel("placements per second (one router)")
    rate.set_title("router placements/s")
    ops.set_ylabel("per placement")
    ops.set_title("Redis operations per placement")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    from common import machine_rows, print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--regimes", nargs="+", default=["static", "live"], choices=["static", "live"])
    parser.add_argument("--placements", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=20.0, help="bound of each row's timed pass")
    parser.add_argument("--profile", nargs="?", const="tottime", choices=["tottime", "cumulative"],
                        help="cProfile the timed passes: the top 25 functions by own (or cumulative) time")
    args = parser.parse_args()
    results = run_sweep(args.workers, args.regimes, args.placements, args.seconds, profile=args.profile)
    print_table("machine", machine_rows())
    print_table("router placements against a real Redis (one router, policy slo)", result_rows(results),
                RESULT_HEADERS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
