"""``tandem plan``: predict a topology's goodput with the simulator, and size the pools.

    tandem plan --from-cluster NAME --rate 2 --goodput ttft_ms:500 tpot_ms:100 --output plan.yaml
    tandem plan --profile p.json --topology mine.yaml --evaluate --sweep 1,2,4
    tandem plan --hardware h100 --model-shape llama-3-8b --max-ranks 8 --tp 1,2,4 --rate 20 --output 8b.yaml

Step models come from a running cluster's registry (``--from-cluster``; ``--watch S`` keeps
reading its workers' steps while it serves), a profile saved from one (``--profile``), or a
GPU's roofline (``--hardware`` with ``--model-shape``). Without ``--evaluate`` every topology
up to ``--max-ranks`` ranks is simulated and the one with the highest goodput per GPU (or
worker) meeting 90% attainment is written as a topology YAML that ``tandem validate``
accepts, its predicted figures in comments above it. Each plan first says how far its last
prediction of the same topology and workload was from what ``tandem bench`` then measured.

Exit status: 0 with a plan, 1 when no candidate meets the attainment goal or the cluster
cannot be read, 2 on a usage error (one line naming the flag).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from cluster.cli.bench import (UsageError, add_workload_flags, arrivals_of, check_counts, class_objectives,
                               objectives_of, rates_of, signature, topology_label, workload_of)
from cluster.bench.metrics import ATTAINMENT_GOAL

PROG = "tandem plan"
DEFAULT_VOCAB = 32000


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="predict goodput with a simulator of the cluster and size its pools",
        description="Simulates a Tandem cluster (the router's own code, the engine's own scheduler) under a "
                    "workload to predict goodput, attainment and latency, and searches pool sizes.")
    m = parser.add_argument_group("step-time models (one of)")
    m.add_argument("--from-cluster", metavar="NAME", help="fit them to a running cluster's measured steps")
    m.add_argument("--profile", metavar="FILE", help="a profile saved with --save-profile")
    m.add_argument("--hardware", metavar="GPU", help="roofline for a GPU: h100, h200, a100, l40s, l4")
    m.add_argument("--model-shape", metavar="NAME|DIR",
                   help="with --hardware: llama-3-8b, llama-3-70b, qwen2.5-7b, mistral-7b or a local model")
    m.add_argument("--redis-url", help="with --from-cluster: the registry (default: from the cluster's state)")
    m.add_argument("--watch", type=float, default=0.0, metavar="S",
                   help="with --from-cluster: keep reading the workers' steps for S seconds (default: 0)")
    m.add_argument("--save-profile", metavar="FILE", help="write the step models' data here for later plans")
    m.add_argument("--hop-ms", type=float, metavar="MS",
                   help="cost of one control-plane message (default: from the cluster's learned TTFT correction; "
                        "0 for a roofline)")
    add_workload_flags(parser)
    s = parser.add_argument_group("what to plan")
    s.add_argument("--topology", metavar="FILE",
                   help="the base topology: its model, KV and router settings (default: the cluster's own)")
    s.add_argument("--evaluate", action="store_true", help="predict the base topology only; no search")
    s.add_argument("--max-ranks", type=int, metavar="N", help="largest topology searched, in ranks (GPUs) "
                                                              "(default: the base topology's)")
    s.add_argument("--tp", default=None, metavar="T1,T2", help="TP degrees searched (default: those profiled; "
                                                                "1,2,4,8 for a roofline)")
    s.add_argument("--per", choices=("gpu", "worker"), default="gpu", help="goodput per GPU or per worker")
    s.add_argument("--no-colocated", action="store_true", help="search disaggregated topologies only")
    s.add_argument("--no-disaggregated", action="store_true", help="search colocated topologies only")
    s.add_argument("--output", metavar="FILE", help="write the planned topology YAML here")
    s.add_argument("--json", metavar="FILE", help="write every prediction here")
    s.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(func=run_plan)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    from cluster.plan.errors import PlanError

    try:
        return _plan(args)
    except (UsageError, PlanError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1


# -- step models ------------------------------------------------------------------------------


def _profile_from_cluster(args, state: dict, spec):
    from cluster.plan.step_models import collect_from_registry, hop_from_corrections, pool_steps
    from cluster.registry.membership import read_membership
    from cluster.registry.reporter import connect

    url = args.redis_url or state.get("registry_url")
    if not url:
        raise UsageError("--redis-url: the cluster's state has no registry URL")
    if spec is not None and spec.registry.password_env and "@" not in url:
        import os

        password = os.environ.get(spec.registry.password_env)
        if password:
            scheme, _, rest = url.partition("://")
            url = f"{scheme}://:{password}@{rest}"
    workers = list(state.get("workers", []))  # as the cluster started; its membership record, if it resized
    try:
        client = connect(url, timeout_s=5.0)
        membership = read_membership(client, args.from_cluster)
        if membership is not None:
            workers = list(membership.workers)
        collector = collect_from_registry(client, args.from_cluster, workers, args.watch)
    except Exception as exc:  # noqa: BLE001 - redis errors and bad URLs alike: one line
        raise ConnectionError(f"cannot read the registry of {args.from_cluster!r} ({url}): "
                              f"{str(exc).splitlines()[0][:200]}") from None
    hop = hop_from_corrections(state.get("ttft_correction_s") or {})
    tps = {}
    if spec is not None:
        for name in workers:
            role = name.rsplit("-", 1)[0]
            if role in ("prefill", "decode", "colocated"):
                tps[name] = spec.pool(role).tp
    steps = sum(len(v) for v in collector.steps.values())
    print(f"[plan] {len(collector.reports)} worker(s) of {args.from_cluster!r}: {steps} steps read", file=sys.stderr)
    return pool_steps(collector.reports.values(), collector.steps, tps, _max_model_len(spec),
                      f"cluster {args.from_cluster}", hop)


def _cluster_state(name: str) -> dict:
    """The cluster's state file, with the TTFT correction its router learned (read through the
    cluster's API, as `tandem status` reads it)."""
    from cluster.deployment.state_file import read_state
    from cluster.cli.status import api_target, fetch_status

    state = read_state(name)
    if not state:
        raise ConnectionError(f"--from-cluster: cluster {name!r} is not up here (no state file)")
    try:
        status = fetch_status(api_target(name, None, None, None))
        state["ttft_correction_s"] = status["router"].get("ttft_correction_s") or {}
    except Exception as exc:  # noqa: BLE001 - without the router's correction, no control-plane cost
        print(f"[plan] the router's TTFT correction could not be read ({str(exc).splitlines()[0][:120]}); "
              "control-plane cost 0", file=sys.stderr)
    return state


