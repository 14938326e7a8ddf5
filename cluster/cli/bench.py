"""``tandem bench``: measure a running server with a workload, an arrival process and latency
objectives; and the workload flags it shares with ``tandem plan``.

    tandem bench --cluster NAME --rate 2 --num-requests 200 --goodput ttft_ms:500 tpot_ms:50
    tandem bench --openai-url http://127.0.0.1:8000 --workload mooncake --trace t.jsonl --arrival trace
    tandem bench --cluster NAME --sweep 1,2,4,8 --json out.json --plot-dir plots/

Exit status: 0 when the run finished (requests may have failed: the report counts them), 1
when the server cannot be reached, 2 on a usage error (one line naming the flag).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from cluster.bench.arrivals import ArrivalError, Arrivals
from cluster.bench.metrics import Objectives, class_objectives, parse_objectives, summarize, sweep_goodput
from cluster.bench.workloads import (FIRST_TOKEN_ID, WorkloadError, Workload, cap, chat, parse_length, read_mooncake,
                                     read_sharegpt, synthetic)

PROG = "tandem bench"
WORKLOADS = ("synthetic", "chat", "mooncake", "sharegpt")
SWEEP_SEED_STRIDE = 1000  # each sweep point's prompts are fresh (no cache hits from the point before)


class UsageError(ValueError):
    """A bad flag; the message names it."""


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    """Workload, arrival and objective flags: the same for ``bench`` and ``plan``."""
    w = parser.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="synthetic",
                   help="synthetic (random prompts), chat (shared-prefix multi-turn), mooncake (a trace), "
                        "sharegpt (a dataset) (default: synthetic)")
    w.add_argument("--num-requests", type=int, default=200, metavar="N",
                   help="requests to send (turns, for chats) (default: 200)")
    w.add_argument("--input-len", default="64-512", metavar="DIST",
                   help="prompt tokens: N, MIN-MAX (uniform), normal:MEAN,STD or exp:MEAN (default: 64-512)")
    w.add_argument("--output-len", default="16-64", metavar="DIST", help="output tokens, as --input-len (default: 16-64)")
    w.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and Poisson arrivals (default: 0)")
    w.add_argument("--vocab-size", type=int, metavar="V",
                   help="token ids of random prompts are below this (default: the model's; 1000 over OpenAI)")
    w.add_argument("--turns", default="2-6", metavar="DIST", help="chat: turns per conversation (default: 2-6)")
    w.add_argument("--system-prompts", type=int, default=4, metavar="N",
                   help="chat: distinct system prompts the conversations share (default: 4)")
    w.add_argument("--system-len", default="256", metavar="DIST", help="chat: system prompt tokens (default: 256)")
    w.add_argument("--user-len", default="16-96", metavar="DIST", help="chat: tokens per user turn (default: 16-96)")
    w.add_argument("--think-s", type=float, default=1.0, metavar="S",
                   help="chat: seconds between an answer and the next turn (default: 1)")
    w.add_argument("--trace", metavar="FILE", help="mooncake: the trace (JSONL: timestamp, input_length, "
                                                   "output_length, hash_ids)")
    w.add_argument("--trace-block-tokens", type=int, default=512, metavar="N",
                   help="mooncake: tokens per hash id; below 512 scales every length by N/512 (default: 512)")
    w.add_argument("--dataset", metavar="FILE", help="sharegpt: the JSON file of conversations")
    w.add_argument("--multi-turn", action="store_true", help="sharegpt: every human turn, not only the first")
    w.add_argument("--tokenizer", metavar="DIR", help="a local model directory whose tokenizer turns text into ids "
                                                      "(sharegpt; --endpoint chat) (default: the server's Tokenize)")
    w.add_argument("--max-input-len", type=int, metavar="N", help="cap prompts at N tokens")
    w.add_argument("--max-output-len", type=int, metavar="N", help="cap outputs at N tokens")
    w.add_argument("--slo-class", metavar="NAME", help="SLO class every request names (default: the cluster's)")
    a = parser.add_argument_group("arrivals")
    a.add_argument("--arrival", choices=("poisson", "constant", "burst", "trace"), default="poisson",
                   help="poisson, constant, burst or trace (the trace's timestamps) (default: poisson)")
    a.add_argument("--rate", type=float, metavar="R", help="requests per second (sessions, for chats)")
    a.add_argument("--burst-size", type=int, default=8, metavar="N", help="burst: requests per burst (default: 8)")
    a.add_argument("--speedup", type=float, default=1.0, metavar="F", help="trace: divide its times by F (default: 1)")
    a.add_argument("--concurrency", type=int, metavar="N",
                   help="a closed loop of N clients instead of an arrival process")
    a.add_argument("--sweep", metavar="R1,R2,...", help="one run per rate")
    a.add_argument("--duration", type=float, default=600.0, metavar="S",
                   help="nothing is sent after S seconds (default: 600)")
    s = parser.add_argument_group("objectives")
    s.add_argument("--goodput", nargs="+", metavar="ttft_ms:N", default=None,
                   help="objectives for goodput and attainment: ttft_ms:N and/or tpot_ms:N "
                        "(default: each request's SLO class's)")


def check_counts(args: argparse.Namespace) -> None:
    for flag in ("num_requests", "system_prompts", "trace_block_tokens", "max_input_len", "max_output_len",
                 "vocab_size", "burst_size"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: must be at least 1, got {value}")
    if args.duration is not None and not args.duration > 0:
        raise UsageError(f"--duration: must be > 0 seconds, got {args.duration:g}")
    if args.concurrency is not None and (args.rate is not None or args.sweep):
        raise UsageError("--concurrency: a closed loop has no --rate or --sweep")


def objectives_of(args: argparse.Namespace) -> Objectives | None:
    if args.goodput is None:
        return None
    try:
        return parse_objectives(args.goodput)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def rates_of(args: argparse.Namespace) -> list[float | None]:
    """The rates to run: the sweep's, or --rate (None for a closed loop or a trace's own times)."""
    if args.sweep:
        try:
            rates = [float(r) for r in args.sweep.split(",") if r.strip()]
        except ValueError:
            raise UsageError(f"--sweep: expected rates like 1,2,4, got {args.sweep[:100]!r}") from None
        if not rates or any(r <= 0 for r in rates):
            raise UsageError(f"--sweep: rates must be > 0, got {args.sweep[:100]!r}")
        if args.arrival == "trace":
            raise UsageError("--sweep: a trace keeps its own times; sweep --speedup instead of rates")
        return rates
    if args.concurrency is None and args.arrival != "trace" and args.rate is None:
        raise UsageError(f"--rate: {args.arrival} arrivals need a rate (or give --concurrency or --sweep)")
    return [args.rate]


def arrivals_of(args: argparse.Namespace, rate: float | None, index: int = 0) -> Arrivals:
    try:
        if args.concurrency is not None:
            return Arrivals("concurrency", concurrency=args.concurrency)
        return Arrivals(args.arrival, rate=rate, burst_size=args.burst_size, speedup=args.speedup,
                        seed=args.seed + SWEEP_SEED_STRIDE * index)
    except ArrivalError as exc:
        raise UsageError(str(exc)) from None


def workload_of(args: argparse.Namespace, vocab_size: int, tokenize=None, index: int = 0) -> Workload:
    """The workload the flags describe; ``index`` (a sweep point) gives fresh prompts of the same shape."""
    seed = args.seed + SWEEP_SEED_STRIDE * index
    n = args.num_requests
    try:
        if args.workload == "synthetic":
            workload = synthetic(n, parse_length(args.input_len, "--input-len"),
                                 parse_length(args.output_len, "--output-len"), vocab_size, seed, args.slo_class)
        elif args.workload == "chat":
            workload = chat(n, parse_length(args.turns, "--turns"), args.system_prompts,
                            parse_length(args.system_len, "--system-len"), parse_length(args.user_len, "--user-len"),
                            parse_length(args.output_len, "--output-len"), args.think_s, vocab_size, seed,
                            args.slo_class)
        elif args.workload == "mooncake":
            if not args.trace:
                raise UsageError("--trace: --workload mooncake needs the trace file")
            workload = read_mooncake(args.trace, vocab_size, args.trace_block_tokens, seed, n, args.max_input_len,
                                     args.max_output_len, args.slo_class)
        else:
            if not args.dataset:
                raise UsageError("--dataset: --workload sharegpt needs the JSON file")
            if tokenize is None:
                raise UsageError("--tokenizer: --workload sharegpt needs a tokenizer (a local model directory)")
            # The same conversations at every sweep point (their texts are fixed; the server
            # tokenized exactly these): later points may hit the prefix cache of earlier ones.
            workload = read_sharegpt(args.dataset, tokenize, n, args.max_input_len, args.max_output_len,
                                     args.multi_turn, args.seed, args.slo_class)
    except WorkloadError as exc:
        raise UsageError(str(exc)) from None
    if args.workload in ("synthetic", "chat") and (args.max_input_len or args.max_output_len):
        workload = _capped_lengths(workload, args.max_input_len, args.max_output_len)
    return cap(workload, n)


def _capped_lengths(workload: Workload, max_input: int | None, max_output: int | None) -> Workload:
    from dataclasses import replace

    from cluster.bench.workloads import Turn

    sessions = tuple(replace(s, prefix=s.prefix[:max_input] if max_input else s.prefix,
                             turns=tuple(Turn(t.user[:max_input] if max_input else t.user,
                                              min(t.max_tokens, max_output or t.max_tokens)) for t in s.turns))
                     for s in workload.sessions)
    return replace(workload, sessions=sessions)


def signature(args: argparse.Namespace, workload: Workload) -> str:
    """What a prediction and a measurement of the same workload have in common (rates aside)."""
    arrival = f"concurrency={args.concurrency}" if args.concurrency else f"arrival={args.arrival}"
    return f"{workload.describe} n={args.num_requests} {arrival}"


def local_tokenizer(directory: str | None):
    """(encode, decode) of a local model's tokenizer, or (None, None)."""
    if not directory:
        return None, None
    from cluster.engine.tokenizer import Tokenizer, TokenizerError

    if not Path(directory).expanduser().exists():
        raise UsageError(f"--tokenizer: {directory} does not exist")
    try:
        tokenizer = Tokenizer(Path(directory).expanduser())
    except TokenizerError as exc:
        raise UsageError(f"--tokenizer: {exc}") from None
    return tokenizer.encode, tokenizer.decode


