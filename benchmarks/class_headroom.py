"""The class headroom's setting (``router.class_headroom``), swept in the planner's simulator:
goodput and attainment per SLO class at 1x, 2x and 4x the load a cluster serves, for each
headroom, side by side in one run.

The headroom keeps looser classes from filling a decode worker's batch up to their own TPOT
objective while a tighter class runs there or arrives (``router/class_headroom.py``): it buys
the tighter class its batches and costs the looser ones batch size. Where the balance lies
depends on the traffic, so this sweeps it on the traffic the default classes are made for: a
quarter ``interactive`` (TTFT <= 1 s, TPOT <= 100 ms, refused at once), the rest ``standard``
(TTFT <= 5 s, TPOT <= 250 ms, held up to 5 s), Poisson arrivals, prompts and answers of
``--prompt-tokens`` / ``--output-tokens`` (+-50%).

The simulator runs the router's own code (placement, admission, the headroom, the wait
forecast) and the engine's own scheduler, with steps timed by a step-time model
(``cluster/plan/simulator.py``): here the roofline of ``--model-shape`` on ``--hardware``
(default Llama-3-8B on H100s, 1 prefill + 1 decode worker), or with ``--scale cpu`` the quick
start's cluster as its workers' kept start-up profiles measured it on this machine (the newest
of the default model's under ``<tandem cache>/step-profiles/``, 2 cores shared; run the quick
start once first). The capacity (1x) is the highest rate of a grid whose
attainment, every class together, stays >= 90% at the default headroom. Deterministic: the
same arguments give the same table.

    PYTHONPATH=. .venv/bin/python benchmarks/class_headroom.py              # a few minutes
    PYTHONPATH=. .venv/bin/python benchmarks/class_headroom.py --scale cpu  # the quick start's profile
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from common import machine_rows, print_table

from cluster.bench.arrivals import Arrivals
from cluster.bench.metrics import class_objectives
from cluster.bench.workloads import Session, Turn, Workload
from cluster.plan.roofline import hardware, model_shape, worker_spec
from cluster.plan.search import evaluate
from cluster.plan.simulator import Pools, SimConfig, WorkerSpec
from cluster.plan.step_models import RoleProfile
from cluster.registry.load import StepSample
from router.config import RouterConfig

VOCAB = 32000
HEADROOMS = (0.0, 0.1, 0.2, 0.3, 0.4)
LOADS = (1.0, 2.0, 4.0)
GRID = (0.1, 0.14, 0.2, 0.28, 0.4, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0, 5.6, 8.0, 11.0, 16.0, 22.0, 32.0, 45.0, 64.0)  # req/s tried for 1x


def log(message: str) -> None:
    print(f"[headroom] {message}", file=sys.stderr, flush=True)


def mixed(count: int, prompt: int, output: int, interactive_share: float, seed: int) -> Workload:
    """``count`` single requests, each ``interactive`` with probability ``interactive_share``."""
    rng = random.Random(seed)
    sessions = []
    for i in range(count):
        n = max(4, round(rng.uniform(0.5, 1.5) * prompt))
        out = max(2, round(rng.uniform(0.5, 1.5) * output))
        cls = "interactive" if rng.random() < interactive_share else "standard"
        sessions.append(Session(f"s{i}", (Turn(tuple(rng.randrange(4, VOCAB) for _ in range(n)), out),),
                                slo_class=cls))
    return Workload(tuple(sessions), f"mixed interactive={interactive_share} seed={seed}")


def pools_and_config(args) -> tuple[Pools, SimConfig, str]:
    if args.scale == "gpu":
        spec = worker_spec(hardware(args.hardware), model_shape(args.model_shape), 1)
        return (Pools(prefill=(1, spec), decode=(1, spec)), SimConfig(duration_s=args.duration_s),
                f"1 prefill + 1 decode, {args.model_shape} on {args.hardware} (roofline)")
    specs, files = {}, []
    for role in ("prefill", "decode"):
        path = kept_profile(role)
        files.append(path.name)
        specs[role] = profiled_spec(path)
    if specs["decode"].model.prefill is None or specs["prefill"].model.prefill is None:
        raise SystemExit("[headroom] the kept profiles have no prefill steps")
    return (Pools(prefill=(1, specs["prefill"]), decode=(1, specs["decode"])),
            SimConfig(duration_s=args.duration_s, shared_cores=os.cpu_count()),
            f"1 prefill + 1 decode, the quick start's kept profiles ({', '.join(files)}), {os.cpu_count()} shared cores")


def kept_profile(role: str) -> Path:
    """The newest kept start-up profile of the default model for ``role``."""
    from cluster.paths import cache_dir

    found = sorted((cache_dir() / "step-profiles").glob(f"SmolLM2*-{role}-*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"[headroom] no kept {role} profile of the default model: run the quick start once")
    return found[-1]


def profiled_spec(path: Path) -> WorkerSpec:
    """A kept start-up profile as the planner's worker spec (``RoleProfile``, the router's own fit)."""
    data = json.loads(path.read_text())
    engine = data["key"]["engine"]
    steps = tuple(StepSample(s["num_prefill_tokens"], s.get("prefill_attention", 0), s["num_decode_tokens"],
                             s["context_tokens"], s["seconds"]) for s in data["steps"])
    profile = RoleProfile(data["key"]["role"], engine["tp"], engine["num_blocks"], engine["block_size"],
                          engine["max_num_batched_tokens"], engine["max_num_seqs"], engine["max_model_len"], steps)
    return replace(profile.spec(), threads=engine["threads"])


def run(pools: Pools, config: SimConfig, headroom: float, rate: float, args) -> dict:
    count = max(20, round(rate * args.duration_s))
    workload = mixed(count, args.prompt_tokens, args.output_tokens, args.interactive_share, args.seed)
    router = RouterConfig.from_mapping({"class_headroom": headroom})
    e = evaluate(pools, workload, Arrivals("poisson", rate=rate, seed=args.seed), None,
                 replace(config, router=router), class_objectives(router))
    s = e.summary
    classes = s.get("classes", {})
    return {"goodput": s["goodput"]["met"] / args.duration_s, "attainment": s["goodput"]["attainment"],
            **{name: classes.get(name, {}).get("attainment", 0.0) for name in ("interactive", "standard")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--model-shape", default="llama-3-8b")
    parser.add_argument("--prompt-tokens", type=int, help="default: 512 (gpu), 128 (cpu, as benchmarks/overload.py)")
    parser.add_argument("--output-tokens", type=int, help="default: 256 (gpu), 96 (cpu)")
    parser.add_argument("--interactive-share", type=float, default=0.25)
    parser.add_argument("--duration-s", type=float, default=60.0, help="simulated seconds of arrivals per cell")
    parser.add_argument("--headrooms", type=float, nargs="+", default=list(HEADROOMS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.prompt_tokens = args.prompt_tokens or (512 if args.scale == "gpu" else 128)
    args.output_tokens = args.output_tokens or (256 if args.scale == "gpu" else 96)
    pools, config, workers = pools_and_config(args)
    default = RouterConfig().class_headroom
    started = time.perf_counter()
    capacity = None
    for rate in GRID:
        figures = run(pools, config, default, rate, args)
        log(f"capacity search: {rate:g} req/s, attainment {figures['attainment']:.0%}")
        if figures["attainment"] < 0.9:
            break
        capacity = rate
    if capacity is None:
        log(f"even {GRID[0]:g} req/s is beyond 90% attainment: nothing to sweep")
        return 1
    rows = []
    for load in LOADS:
        for headroom in args.headrooms:
            f = run(pools, config, headroom, capacity * load, args)
            log(f"{load:g}x, headroom {headroom:g}: goodput {f['goodput']:.2f} req/s, interactive "
                f"{f['interactive']:.0%}, standard {f['standard']:.0%}")
            rows.append((f"{load:g}x ({capacity * load:g} req/s)", f"{headroom:g}" + (" (default)" if headroom == default
                                                                                    else ""),
                         f"{f['goodput']:.2f}", f"{f['attainment']:.0%}", f"{f['interactive']:.0%}",
                         f"{f['standard']:.0%}"))
    print_table("machine (simulated cluster; the simulation is deterministic)", machine_rows() + [
        ("cluster", workers),
        ("traffic", f"Poisson; {args.interactive_share:.0%} interactive, the rest standard; prompts "
                    f"{args.prompt_tokens} and answers {args.output_tokens} tokens (+-50%); "
                    f"{args.duration_s:g} s per cell"),
        ("capacity (1x)", f"{capacity:g} req/s: the highest of the grid at >= 90% attainment, headroom {default:g}"),
        ("run time", f"{time.perf_counter() - started:.0f} s")])
    print_table("goodput and attainment per class by headroom", rows,
                ("load", "class_headroom", "goodput (req/s)", "attainment", "interactive", "standard"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
