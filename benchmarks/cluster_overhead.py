"""What the cluster costs over the colocated engine, and what its control plane costs per
placement, side by side in one run.

(a) Added latency at concurrency 1: the same prompts (32 tokens) sent one at a time through the
    gRPC API of a local cluster (``tandem up``: 1 prefill + 1 decode worker, the router, one
    ingress replica) and given to the colocated engine (``LLM.generate``) in this process, with
    the torch thread count each worker gets; end-to-end time at the client for 1 and 16 tokens
    out, and where the cluster's time goes (the ingress's timings).
    Goal: the cluster adds <= 5 ms to a one-token request.
(b) Requests per second through the API against the colocated engine on the same prompts:
    short requests (32 tokens in, 4 out) and long ones (64 in, 128 out), each at 32 and 256
    concurrent streams (closed loop: each stream sends its next request when the last ended;
    the colocated engine keeps as many requests in flight), in the ``batch`` SLO class unless
    told otherwise (no objectives: admission holds nothing back, as the engine holds nothing).
    The colocated engine runs twice per cell, as two sides: with the torch threads of one worker
    (the cores divided between the two workers), and with every core of the machine, as a user
    of this machine would run ``LLM.generate`` (``--colocated-threads`` adds or removes sides);
    each row gives the cluster's requests/s over that side's. The client is one asyncio process
    (grpc.aio); its CPU time is reported, so it can be seen not to be the bottleneck.
    Goal: the API delivers >= 0.8x the colocated engine's requests/s (a worker's threads).
    Where the cluster's CPU goes (``--no-profile`` turns it off): after the measured cells, each
    workload's cluster cell runs once more at the highest concurrency while py-spy samples the
    ingress replica, the decode worker and the prefill worker (attached to their pids, found in
    /proc; ``--nonblocking``, so no process is paused, yet reading three processes 100 times a
    second cost about half a core of system time on a 2-core machine: that is why the measured
    cells are not profiled), and /proc gives each process's CPU per thread. A table per process, per workload:
    CPU ms per request and per output token in buckets (gRPC/asyncio I/O, msgpack/protobuf/stream
    codec, router placement, registry/Redis, engine step/model forward, sampling, detokenize,
    tracing/metrics, the request path's own code, Ray, other: each thread's CPU split over the
    buckets of its own samples), and the threads py-spy has no sample of (native ones: Ray's
    core worker, gRPC's C core) by name; then the busiest frames. The collapsed stacks go
    to ``cluster_overhead_profile_<process>_<workload>.txt`` (``benchmarks/cluster_profile.py``
    says how samples are bucketed). Without py-spy (``pip install py-spy``, in the ``bench``
    extra) or when it cannot read the processes, the report says why and the rest runs as ever.
(c) Router placements per second against a real Redis with 16 registered workers (their load
    reports and KV blocks). Goal: >= 2,000/s per router replica.
(d) The same control plane with fake registry entries for 16, 64 and 256 workers (half prefill,
    half decode): placements/s and Redis operations per placement as the cluster grows, with
    reports that never change and with reports rewritten every 100 ms (``control_plane.py``).

The sides take turns while the cluster is up (request by request in (a), cell by cell in (b);
the cluster idles during the engine's turns), so load from other processes that comes and goes
falls on every side alike; the control plane's parts run after the cluster is stopped. Every
part is bounded in requests and seconds and shows progress; the cluster is stopped (``tandem
down``) at the end, also on Ctrl-C or an error.

    .venv/bin/python benchmarks/cluster_overhead.py            # about 15 minutes on a 2-core CPU
    .venv/bin/python benchmarks/cluster_overhead.py --parts a b  # only the cluster-vs-engine parts
    .venv/bin/python benchmarks/cluster_overhead.py --parts a b --latency-requests 5 --short-requests 64 \
        --long-requests 16 --concurrency 8 --cell-seconds 20 --results-dir /tmp/smoke  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common import REPO_ROOT, ensure_checkpoint, machine_rows, num_cores, percentile, print_table
import cluster_profile
from local_cluster import LocalCluster, free_port, stop_on_sigterm

RESULTS = REPO_ROOT / "benchmarks" / "results"
CLUSTER = "bench-overhead"
LATENCY_PROMPT_TOKENS = 32
LATENCY_OUTPUTS = (1, 16)
WORKLOADS = {"short": (32, 4), "long": (64, 128)}  # prompt tokens, output tokens
MAX_NUM_SEQS = 256
KV_BLOCKS = 4096
IDLE_SAMPLE_S = 3.0


@dataclass
class Latencies:
    side: str
    output_tokens: int
    seconds: list[float]  # at the client
    placement_s: list[float] = field(default_factory=list)  # the cluster's, at the ingress: arrival to placement
    ingress_s: list[float] = field(default_factory=list)  # ... arrival to the last token

    @property
    def p50(self) -> float:
        return statistics.median(self.seconds)

    @property
    def p90(self) -> float:
        return percentile(self.seconds, 0.9)


@dataclass
class Cell:
    side: str
    workload: str
    concurrency: int
    requests: int
    seconds: float
    cpu_s: float  # this process's CPU time: the engine's (colocated) or the client's (cluster)
    machine_busy: float  # share of the machine's CPU time busy over the cell, every process counted
    failed: int = 0
    local_prefills: int = 0

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else float("nan")


class CpuMeter:
    """Busy share of the whole machine (from /proc/stat) and this process's CPU time, between
    start and stop."""

    def __enter__(self) -> "CpuMeter":
        self._machine, self._process = _machine_ticks(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        busy, total = (b - a for a, b in zip(self._machine, _machine_ticks()))
        self.machine_busy = busy / total if total else float("nan")
        self.process_s = time.process_time() - self._process


def _machine_ticks() -> tuple[int, int]:
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


def make_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def cell_seed(workload: str, concurrency: int) -> int:
    return 1000 * (1 + list(WORKLOADS).index(workload)) + concurrency


def requests_for(args, workload: str, concurrency: int) -> int:
    wanted = args.short_requests if workload == "short" else args.long_requests
    return max(wanted, 2 * concurrency)


def progress(label: str, done: int, total: int, started: float) -> None:
    print(f"\r[bench] {label}: {done}/{total} requests, {time.perf_counter() - started:.0f}s   ", end="",
          file=sys.stderr, flush=True)


# -- the colocated engine ---------------------------------------------------------------------

def colocated_side(threads: int) -> str:
    return f"colocated, {threads} thread{'s' if threads > 1 else ''}"


def side_label(side: str, worker_threads: int) -> str:
    """A side as the tables show it: which colocated side has a worker's threads, which every core."""
    roles = [role for threads, role in ((worker_threads, "a worker's threads"), (num_cores(), "every core"))
             if side == colocated_side(threads)]
    return f"{side} ({', '.join(roles)})" if roles else side