def cluster_topology(state: dict | None):
    """The topology a running cluster was started with (from its state file), or None."""
    if not state or not state.get("topology"):
        return None
    from cluster.topology import TopologyError, parse_topology

    try:
        return parse_topology(state["topology"], model_elsewhere=True)
    except TopologyError:
        return None


def topology_label(spec) -> str:
    parts = []
    for role, letter in (("prefill", "P"), ("decode", "D"), ("colocated", "C")):
        pool = spec.pool(role)
        if pool.replicas:
            parts.append(f"{pool.replicas}{letter}" + (f"(TP{pool.tp})" if pool.tp > 1 else ""))
    return "+".join(parts)


# -- the command ------------------------------------------------------------------------------


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="measure a running cluster (or any OpenAI-compatible server): latency, goodput, attainment",
        description="Drives a running server with a workload and reports TTFT, TPOT, ITL and end-to-end latency, "
                    "throughput, prefix-cache hit rate, and goodput and SLO attainment.")
    t = parser.add_argument_group("target (one of)")
    t.add_argument("--cluster", metavar="NAME", help="a cluster `tandem up` started here (its gRPC API)")
    t.add_argument("--addr", metavar="HOST:PORT", help="a Tandem gRPC API")
    t.add_argument("--openai-url", metavar="URL", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    t.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="with --cluster: its gRPC API or its OpenAI-compatible HTTP API (default: grpc)")
    t.add_argument("--model", help="OpenAI: the model name to send (default: the first of /v1/models)")
    t.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="OpenAI: /v1/completions (token-id prompts) or /v1/chat/completions (default: completions)")
    t.add_argument("--token-env", metavar="NAME", help="environment variable holding the bearer token / API key")
    t.add_argument("--tls-ca", metavar="FILE", help="gRPC: PEM CA certificates (connect with TLS)")
    add_workload_flags(parser)
    r = parser.add_argument_group("requests and output")
    r.add_argument("--send-objectives", action="store_true",
                   help="send the --goodput objectives with each request (Tandem's router then admits by them)")
    r.add_argument("--no-ignore-eos", action="store_true", help="let the model stop early (output lengths vary)")
    r.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per-request deadline (default: 300)")
    r.add_argument("--json", metavar="FILE", help="write every figure and every request's timings here")
    r.add_argument("--plot-dir", metavar="DIR", help="write latency CDFs (and a sweep's goodput curve) as PNGs here")
    r.add_argument("--label", default=None, help="name of this run in plots and the JSON (default: the target)")
    r.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(func=run_bench)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_bench(args))
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