def _max_model_len(spec) -> int:
    if spec is None:
        return 4096
    if spec.model.max_model_len:
        return spec.model.max_model_len
    try:
        from cluster.engine.models.read_config import load_model_config

        return load_model_config(spec.model_dir()).max_position_embeddings
    except Exception:  # noqa: BLE001 - a model not here: a generous default
        return 4096


def _spec_source(args, spec, state):
    """(spec_for(role, tp) -> WorkerSpec | None, profiled TP degrees, hop_s, gpus, profile)."""
    chosen = [flag for flag in ("from_cluster", "profile", "hardware") if getattr(args, flag)]
    if len(chosen) != 1:
        raise UsageError("give one source of step times: --from-cluster NAME, --profile FILE or --hardware GPU")
    if args.hardware:
        from cluster.plan.roofline import hardware, model_shape, worker_spec

        if not args.model_shape:
            raise UsageError("--model-shape: --hardware needs the model's shape (a name or a local model)")
        hw, shape = hardware(args.hardware), model_shape(args.model_shape)
        block = spec.kv.block_size if spec is not None else 16
        if spec is not None:  # KV bytes per token as the topology's cache holds them
            shape = replace(shape, kv_cache_dtype=spec.kv.cache_dtype)
        cache = {}

        def spec_for(role: str, tp: int):
            if tp not in cache:
                try:
                    cache[tp] = worker_spec(hw, shape, tp, block, max_model_len=_max_model_len(spec) if spec else 8192)
                except ValueError:
                    cache[tp] = None
            return cache[tp]

        return spec_for, (1, 2, 4, 8), 0.0, True, None
    from cluster.plan.step_models import Profile

    profile = Profile.load(args.profile) if args.profile else _profile_from_cluster(args, state, spec)
    profiled = {p.tp for p in profile.roles.values()}

    def spec_for(role: str, tp: int):
        if tp not in profiled:
            return None
        try:
            worker = profile.spec(role)
        except ValueError:
            return None
        return worker if worker.tp == tp else replace(worker, tp=tp) if len(profiled) == 1 else None

    return spec_for, tuple(sorted(profiled)), profile.hop_s, False, profile