class Colocated:
    """The colocated engine in this process, run with a given torch thread count. Each run
    starts from an empty prefix cache: every side sees the same prompts, the first time."""

    def __init__(self, model_dir: Path):
        from cluster.offline.llm import LLM

        self.llm = LLM(str(model_dir), verbose=False, max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=KV_BLOCKS)

    def _fresh(self, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        blocks = self.llm.engine.block_manager
        blocks.reset_prefix_cache()
        blocks.drain_events()

    def one(self, prompt: list[int], out: int, threads: int) -> float:
        """``LLM.generate`` of one prompt; its seconds."""
        from cluster.engine.sampling_params import SamplingParams

        self._fresh(threads)
        started = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
        return time.perf_counter() - started

    def cell(self, workload: str, prompts: list[list[int]], out: int, concurrency: int, cap_s: float,
             threads: int) -> Cell:
        """Keeps ``concurrency`` requests in the engine until every prompt ran (or ``cap_s``
        passed: then no new ones start, those running finish)."""
        from cluster.engine.sampling_params import SamplingParams

        self._fresh(threads)
        engine = self.llm.engine
        params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
        label = f"{colocated_side(threads)}, {workload}, {concurrency} streams"
        sent = inflight = done = 0
        last_report = started = time.perf_counter()
        with CpuMeter() as cpu:
            while sent < len(prompts) or inflight:
                while inflight < concurrency and sent < len(prompts) and time.perf_counter() - started < cap_s:
                    engine.add_request(f"{workload}-{concurrency}-{threads}-{sent}", prompts[sent], params)
                    sent += 1
                    inflight += 1
                if not inflight:
                    break
                for output in engine.step():
                    if output.finished:
                        inflight -= 1
                        done += 1
                if time.perf_counter() - last_report > 2:
                    last_report = time.perf_counter()
                    progress(label, done, len(prompts), started)
            elapsed = time.perf_counter() - started
        progress(label, done, len(prompts), started)
        print(file=sys.stderr)
        return Cell(colocated_side(threads), workload, concurrency, done, elapsed, cpu.process_s, cpu.machine_busy)

    def shutdown(self) -> None:
        self.llm.shutdown()


# -- the cluster through the gRPC API ---------------------------------------------------------

def topology(model_dir: Path, threads: int) -> dict:
    pool = {"threads": threads, "max_num_seqs": MAX_NUM_SEQS}
    return {"model": {"path": str(model_dir)}, "server": {"port": free_port(), "http_port": 0}, "prefill": pool,
            "decode": pool,
            "kv": {"num_blocks": KV_BLOCKS}}


def generate_request(prompt: list[int], out: int, slo_class: str = ""):
    from tandem.v1 import tandem_pb2

    request = tandem_pb2.GenerateRequest(token_ids=tandem_pb2.TokenIds(ids=prompt), slo_class=slo_class)
    request.sampling.max_tokens = out
    request.sampling.temperature = 0.0
    request.sampling.ignore_eos = True
    return request


@dataclass
class Reply:
    ok: bool
    local: bool = False  # prefilled on the decode worker
    queue_ms: float = 0.0  # at the ingress: arrival to placement (the router's answer)
    e2e_ms: float = 0.0  # at the ingress: arrival to the last token


async def one_request(stub, prompt: list[int], out: int, slo_class: str = "") -> Reply:
    """Sends one request and reads its stream to the end."""
    import grpc

    reply = Reply(True)
    try:
        async for message in stub.Generate(generate_request(prompt, out, slo_class), timeout=600):
            if message.decode_worker:
                reply.local = not message.prefill_worker
            if message.finished:
                reply.queue_ms, reply.e2e_ms = message.timings.queue_ms, message.timings.e2e_ms
    except grpc.aio.AioRpcError as exc:
        print(f"\n[bench] request failed: {exc.code().name}: {(exc.details() or '')[:200]}", file=sys.stderr)
        return Reply(False)
    return reply


async def cluster_cell(stub, workload: str, prompts: list[list[int]], out: int, concurrency: int, args) -> Cell:
    label = f"cluster, {workload}, {concurrency} streams"
    next_index, done, failed, local = 0, 0, 0, 0
    started = time.perf_counter()

    async def stream() -> None:
        nonlocal next_index, done, failed, local
        while next_index < len(prompts) and time.perf_counter() - started < args.cell_seconds:
            prompt = prompts[next_index]
            next_index += 1
            reply = await one_request(stub, prompt, out, args.slo_class)
            done += reply.ok
            failed += not reply.ok
            local += reply.local

    async def report() -> None:
        while True:
            await asyncio.sleep(2)
            progress(label, done, len(prompts), started)

    with CpuMeter() as cpu:
        reporter = asyncio.create_task(report())
        try:
            await asyncio.gather(*(stream() for _ in range(concurrency)))
        finally:
            reporter.cancel()
        elapsed = time.perf_counter() - started
    progress(label, done, len(prompts), started)
    print(file=sys.stderr)
    return Cell("cluster", workload, concurrency, done, elapsed, cpu.process_s, cpu.machine_busy, failed, local)


async def side_by_side(api: str, colocated: Colocated, args, vocab: int, threads: list[int],
                       profiler: cluster_profile.ClusterProfiler | None = None
                       ) -> tuple[list[Latencies], list[Cell]]:
    """(a) request by request, the sides taking turns; (b) cell by cell, the sides taking
    turns: load from other processes that comes and goes falls on every side alike. The
    profiler, if any, samples the cluster's processes over one more cluster cell per workload,
    after the measured ones."""
    import grpc

    from tandem.v1 import tandem_pb2_grpc

    latencies, cells = [], []
    async with grpc.aio.insecure_channel(api) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        for prompt in make_prompts(4, LATENCY_PROMPT_TOKENS, vocab, seed=99):  # warm both
            await one_request(stub, prompt, 4)
            for t in threads:
                colocated.one(prompt, 4, t)
        for out in LATENCY_OUTPUTS:
            rows = {t: Latencies(colocated_side(t), out, []) for t in threads}
            rows["cluster"] = Latencies("cluster", out, [])
            started = time.perf_counter()
            prompts = make_prompts(args.latency_requests, LATENCY_PROMPT_TOKENS, vocab, seed=out)
            for i, prompt in enumerate(prompts):
                engine_s = {t: colocated.one(prompt, out, t) for t in threads}
                sent = time.perf_counter()
                reply = await one_request(stub, prompt, out)
                if reply.ok:  # a round counts for every side or for none: they are compared pairwise
                    for t, seconds in engine_s.items():
                        rows[t].seconds.append(seconds)
                    rows["cluster"].seconds.append(time.perf_counter() - sent)
                    rows["cluster"].placement_s.append(reply.queue_ms / 1e3)
                    rows["cluster"].ingress_s.append(reply.e2e_ms / 1e3)
                progress(f"concurrency 1, {out} token(s) out, every side", i + 1, len(prompts), started)
            print(file=sys.stderr)
            latencies += rows.values()
        for workload, (prompt_tokens, out) in WORKLOADS.items():
            for concurrency in args.concurrency:
                n = requests_for(args, workload, concurrency)
                prompts = make_prompts(n, prompt_tokens, vocab, seed=cell_seed(workload, concurrency))
                for t in threads:
                    cells.append(colocated.cell(workload, prompts, out, concurrency, args.cell_seconds, t))
                cells.append(await cluster_cell(stub, workload, prompts, out, concurrency, args))
        if profiler is not None:  # after the measured cells: sampling costs CPU that they must not pay
            for workload, (prompt_tokens, out) in WORKLOADS.items():
                concurrency = max(args.concurrency)
                prompts = make_prompts(requests_for(args, workload, concurrency), prompt_tokens, vocab,
                                       seed=cell_seed(workload, concurrency))
                with profiler.cell(workload) as profiled:
                    cell = await cluster_cell(stub, workload, prompts, out, concurrency, args)
                    profiled.requests, profiled.tokens = cell.requests, cell.requests * out
    return latencies, cells


def run_side_by_side(args, model_dir: Path, threads: list[int], vocab: int, worker_threads: int
                     ) -> tuple[list[Latencies], list[Cell], dict | None, float, cluster_profile.ClusterProfiler | None]:
    with LocalCluster(CLUSTER, topology(model_dir, worker_threads)) as cluster:
        profiler = None
        if args.profile:
            profiler = cluster_profile.ClusterProfiler(cluster.cache, cluster.cache / "profiles")
            if profiler.problem:
                print(f"[bench] profile skipped: {profiler.problem}", file=sys.stderr, flush=True)
            else:
                print("[bench] profiling one more cluster cell per workload with py-spy: "
                      + ", ".join(f"{name} pid {pid}" for name, pid in profiler.pids.items()), file=sys.stderr,
                      flush=True)
        colocated = Colocated(model_dir)
        try:
            with CpuMeter() as idle:
                time.sleep(IDLE_SAMPLE_S)
            latencies, cells = asyncio.run(side_by_side(cluster.api, colocated, args, vocab, threads, profiler))
        finally:
            colocated.shutdown()
        status = cluster.status()
    return latencies, cells, status, idle.machine_busy, profiler


# -- the report ---------------------------------------------------------------------------------

def latency_rows(latencies: list[Latencies], worker_threads: int) -> list[tuple]:
    rows = []
    for out in LATENCY_OUTPUTS:
        mine = [x for x in latencies if x.output_tokens == out]
        cluster = next(x for x in mine if x.side == "cluster")
        for x in mine:
            added = "" if x is cluster else f"{added_s(cluster, x) * 1e3:+.1f}"
            added_p50 = "" if x is cluster else f"{(cluster.p50 - x.p50) * 1e3:+.1f}"
            added_p90 = "" if x is cluster else f"{(cluster.p90 - x.p90) * 1e3:+.1f}"
            rows.append((f"{LATENCY_PROMPT_TOKENS} in, {out} out", side_label(x.side, worker_threads), len(x.seconds), f"{x.p50 * 1e3:.1f}",
                         f"{x.p90 * 1e3:.1f}", added, added_p50, added_p90))
    return rows


def added_s(cluster: Latencies, other: Latencies) -> float:
    """The median of the rounds' differences (the same prompt, one right after the other)."""
    return statistics.median(c - o for c, o in zip(cluster.seconds, other.seconds))


def breakdown_rows(latencies: list[Latencies], baseline_side: str) -> list[tuple]:
    rows = []
    for out in LATENCY_OUTPUTS:
        cluster = next(x for x in latencies if x.output_tokens == out and x.side == "cluster")
        baseline = next(x for x in latencies if x.output_tokens == out and x.side == baseline_side)
        hop = statistics.median(c - i for c, i in zip(cluster.seconds, cluster.ingress_s))
        work = statistics.median(i - p for i, p in zip(cluster.ingress_s, cluster.placement_s))
        rows.append((f"{LATENCY_PROMPT_TOKENS} in, {out} out", f"{cluster.p50 * 1e3:.1f}",
                     f"{statistics.median(cluster.ingress_s) * 1e3:.1f}", f"{hop * 1e3:.1f}",
                     f"{statistics.median(cluster.placement_s) * 1e3:.1f}", f"{work * 1e3:.1f}",
                     f"{baseline.p50 * 1e3:.1f}"))
    return rows


def throughput_rows(cells: list[Cell], worker_threads: int) -> list[tuple]:
    rows = []
    for workload, (prompt_tokens, out) in WORKLOADS.items():
        for concurrency in sorted({c.concurrency for c in cells}):
            mine = [c for c in cells if c.workload == workload and c.concurrency == concurrency]
            cluster = next(c for c in mine if c.side == "cluster")
            for c in mine:
                rows.append((f"{workload} ({prompt_tokens} in, {out} out)", concurrency,
                             side_label(c.side, worker_threads), c.requests,
                             f"{c.seconds:.1f}", f"{c.per_second:.1f}",
                             "" if c is cluster else f"{cluster.per_second / c.per_second:.2f}x",
                             f"{c.machine_busy:.0%}", f"{c.cpu_s / c.seconds:.0%}",
                             f"{c.local_prefills}/{c.requests}" if c is cluster else "", c.failed))
    return rows


def ratio_goal(cells: list[Cell], side: str) -> float:
    """The cluster's worst requests/s ratio to one colocated side, over every cell."""
    ratios = []
    for c in cells:
        if c.side == side:
            cluster = next(k for k in cells if k.side == "cluster" and (k.workload, k.concurrency)
                           == (c.workload, c.concurrency))
            ratios.append(cluster.per_second / c.per_second)
    return min(ratios)


def report_profile(profiler: cluster_profile.ClusterProfiler, folder: Path) -> list[str]:
    """Prints where each profiled process's CPU went in (b)'s profiled cluster cells; writes the raw
    profiles; returns the lines for the summary."""
    if profiler.problem:
        return [f"(b) profile: none ({profiler.problem})"]
    for name, labels in profiler.profiles.items():
        spans = ", ".join(f"{label}: {p.requests} requests, {p.tokens} tokens out, {p.cpu_s:.1f} CPU s, "
                          f"{sum(p.stacks.values())} samples" for label, p in labels.items())
        print_table(f"(b) the {name}'s CPU in a profiled cluster cell, per request and per output token ({spans}; "
                    "each thread's CPU split over the buckets of its own py-spy samples; threads without samples, "
                    "native ones, by name)",
                    cluster_profile.bucket_rows(labels), cluster_profile.bucket_headers(labels))
        print_table(f"(b) the {name}'s busiest frames (self time, share of the process's CPU)",
                    cluster_profile.self_frame_rows(labels), ("frame", "bucket", "share"))
    written = cluster_profile.write_profiles(profiler, folder, "cluster_overhead_profile")
    return [f"(b) profiles (collapsed stacks): {', '.join(str(p) for p in written)}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["a", "b", "c", "d"], choices=["a", "b", "c", "d"],
                        help="a and b run together (one cluster); c is d's 16-worker row")
    parser.add_argument("--threads", type=int, help="torch threads of each worker and of the colocated engine "
                                                    "(default: the cores divided between the two workers)")
    parser.add_argument("--colocated-threads", type=int, nargs="*", default=None,
                        help="more thread counts to run the colocated engine with, as more sides (default: "
                             "every core, as a user of this machine would run LLM.generate; on a shared machine "
                             "its threads wait on each other; give none for only a worker's threads)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--latency-requests", type=int, default=40, help="requests per row of (a)")
    parser.add_argument("--short-requests", type=int, default=512, help="short requests per cell of (b)")
    parser.add_argument("--long-requests", type=int, default=64, help="long requests per cell (at least 2x streams)")
    parser.add_argument("--cell-seconds", type=float, default=90.0, help="no new requests in a cell after this")
    parser.add_argument("--slo-class", default="batch",
                        help="SLO class of (b)'s requests (default batch: no objectives, so the router's "
                             "admission holds none back, as the colocated engine holds none)")
    parser.add_argument("--control-placements", type=int, default=5000, help="placements per row of (c)/(d)")
    parser.add_argument("--control-seconds", type=float, default=15.0, help="bound of each (c)/(d) row's timing")
    parser.add_argument("--model-dir", help="checkpoint folder to reuse or build (default: the 30M benchmark model)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="no py-spy profile of the ingress and workers (one more cluster cell per workload, "
                             "after (b)'s)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS,
                        help=f"where the JSON, the profiles and the plot go (default {RESULTS})")
    args = parser.parse_args()
    stop_on_sigterm()

    worker_threads = args.threads or max(1, num_cores() // 2)
    extra = [num_cores()] if args.colocated_threads is None else args.colocated_threads
    colocated_threads = sorted({worker_threads, *extra})
    report: dict = {"worker_threads": worker_threads, "colocated_threads": colocated_threads}
    latencies = cells = control = profiler = None
    if {"a", "b"} & set(args.parts):
        from transformers import LlamaConfig

        model_dir, params = ensure_checkpoint(args.model_dir)
        vocab = LlamaConfig.from_pretrained(model_dir).vocab_size
        report["model"] = f"{model_dir} (random Llama, {params / 1e6:.0f}M parameters)"
        latencies, cells, status, idle_busy, profiler = run_side_by_side(args, model_dir, colocated_threads, vocab,
                                                                         worker_threads)
        report.update(latency=[asdict(x) for x in latencies], throughput=[asdict(x) for x in cells],
                      router=(status or {}).get("router"), idle_machine_busy=idle_busy)
        if profiler and not profiler.problem:
            report["profile"] = cluster_profile.summary(profiler)
    if {"c", "d"} & set(args.parts):
        import control_plane

        counts = [16] if "d" not in args.parts else [16, 64, 256]
        regimes = ["static"] if "d" not in args.parts else ["static", "live"]
        control = control_plane.run_sweep(counts, regimes, args.control_placements, args.control_seconds)
        report["control_plane"] = [asdict(r) | {"per_second": r.per_second} for r in control]

    rows = machine_rows() + [("model", report.get("model", "-")),
                             ("torch threads", f"{worker_threads} per worker; colocated engine: "
                                               + " and ".join(map(str, colocated_threads))
                                               + f" (every core: {num_cores()})")]
    if "idle_machine_busy" in report:
        rows.append(("machine busy, cluster idle", f"{report['idle_machine_busy']:.0%} over {IDLE_SAMPLE_S:.0f}s "
                                                   "(other processes count)"))
    print_table("machine", rows)
    goals = []
    baseline = colocated_side(worker_threads)
    if latencies:
        print_table(f"(a) end-to-end latency at concurrency 1, ms at the client ({args.latency_requests} requests "
                    "per row, the sides taking turns; cluster: gRPC API, 1 prefill + 1 decode worker)",
                    latency_rows(latencies, worker_threads), ("request", "side", "n", "p50", "p90", "cluster adds (paired)",
                                              "cluster p50 - this p50", "cluster p90 - this p90"))
        one = {x.side: x for x in latencies if x.output_tokens == 1}
        added = added_s(one["cluster"], one[baseline]) * 1e3
        goals.append(f"(a) the cluster adds {added:.1f} ms to a one-token request over the {baseline} engine "
                     "(median of paired differences; goal <= 5 ms): " + ("met" if added <= 5 else "NOT met"))
        print_table("(a) where a cluster request's time goes, ms (p50s; the ingress times from the call's "
                    "arrival)", breakdown_rows(latencies, baseline),
                    ("request", "client e2e", "ingress e2e", "API hop (client - ingress)",
                     "placement (router)", "placed to last token", f"{baseline} e2e"))
        print_table(f"(b) requests/s, colocated engine vs the gRPC API (closed loop, the sides taking turns; "
                    f"slo_class {args.slo_class!r}; machine busy: every process counted; CPU: the engine's "
                    "process, or the client's; cluster/this: the cluster's requests/s over this side's)",
                    throughput_rows(cells, worker_threads),
                    ("workload", "streams", "side", "requests", "seconds", "requests/s", "cluster/this",
                     "machine busy", "CPU", "local prefills", "failed"))
        for t in colocated_threads:
            side = colocated_side(t)
            worst = ratio_goal(cells, side)
            goals.append(f"(b) worst cluster/{side_label(side, worker_threads)} requests/s ratio {worst:.2f}x "
                         "(goal >= 0.8x): " + ("met" if worst >= 0.8 else "NOT met"))
        if profiler:
            goals += report_profile(profiler, args.results_dir)
    if control:
        import control_plane

        print_table("(c)/(d) router placements against a real Redis (one Router, policy slo; fake workers, "
                    "half prefill, half decode)", control_plane.result_rows(control), control_plane.RESULT_HEADERS)
        sixteen = [r.per_second for r in control if r.workers == 16]
        goals.append(f"(c) placements/s with 16 workers {min(sixteen):,.0f} (goal >= 2,000 per router replica): "
                     + ("met" if min(sixteen) >= 2000 else "NOT met"))
        if "d" in args.parts:
            args.results_dir.mkdir(parents=True, exist_ok=True)
            png = args.results_dir / "control_plane.png"
            control_plane.plot(png, control)
            goals.append(f"(d) plot: {png}")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / "cluster_overhead.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    print("\n" + "\n".join(goals))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
