"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local Hugging Face-format model directory (default: the built-in model)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "fp8"],
                        help="auto: a quantized checkpoint on the CPU as shipped; none: widened; int8/int4/fp8: "
                             "a float checkpoint quantized at load (default: auto)")
    parser.add_argument("--cpu-matmul-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="how the CPU multiplies quantized weights: float32, or bfloat16 dot products "
                             "(AVX512_BF16: faster, a bfloat16 engine's rounding); auto: bfloat16 for 4-bit "
                             "weights where the CPU has it (default: auto)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step (default: 512 on a CPU, 2048 on a GPU)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    parser.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, help="exact number of KV blocks")
    kv.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                    help="keys and values in the model's dtype, or 8-bit codes with a scale per token and head")
    kv.add_argument("--kv-cache-memory-fraction", type=float, default=0.25,
                    help="share of the node's memory (RAM on a CPU, each GPU's free memory on CUDA) for the KV "
                         "cache, split among the ranks on the node (default: 0.25)")
    parser.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    parser.add_argument("--no-chunked-prefill", action="store_true", help="schedule each prompt whole")
    parser.add_argument("--seed", type=int, default=0, help="global seed for unseeded sampling")
    parser.add_argument("--threads", type=int, help="torch CPU threads (per rank with --tp)")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="auto: Triton kernels on CUDA, plain torch elsewhere (default: auto)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs: launch every decode step's kernels from Python")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree: ranks 1..N-1 run as Ray actors (default: 1)")
    parser.add_argument("--cluster-name", default="tandem",
                        help="names the Ray namespace, process groups and their ports (default: tandem)")
    parser.add_argument("--ray-address", help="join this Ray cluster (default: a local Ray on loopback)")
    dis = parser.add_argument_group("disaggregated prefill and decode")
    dis.add_argument("--disaggregated", action="store_true",
                     help="prefill and decode in separate worker processes, KV streamed layer by layer")
    dis.add_argument("--prefill-tp", type=int, default=1, help="tensor-parallel degree of each prefill worker")
    dis.add_argument("--decode-tp", type=int, default=1, help="tensor-parallel degree of each decode worker")
    dis.add_argument("--prefill-workers", type=int, default=1, help="number of prefill workers (default: 1)")
    dis.add_argument("--decode-workers", type=int, default=1, help="number of decode workers (default: 1)")
    dis.add_argument("--transfer-timeout", type=float, default=60.0,
                     help="seconds a KV transfer may take before it fails (default: 60)")
    dis.add_argument("--kv-transport", default="torch_distributed",
                     help="KV transport by name (default: torch_distributed: gloo on CPUs, NCCL on GPUs)")
    dis.add_argument("--policy", default="slo", choices=["slo", "prefix_affinity", "least_loaded", "round_robin"],
                     help="router placement policy (default: slo)")
    dis.add_argument("--local-prefill-max-tokens", type=int, metavar="N",
                     help="a decode worker may prefill a prompt with at most N tokens left to compute itself, "
                          "when predicted better (default: 256; 0: every prompt's KV travels)")
    dis.add_argument("--redis-url",
                     help="registry Redis, e.g. redis://:PASSWORD@host:6379/0 or rediss:// for TLS "
                          "(default: a private redis-server on 127.0.0.1, stopped with the cluster)")


def _engine_args(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype,
        quantization=args.quantization,
        cpu_matmul_dtype=args.cpu_matmul_dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        seed=args.seed,
        num_threads=args.threads,
        tensor_parallel_size=args.tp,
        cluster_name=args.cluster_name,
        ray_address=args.ray_address,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )


def _cmd_run(args: argparse.Namespace) -> int:
    from cluster.engine.config import EngineConfigError
    from cluster.engine.models.config import ModelConfigError
    from cluster.engine.models.loader import WeightLoadError
    from cluster.parallel.group import GroupSetupError
    from cluster.parallel.tp_runner import TensorParallelError
    from cluster.registry.local_redis import RedisServerError
    from cluster.runtime.startup import ClusterStartError

    try:
        llm = _make_llm(args)
    except (EngineConfigError, ModelConfigError, WeightLoadError, FileNotFoundError, GroupSetupError,
            TensorParallelError, RedisServerError, ClusterStartError, ValueError) as exc:
        print(f"tandem run: {exc}", file=sys.stderr)
        return 2
    with llm:
        try:
            return _run_file(llm, args)
        except Exception as exc:
            ray = sys.modules.get("ray")
            if ray is None or not isinstance(exc, ray.exceptions.RayError):
                raise
            from cluster.runtime.startup import CLI_SETTINGS, serving_failed

            print(f"tandem run: {serving_failed(exc, CLI_SETTINGS)}", file=sys.stderr)
            return 1