# -- the command ------------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> int:
    check_counts(args)
    objectives = objectives_of(args)
    rates = rates_of(args)
    state = None
    if args.from_cluster:
        state = _cluster_state(args.from_cluster)
    from cluster.plan import ledger
    from cluster.plan.search import candidates, evaluate, pools_of, search, topology_for
    from cluster.plan.simulator import SimConfig

    spec = _base_topology(args, state)
    spec_for, profiled_tps, hop_s, gpus, profile = _spec_source(args, spec, state)
    if args.save_profile:
        if profile is None:
            raise UsageError("--save-profile: a roofline has no measured profile to save")
        print(f"[plan] wrote {profile.save(args.save_profile)}", file=sys.stderr)
    if args.hop_ms is not None:
        if args.hop_ms < 0:
            raise UsageError(f"--hop-ms: must be >= 0, got {args.hop_ms:g}")
        hop_s = args.hop_ms / 1000.0
    config = SimConfig(router=spec.router, hop_s=hop_s, duration_s=args.duration)
    classes = class_objectives(spec.router)
    vocab = args.vocab_size or DEFAULT_VOCAB
    out: dict = {"source": profile.source if profile else f"roofline {args.hardware} {args.model_shape}",
                 "hop_ms": hop_s * 1000, "objectives": objectives.describe() if objectives else "per class",
                 "predictions": []}

    if args.evaluate or len(rates) > 1:
        chosen_spec = spec
        pools = pools_of(spec, spec_for)
    else:
        tps = _tps(args, profiled_tps)
        max_ranks = args.max_ranks or max(1, sum(spec.pool(r).replicas * spec.pool(r).tp
                                                for r in ("prefill", "decode", "colocated")))
        workload = workload_of(args, vocab)
        arrivals = arrivals_of(args, rates[0])
        pool_list = candidates(spec_for, max_ranks, tps, not args.no_disaggregated, not args.no_colocated)
        if not pool_list:
            raise UsageError("--tp: no topology to search with these TP degrees and --max-ranks")

        tty = sys.stderr.isatty()

        def show(done: int, total: int, evaluation) -> None:
            if not args.quiet:
                line = (f"[plan] simulated {done}/{total} topologies ({evaluation.pools.label()}: goodput "
                        f"{evaluation.goodput_rps:.2f} req/s, attainment {evaluation.attainment:.0%})")
                print(("\r" + line + "   ") if tty else line, end="" if tty and done < total else "\n",
                      file=sys.stderr, flush=True)

        best, ranked = search(pool_list, workload, arrivals, objectives, config, args.per, ATTAINMENT_GOAL, classes,
                              show)
        print(_ranking(ranked, args.per, arrivals.describe()))
        out["candidates"] = [{"topology": e.pools.label(), "ranks": e.ranks, **e.figures()} for e in ranked]
        if best is None:
            print(f"{PROG}: no topology of up to {max_ranks} ranks reaches {ATTAINMENT_GOAL:.0%} attainment at "
                  f"{arrivals.describe()}; the closest is {ranked[0].pools.label()} "
                  f"({ranked[0].attainment:.0%}); raise --max-ranks or lower the rate", file=sys.stderr)
            _write_json(args, out)
            return 1
        pools = best.pools
        chosen_spec = topology_for(spec, pools, gpus)

    label = topology_label(chosen_spec)
    lines = []
    for index, rate in enumerate(rates):
        workload = workload_of(args, vocab, None, index)
        if index == 0:
            base_signature = signature(args, workload)
            for line in ledger.describe_checks(ledger.last_check(label, base_signature)):
                print(f"[plan] {label}: {line}")
        arrivals = arrivals_of(args, rate, index)
        evaluation = evaluate(pools, workload, arrivals, objectives, config, classes)
        figures = evaluation.figures()
        ledger.append("prediction", label, base_signature, rate, figures)
        out["predictions"].append({"topology": label, "rate": rate, "arrivals": arrivals.describe(), **figures})
        lines.append(_figures_line(label, arrivals.describe(), figures))
    for line in lines:
        print(line)
    yaml_text = _annotated_yaml(chosen_spec, lines, out["source"], hop_s)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(yaml_text)
        print(f"[plan] wrote {args.output} (check it with `tandem validate {args.output}`)", file=sys.stderr)
    elif not args.evaluate and len(rates) == 1:
        sys.stdout.write(yaml_text)
    _write_json(args, out)
    return 0