def _target(args: argparse.Namespace):
    """(backend, label, the cluster's state or None)."""
    targets = [flag for flag in ("cluster", "addr", "openai_url") if getattr(args, flag)]
    if len(targets) != 1:
        raise UsageError("give one target: --cluster NAME, --addr HOST:PORT or --openai-url URL")
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise UsageError(f"--token-env: environment variable {args.token_env} is not set or empty")
    state = None
    if args.cluster:
        from cluster.deployment.state_file import read_state

        state = read_state(args.cluster)
        if not state or not state.get("api"):
            raise ConnectionError(f"--cluster: cluster {args.cluster!r} is not up here (no state file); "
                                  "give --addr")
    elif args.api != "grpc":
        raise UsageError("--api: only with --cluster (give --openai-url for another server)")
    url = args.openai_url
    if state is not None and args.api == "openai":
        url = state.get("http")
        if not url:
            raise UsageError(f"--api openai: cluster {args.cluster!r} serves no HTTP API (server.http_port)")
    if url:
        from cluster.bench.clients import OpenAIBackend

        _, decode = local_tokenizer(args.tokenizer)
        try:
            backend = OpenAIBackend(url, args.model or (state or {}).get("model"), token,
                                    chat=args.endpoint == "chat", detokenize=decode)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return backend, args.label or (f"{args.cluster} (OpenAI API)" if args.cluster else url), state
    from cluster.bench.clients import GrpcBackend

    address = state["api"] if state is not None else args.addr
    return GrpcBackend(address, token, args.tls_ca), args.label or args.cluster or address, state