def _make_llm(args: argparse.Namespace):
    from cluster.offline.llm import LLM

    engine_args = _engine_args(args)
    if not args.disaggregated:
        for flag in ("prefill_tp", "decode_tp", "prefill_workers", "decode_workers"):
            if getattr(args, flag) != 1:
                raise ValueError(f"--{flag.replace('_', '-')} needs --disaggregated")
        for flag, default in (("policy", "slo"), ("redis_url", None), ("local_prefill_max_tokens", None)):
            if getattr(args, flag) != default:
                raise ValueError(f"--{flag.replace('_', '-')} needs --disaggregated")
        return LLM(args.model, **engine_args)
    from cluster.offline.disaggregated import DisaggregatedLLM
    from cluster.offline.spec_from_args import disaggregated_spec

    if args.tp != 1:
        raise ValueError("with --disaggregated, give --prefill-tp and --decode-tp instead of --tp")
    del engine_args["tensor_parallel_size"]
    spec, engine = disaggregated_spec(
        args.model, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers, transfer_timeout_s=args.transfer_timeout, kv_transport=args.kv_transport,
        policy=args.policy, registry_url=args.redis_url, local_prefill_max_tokens=args.local_prefill_max_tokens,
        **engine_args,
    )
    return DisaggregatedLLM(spec, engine)


def _run_file(llm, args: argparse.Namespace) -> int:
    from cluster.offline.run_file import run_file

    # Undecodable bytes become surrogates, so that run_file fails that line alone.
    if args.input == "-":
        sys.stdin.reconfigure(errors="surrogateescape")
    source = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8", errors="surrogateescape")
    sink = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    with source, sink:
        counts = run_file(llm, source, sink, progress=not args.quiet)
    summary = ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))
    stats = llm.engine.stats
    print(
        f"[tandem] {sum(counts.values())} requests ({summary}); {stats.generated_tokens} tokens generated; "
        f"prefix-cache hit rate {stats.prefix_cache_hit_rate:.0%}; wrote {args.output}",
        file=sys.stderr,
    )
    goodput = llm.goodput() if hasattr(llm, "goodput") else None
    if goodput:
        minute = goodput["last_minute"]["cluster"]
        print(f"[tandem] goodput (last minute): {minute['goodput_rps']:.2f} requests/s met their SLO; attainment "
              f"{minute['attainment']:.0%} of {minute['requests']}", file=sys.stderr)
    return 0


def _load_spec(args: argparse.Namespace):
    from cluster.topology import TopologyError, default_topology, load_topology

    # Joining a Ray cluster (--address), the model is on its nodes: it need not exist here.
    elsewhere = bool(getattr(args, "address", None))
    try:
        spec = load_topology(args.topology, model_elsewhere=elsewhere) if args.topology else default_topology()
    except TopologyError as exc:
        print(f"tandem {args.command}: the topology has errors:\n{exc}", file=sys.stderr)
        return None
    return _joining(spec, args)


def _joining(spec, args: argparse.Namespace):
    """``spec`` joining the Ray cluster at ``--address``, where one is given."""
    if not getattr(args, "address", None):
        return spec
    from dataclasses import replace

    return replace(spec, ray=replace(spec.ray, address=args.address))


def _cmd_up(args: argparse.Namespace) -> int:
    from cluster.deployment.launcher import up
    from cluster.topology import spec_before_model_check

    # Ray starts while the topology is checked against its model (that check imports torch):
    # the spec without that check, where it has no errors, is what Ray starts with.
    early = None if args.detach else spec_before_model_check(args.topology)
    if early is not None:
        early = _joining(early, args)
        return up(early, early.to_yaml(), False, args.argv, model_check=lambda: _load_spec(args))
    spec = _load_spec(args)
    if spec is None:
        return 2
    return up(spec, spec.to_yaml(), args.detach, args.argv)


def _cmd_down(args: argparse.Namespace) -> int:
    from cluster.deployment.launcher import down

    return down(args.cluster)