def _tps(args, profiled: tuple[int, ...]) -> tuple[int, ...]:
    if not args.tp:
        return profiled
    try:
        tps = tuple(int(t) for t in args.tp.split(",") if t.strip())
    except ValueError:
        raise UsageError(f"--tp: expected degrees like 1,2,4, got {args.tp[:100]!r}") from None
    if not tps or any(t < 1 for t in tps):
        raise UsageError(f"--tp: degrees must be at least 1, got {args.tp[:100]!r}")
    return tps


def _base_topology(args, state):
    from cluster.cli.bench import cluster_topology
    from cluster.topology import TopologyError, default_topology, load_topology

    if args.topology:
        try:
            return load_topology(args.topology, model_elsewhere=True)
        except TopologyError as exc:
            raise UsageError(f"--topology: {str(exc).splitlines()[0]}") from None
    spec = cluster_topology(state)
    return spec if spec is not None else default_topology()


def _figures_line(label: str, arrivals: str, f: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.0f} ms"

    util = ", ".join(f"{k} {v:.0%}" for k, v in f["utilisation"].items())
    return (f"predicted {label} at {arrivals}: goodput {f['goodput_rps']:.2f} req/s, attainment "
            f"{f['attainment']:.0%}, TTFT p50 {ms(f['ttft_p50_ms'])} p90 {ms(f['ttft_p90_ms'])}, TPOT p50 "
            f"{ms(f['tpot_p50_ms'])} p90 {ms(f['tpot_p90_ms'])}; utilisation {util}")


def _ranking(ranked, per: str, arrivals: str) -> str:
    header = ("topology", "ranks", f"goodput/{per}", "goodput", "attainment", "TTFT p90 ms", "TPOT p90 ms")
    rows = [header]
    for e in ranked[:12]:
        f = e.figures()
        rows.append((e.pools.label(), str(e.ranks), f"{e.per(per):.3f}", f"{e.goodput_rps:.2f}",
                     f"{e.attainment:.1%}", "-" if f["ttft_p90_ms"] is None else f"{f['ttft_p90_ms']:.0f}",
                     "-" if f["tpot_p90_ms"] is None else f"{f['tpot_p90_ms']:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    title = f"simulated topologies at {arrivals} (goal: attainment >= {ATTAINMENT_GOAL:.0%})"
    lines = [title, "-" * len(title)]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in rows]
    return "\n".join(lines)


def _annotated_yaml(spec, lines: list[str], source: str, hop_s: float) -> str:
    header = [f"# tandem plan ({source}; control-plane message {hop_s * 1000:.1f} ms)"]
    header += [f"# {line}" for line in lines]
    return "\n".join(header) + "\n" + spec.to_yaml()


def _write_json(args, out: dict) -> None:
    if args.json:
        from cluster.bench.report import write_json

        print(f"[plan] wrote {write_json(args.json, out)}", file=sys.stderr)