async def _bench(args: argparse.Namespace) -> int:
    check_counts(args)
    objectives = objectives_of(args)
    rates = rates_of(args)
    if args.send_objectives and objectives is None:
        raise UsageError("--send-objectives: give the objectives with --goodput")
    if args.openai_url and args.send_objectives:
        raise UsageError("--send-objectives: only Tandem's gRPC API takes objectives per request")
    backend, label, state = _target(args)
    try:
        return await _measure(args, backend, label, state, objectives, rates)
    finally:
        await backend.close()


async def _measure(args, backend, label: str, state: dict | None, objectives: Objectives | None,
                   rates: list[float | None]) -> int:
    from cluster.bench import report
    from cluster.bench.clients import SendOptions
    from cluster.bench.runner import Limits, Progress, run
    from router.config import RouterConfig

    try:
        info = await backend.model_info()
    except Exception as exc:  # noqa: BLE001 - any failure to reach the server is reported as one line
        raise ConnectionError(f"cannot reach {label}: {_one_line(exc)}") from None
    vocab = args.vocab_size or info.get("vocab_size") or 1000
    encode, _ = local_tokenizer(args.tokenizer)
    if args.workload == "sharegpt" and encode is None and args.dataset and hasattr(backend, "tokenize"):
        encode = await _server_tokenizer(args, backend)
    spec = cluster_topology(state)
    classes = class_objectives(spec.router if spec is not None else RouterConfig())
    # A request sent without a class is the cluster's default class's, judged by its objectives
    # (a cluster whose topology is not known here: by none).
    default_class = spec.router.default_class if spec is not None else None
    options = SendOptions(ignore_eos=not args.no_ignore_eos, send_objectives=objectives if args.send_objectives
                          else None, timeout_s=args.timeout)
    points, runs, out = [], {}, {"target": label, "model": info.get("name"), "rates": []}
    for index, rate in enumerate(rates):
        workload = workload_of(args, vocab, encode, index)
        if index == 0:
            base_signature = signature(args, workload)
        arrivals = arrivals_of(args, rate, index)
        progress = None if args.quiet else Progress(workload.requests, args.duration, label=f"bench {arrivals.describe()}")
        results = await run(backend, workload, arrivals, Limits(args.duration), options, progress)
        summary = summarize(results, objectives, classes, default_class)
        title = f"{label}: {workload.describe}; {arrivals.describe()}"
        print(report.format_summary(summary, title), flush=True)
        print(flush=True)
        points.append((rate, summary))
        runs[f"{label} @ {arrivals.describe()}"] = results
        out["rates"].append({"rate": rate, "arrivals": arrivals.describe(), "workload": workload.describe,
                             "summary": summary, "requests": [r.to_dict() for r in results]})
        if spec is not None:
            from cluster.plan import ledger

            ledger.append("measurement", topology_label(spec), base_signature, rate, _figures(summary))
    if len(points) > 1:
        print(report.format_sweep(points, sweep_goodput(points), f"{label}: sweep"))
        out["sweep_goodput_rps"] = sweep_goodput(points)
    if args.json:
        print(f"[bench] wrote {report.write_json(args.json, out)}", file=sys.stderr)
    if args.plot_dir:
        try:
            path = report.plot_cdfs(Path(args.plot_dir) / "latency_cdf.png", runs)
            print(f"[bench] wrote {path}", file=sys.stderr)
            if len(points) > 1:
                series = {label: [(r, s["goodput"]["goodput_rps"], s["goodput"]["attainment"]) for r, s in points]}
                path = report.plot_sweep(Path(args.plot_dir) / "goodput_sweep.png", series)
                print(f"[bench] wrote {path}", file=sys.stderr)
        except RuntimeError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
    return 0


def _figures(summary: dict) -> dict:
    return {"goodput_rps": summary["goodput"]["goodput_rps"], "attainment": summary["goodput"]["attainment"],
            "ttft_p90_ms": summary["ttft"]["p90_ms"], "tpot_p90_ms": summary["tpot"]["p90_ms"]}


async def _server_tokenizer(args, backend):
    """The server's Tokenize as a plain function over the dataset's texts: every text the
    workload will ask for is tokenized by the server first."""
    texts: set[str] = set()

    def collect(text: str) -> list[int]:
        texts.add(text)
        return [FIRST_TOKEN_ID]

    try:
        read_sharegpt(args.dataset, collect, args.num_requests, multi_turn=args.multi_turn, seed=args.seed)
    except WorkloadError as exc:
        raise UsageError(str(exc)) from None
    ids = {text: await backend.tokenize(text) for text in texts}
    return lambda text: ids[text]


def _one_line(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return (text or type(exc).__name__).splitlines()[0][:300]