def _api_target(args: argparse.Namespace):
    from cluster.cli.status import api_target

    return api_target(args.cluster, args.addr, args.token_env, args.tls_ca)


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from cluster.cli.status import fetch_status, format_status

    try:
        status = fetch_status(_api_target(args))
    except LookupError as exc:
        print(f"tandem status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(status, indent=1) if args.json else format_status(status))
    return 0


def _cmd_top(args: argparse.Namespace) -> int:
    from cluster.cli.top import run_top

    if not args.interval > 0:
        print(f"tandem top: --interval must be positive, got {args.interval:g}", file=sys.stderr)
        return 2
    try:
        target = _api_target(args)
    except LookupError as exc:
        print(f"tandem top: {exc}", file=sys.stderr)
        return 1
    return run_top(target, args.interval, args.iterations)


def _add_api_flags(parser: argparse.ArgumentParser) -> None:
    """Where a cluster's API is: the state `tandem up` wrote here, or --addr (a remote cluster)."""
    parser.add_argument("--cluster", default="tandem", help="cluster name, to find its API here (default: tandem)")
    parser.add_argument("--addr", metavar="HOST:PORT", help="the cluster's gRPC API (default: from the state "
                                                            "`tandem up` wrote for --cluster)")
    parser.add_argument("--token-env", metavar="NAME", help="environment variable holding the API's bearer token "
                                                            "(default: the cluster's own setting, locally)")
    parser.add_argument("--tls-ca", metavar="FILE", help="PEM CA certificates: connect with TLS verified by them")


def _add_service_commands(sub) -> None:
    up = sub.add_parser("up", help="start a cluster from a topology and serve the gRPC API")
    up.add_argument("--topology", help="topology YAML (default: the embedded local default, see examples/)")
    up.add_argument("--address", help="join this Ray cluster (default: the topology's, else a local Ray on loopback)")
    up.add_argument("--detach", action="store_true", help="run in the background; `tandem down` stops it")
    up.set_defaults(func=_cmd_up)
    down = sub.add_parser("down", help="stop a cluster that `tandem up` started")
    down.add_argument("--cluster", default="tandem", help="cluster name (default: tandem)")
    down.set_defaults(func=_cmd_down)
    status = sub.add_parser("status", help="workers, KV usage, queues, hit rates and goodput of a running cluster")
    _add_api_flags(status)
    status.add_argument("--json", action="store_true", help="the raw status as JSON")
    status.set_defaults(func=_cmd_status)
    top = sub.add_parser("top", help="a live view of a running cluster: workers, placements, goodput per class")
    _add_api_flags(top)
    top.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between frames (default: 1)")
    top.add_argument("--iterations", type=int, metavar="N", help="stop after N frames (default: until Ctrl-C)")
    top.set_defaults(func=_cmd_top)
    from cluster.cli.scale import add_scale_command

    add_scale_command(sub)


def _generate_unavailable(error: ImportError):
    """A ``generate`` subcommand that says what is missing, where the gRPC client cannot be imported."""

    def fail(args: argparse.Namespace) -> int:
        print(f"tandem generate needs the gRPC client (grpcio, grpcio-health-checking): {error}", file=sys.stderr)
        return 2

    def add(subparsers) -> None:
        # No options of its own ("+" starts none): it takes every argument and says why it cannot run.
        parser = subparsers.add_parser("generate", help="send one prompt to a running Tandem cluster (needs gRPC)",
                                       prefix_chars="+", add_help=False)
        parser.add_argument("rest", nargs="*")
        parser.set_defaults(func=fail)

    return add


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem: disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    from cluster.cli.bench import add_bench_parser
    from cluster.cli.validate import add_validate_parser
    from cluster.cli.plan import add_plan_parser
    try:
        from tandem.cli_generate import add_generate_parser
    except ImportError as exc:  # the gRPC client is only for a cluster: the engine's commands work without it
        add_generate_parser = _generate_unavailable(exc)

    _add_service_commands(sub)
    add_validate_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    run = sub.add_parser("run", help="offline generation: JSONL requests in, JSONL results out")
    run.add_argument("--input", required=True, help="JSONL file of requests ('-' for stdin)")
    run.add_argument("--output", required=True, help="JSONL file for results ('-' for stdout)")
    run.add_argument("--quiet", action="store_true", help="no progress line")
    _add_engine_flags(run)
    run.set_defaults(func=_cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    if getattr(args, "input", None) not in (None, "-") and not Path(args.input).is_file():
        print(f"tandem {args.command}: input file {args.input} does not exist", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
