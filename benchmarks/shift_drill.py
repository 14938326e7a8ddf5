"""A shift drill: traffic that changes its prompt and output lengths half way (short prompts
with long answers, then long prompts with short answers), with the live planner off and in
``act``, side by side in one run: goodput and attainment per phase, the decisions taken, and
each decision's predicted goodput against the goodput measured in the window after it.

``--scale sim`` (default): in the planner's simulator at a 16-GPU scale (H100s, the
Llama-3-70B shape from the roofline, 4 workers of TP 4 whose split the planner may change).
Traffic is simulated window by window (``--window-s``); each window runs on the split in
force at its start, from empty queues and caches (the simulator cannot change a running
cluster's pools), so a split's first window after a change is slightly optimistic for both
runs alike. After each window the planner of the ``act`` run looks (the same code as a live
cluster's: ``cluster/plan/live/``, its proposal simulated on other seeds than the windows).

``--scale local``: on this machine, the quick start's default model in a cluster of 3 workers
on its cores (1 prefill + 2 decode to start, the split for the first phase), driven through the
gRPC API by Poisson arrivals of the ``standard`` class, once with ``planner.mode: off`` and once
with ``act`` (bounds: 3 workers, moves only; a look every ``--interval-s``). Goodput per phase is
measured at the client; each decision's prediction and the goodput measured ``--measure-s`` (120 s)
after it come from the planner's own record (``tandem status``). Each worker runs ``--local-threads``
torch threads (1): with the default (every core per worker) three workers share two cores
whatever their roles, so no split serves more than another (what the planner's shared-cores
simulator predicts, and what a drill at that setting measured). With one thread each, one
prefill worker uses one core and two use both: a 1,024-token prompt takes about 1.4 s on one
thread here (2.6 s before the bf16 kernels), so one prefill worker serves about 0.7 of them a
second and two about 1.4 less what the decode worker takes, and the second phase's default rate
(0.9 req/s; it was 0.6, which the first split now serves) is beyond the first split and within
the second. It lasts 240 s so that most of it runs after the planner has confirmed and made its
move.

Goals (issue #26): with ``act``, goodput in the second phase >= 1.3x the fixed split's, and
each decision's predicted goodput within 20% of what was measured after it. Locally, each
decision is checked twice: its prediction as made (the lengths of the window that set it off, at
the rate offered over the ``--measure-s`` before it: a 20 s window's dozen requests of a Poisson
stream are a poor guess of the rate to come, and a high one, since the planner acts on the
windows that look heavy), and the same simulation at the traffic offered over the time it was
measured over (the planner's model alone).

    PYTHONPATH=. .venv/bin/python benchmarks/shift_drill.py            # about 10 minutes on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/shift_drill.py --scale local   # about 14 minutes, quiet cores
"""

from __future__ import annotations

import argparse
from collections import Counter
import sys
import time
from dataclasses import dataclass

from common import machine_rows, print_table

from cluster.bench.arrivals import Arrivals
from cluster.bench.metrics import class_objectives
from cluster.bench.workloads import Length, synthetic
from cluster.plan.live.hysteresis import Hysteresis
from cluster.plan.live.observe import Observation
from cluster.plan.live.propose import LENGTH_SPREAD, Bounds, Split, chosen, propose
from cluster.plan.roofline import hardware, model_shape, worker_spec
from cluster.plan.search import evaluate
from cluster.plan.simulator import Pools, SimConfig
from cluster.registry.planner_decisions import PlannerDecision
from router.config import RouterConfig

VOCAB = 32000


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float
    prompt: int
    output: int


@dataclass
class Window:
    phase: str
    index: int
    split: Split
    requests: int
    met: int
    goodput_rps: float
    attainment: float


@dataclass
class Decision:
    at_window: int
    current: Split
    proposed: Split
    predicted_goodput_rps: float
    predicted_attainment: float
    measured_goodput_rps: float | None = None

    @property
    def error(self) -> float | None:
        if not self.measured_goodput_rps:
            return None
        return (self.predicted_goodput_rps - self.measured_goodput_rps) / self.measured_goodput_rps


def log(message: str) -> None:
    print(f"[shift] {message}", file=sys.stderr, flush=True)


def traffic(phase: Phase, window_s: float, seed: int):
    """A window's requests, of the router's default class (``standard``): judged by its objectives."""
    count = max(1, round(phase.rate * window_s))
    workload = synthetic(count, Length("normal", phase.prompt, LENGTH_SPREAD * phase.prompt),
                         Length("normal", phase.output, LENGTH_SPREAD * phase.output), VOCAB, seed,
                         slo_class=RouterConfig().default_class)
    return workload, Arrivals("poisson", rate=phase.rate, seed=seed)


def run(label: str, phases: list[Phase], start: Split, act: bool, spec, args, objectives, config) -> tuple[list[Window], list[Decision]]:
    split, windows, decisions = start, [], []
    hysteresis = Hysteresis(min_gain=args.min_gain, confirmations=args.confirmations, cooldown_s=args.cooldown_s)
    bounds = Bounds(1, args.workers - 1, 1, args.workers - 1, args.workers, min_workers=args.workers)
    index = 0
    for phase in phases:
        for _ in range(args.windows):
            workload, arrivals = traffic(phase, args.window_s, seed=1000 + index)
            pools = Pools(prefill=(split.prefill, spec), decode=(split.decode, spec))
            e = evaluate(pools, workload, arrivals, None, config, objectives)
            met = e.summary["goodput"]["met"]
            window = Window(phase.name, index, split, e.summary["goodput"]["requests"], met, met / args.window_s,
                            e.attainment)
            windows.append(window)
            if decisions and decisions[-1].at_window == index - 1 and decisions[-1].measured_goodput_rps is None:
                decisions[-1].measured_goodput_rps = window.goodput_rps
            log(f"{label}: window {index} ({phase.name}) on {split.label()}: goodput {window.goodput_rps:.1f} req/s, "
                f"attainment {window.attainment:.0%}")
            index += 1
            if not act:
                continue
            observed = Observation(index * args.window_s, args.window_s, window.requests, phase.rate,
                                   window.goodput_rps, window.attainment, phase.prompt, phase.output)
            started = time.perf_counter()
            proposal = propose(observed, split, bounds, lambda role: spec, config, objectives, VOCAB, seed=index,
                               max_requests=args.max_requests)
            why_not = hysteresis.offer(proposal, index * args.window_s)
            log(f"{label}: look after window {index - 1} ({time.perf_counter() - started:.0f} s): "
                f"{proposal.describe()}" + (f" ({why_not})" if why_not else " -> resize"))
            if why_not is None:
                predicted = proposal.predictions[proposal.best]
                decisions.append(Decision(index - 1, split, proposal.best, predicted.goodput_rps, predicted.attainment))
                hysteresis.acted(index * args.window_s)
                split = proposal.best
    return windows, decisions


def phase_figures(windows: list[Window], phase: str, window_s: float) -> tuple[float, float]:
    mine = [w for w in windows if w.phase == phase]
    requests, met = sum(w.requests for w in mine), sum(w.met for w in mine)
    return met / (len(mine) * window_s), met / requests if requests else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=("sim", "local"), default="sim")
    parser.add_argument("--local-phase1", default="64,256,0.5,90", help="local: prompt,output,rate,seconds")
    parser.add_argument("--local-phase2", default="1024,16,0.9,240", help="local: prompt,output,rate,seconds")
    parser.add_argument("--local-threads", type=int, default=1, help="local: torch threads of each worker")
    parser.add_argument("--interval-s", type=float, default=10.0, help="local: between the planner's looks")
    parser.add_argument("--measure-s", type=float, default=120.0,
                        help="local: planner.measure_s, how long after a decision its goodput is measured (and the "
                             "rate its prediction is made at is taken over as long before it); 60 s holds about 26 "
                             "requests at 0.5 req/s, whose attainment alone scatters by +-8 points (one sigma)")
    parser.add_argument("--modes", default="off,act", help="local: the planner modes run, in order (off,act)")
    parser.add_argument("--dump", default=None,
                        help="local: write every request (wall-clock send, TTFT, TPOT, outcome, placement) and the "
                             "planner's decisions to this JSON file, to look at what a decision's window held")
    parser.add_argument("--gpus", type=int, default=16, help="GPUs the split is made of")
    parser.add_argument("--tp", type=int, default=4, help="TP degree of every worker")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--model-shape", default="llama-3-70b")
    parser.add_argument("--phase1", default="64,256,70", help="prompt,output,rate of the first phase")
    parser.add_argument("--phase2", default="1024,16,30", help="prompt,output,rate of the second phase")
    parser.add_argument("--windows", type=int, default=4, help="windows per phase")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=1200, help="most requests of one proposal's simulation")
    parser.add_argument("--min-gain", type=float, default=0.1)
    parser.add_argument("--confirmations", type=int, default=2)
    parser.add_argument("--cooldown-s", type=float, default=40.0)
    args = parser.parse_args()
    if args.scale == "local":
        return local_drill(args)
    args.workers = args.gpus // args.tp
    phases = []
    for name, text in (("phase 1", args.phase1), ("phase 2", args.phase2)):
        prompt, output, rate = text.split(",")
        phases.append(Phase(name, float(rate), int(prompt), int(output)))
    spec = worker_spec(hardware(args.hardware), model_shape(args.model_shape), args.tp)
    config = SimConfig(router=RouterConfig(), duration_s=args.window_s)
    objectives = class_objectives(RouterConfig())
    # the fixed split: the planner's choice for the first phase, as an operator sizing for it would take
    first = phases[0]
    bounds = Bounds(1, args.workers - 1, 1, args.workers - 1, args.workers, min_workers=args.workers)
    log(f"sizing the fixed split for {first.name} ({first.prompt} in / {first.output} out at {first.rate:g} req/s)")
    sizing = propose(Observation(0, args.window_s, 1, first.rate, 0, 0, first.prompt, first.output),
                     Split(args.workers // 2, args.workers - args.workers // 2), bounds, lambda role: spec, config,
                     objectives, VOCAB, seed=7, max_requests=args.max_requests)
    start = chosen(sizing.predictions)  # no split is in force yet: none is preferred on a tie
    log(f"fixed split: {start.label()}")
    results = {}
    for label, act in (("off", False), ("act", True)):
        results[label] = run(label, phases, start, act, spec, args, objectives, config)

    print_table("machine", machine_rows())
    print(f"\nsimulated: {args.gpus} x {args.hardware}, {args.model_shape}, {args.workers} workers of TP {args.tp} "
          f"(a split of P+D workers); windows of {args.window_s:g} s, "
          f"{args.windows} per phase; fixed split {start.label()} (the planner's for phase 1)")
    rows = []
    for phase in phases:
        row = [f"{phase.name}: {phase.prompt} in / {phase.output} out, {phase.rate:g} req/s"]
        for label in ("off", "act"):
            goodput, attainment = phase_figures(results[label][0], phase.name, args.window_s)
            row += [f"{goodput:.1f}", f"{attainment:.0%}"]
        off, act = (phase_figures(results[label][0], phase.name, args.window_s)[0] for label in ("off", "act"))
        row.append(f"{act / off:.2f}x" if off else "-")
        rows.append(tuple(row))
    print_table("goodput per phase (req/s) and attainment", rows,
                ("phase", "off goodput", "off attainment", "act goodput", "act attainment", "act / off"))
    decisions = results["act"][1]
    print_table("decisions (act)", [(f"after window {d.at_window}", f"{d.current.label()} -> {d.proposed.label()}",
                                     f"{d.predicted_goodput_rps:.1f}",
                                     f"{d.measured_goodput_rps:.1f}" if d.measured_goodput_rps is not None else "-",
                                     f"{d.error:+.0%}" if d.error is not None else "-") for d in decisions],
                ("when", "resize", "predicted goodput", "measured after", "error"))
    print_table("splits per window", [(f"{w.index} ({w.phase})", off.split.label(), w.split.label())
                                      for w, off in zip(results["act"][0], results["off"][0])],
                ("window", "off", "act"))
    off2 = phase_figures(results["off"][0], phases[1].name, args.window_s)[0]
    act2 = phase_figures(results["act"][0], phases[1].name, args.window_s)[0]
    ratio = act2 / off2 if off2 else float("inf")
    within = [d for d in decisions if d.error is not None and abs(d.error) <= 0.2]
    print(f"\ngoal: act's goodput in phase 2 >= 1.3x the fixed split's: {ratio:.2f}x "
          f"({'met' if ratio >= 1.3 else 'NOT met'})")
    print(f"goal: every decision's predicted goodput within 20% of measured: {len(within)} of {len(decisions)} "
          f"({'met' if decisions and len(within) == len(decisions) else 'NOT met'})")
    return 0


# -- on this machine ------------------------------------------------------------------------------

LOCAL_VOCAB = (100, 40000)  # token ids drawn from here: plain text pieces of the default model's vocabulary


def local_topology(args, mode: str) -> dict:
    from local_cluster import free_port

    threads = args.local_threads
    return {"server": {"port": free_port(), "http_port": 0}, "prefill": {"replicas": 1, "threads": threads},
            "decode": {"replicas": 2, "threads": threads},
            "planner": {"mode": mode, "interval_s": args.interval_s, "window_s": args.window_s,
                        "measure_s": args.measure_s, "min_workers": 3,
                        "max_workers": 3, "confirmations": args.confirmations, "cooldown_s": args.cooldown_s,
                        "min_gain": args.min_gain}}


async def drive(api: str, phases: list[tuple[Phase, float]], seed: int) -> tuple[float, dict[str, list]]:
    """Each phase's results, and the wall clock (``time.time()``) at the zero of their send times."""
    import asyncio
    import random

    from cluster.bench.clients import GrpcBackend, SendOptions

    backend = GrpcBackend(api)
    rng, arrivals = random.Random(seed), random.Random(seed + 1)
    out: dict[str, list] = {}
    started_at = time.time()
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    tasks, count, phase_start = [], 0, 0.0

    async def send(phase: Phase, results: list) -> None:
        nonlocal count
        count += 1
        n = max(8, int(rng.gauss(phase.prompt, LENGTH_SPREAD * phase.prompt)))
        prompt = [rng.randrange(*LOCAL_VOCAB) for _ in range(n)]
        results.append(await backend.send(f"r{count}", prompt, phase.output, "standard",
                                          SendOptions(ignore_eos=True, timeout_s=300), clock))

    try:
        for phase, seconds in phases:
            results = out.setdefault(phase.name, [])
            at = phase_start
            log(f"local: {phase.name} ({phase.prompt} in / {phase.output} out at {phase.rate:g} req/s, {seconds:g} s)")
            while True:
                at += arrivals.expovariate(phase.rate)
                if at >= phase_start + seconds:
                    break
                await asyncio.sleep(max(0.0, at - clock()))
                tasks.append(asyncio.ensure_future(send(phase, results)))
            phase_start += seconds
        await asyncio.gather(*tasks)
    finally:
        await backend.close()
    return started_at, out


def local_drill(args) -> int:
    import asyncio

    from cluster.bench.metrics import summarize
    from cluster.paths import cache_dir
    from local_cluster import LocalCluster, stop_on_sigterm

    stop_on_sigterm()
    phases = []
    for name, text in (("phase 1", args.local_phase1), ("phase 2", args.local_phase2)):
        prompt, output, rate, seconds = text.split(",")
        phases.append((Phase(name, float(rate), int(prompt), int(output)), float(seconds)))
    objectives = class_objectives(RouterConfig())
    figures, decisions, finals, dumped = {}, {}, {}, {}
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        with LocalCluster(f"shift-{mode}", local_topology(args, mode), cache=cache_dir()) as cluster:
            started_at, results = asyncio.run(drive(cluster.api, phases, seed=11))
            if mode == "act":  # the last decision's measure_s passes, and a look measures it
                time.sleep(max(args.window_s, args.measure_s) + args.interval_s)
            status = cluster.status() or {}
        figures[mode] = {}
        for phase, seconds in phases:
            summary = summarize(results[phase.name], class_objectives=objectives)
            g = summary["goodput"]
            figures[mode][phase.name] = (g["met"] / seconds, g["attainment"], g["requests"], g["failed"],
                                         summary["ttft"].get("p90_ms"), summary["tpot"].get("p90_ms"))
            errors = Counter((r.error or "")[:120] for r in results[phase.name] if not r.ok and not r.rejected)
            for error, n in errors.most_common(3):
                log(f"local {mode}, {phase.name}: {n} failed: {error}")
        decisions[mode] = (status.get("planner") or {}).get("decisions", [])
        dumped[mode] = {"decisions": decisions[mode], "requests": [
            {"phase": name, "sent_at": started_at + r.sent_at, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
             "ok": r.ok, "rejected": r.rejected, "error": r.error, "placement": r.placement}
            for name, rs in results.items() for r in rs]}
        finals[mode] = sorted(w["name"] for w in status.get("workers", []))
        log(f"local {mode}: " + "; ".join(f"{name}: goodput {f[0]:.2f} req/s, attainment {f[1]:.0%}"
                                          for name, f in figures[mode].items()))

    if args.dump:
        import json

        with open(args.dump, "w") as f:
            json.dump(dumped, f, indent=1)
    if modes != ["off", "act"]:
        return 0  # a look at one mode's requests (--dump), not the drill's comparison
    print_table("machine", machine_rows() + [
        ("cluster", f"the quick start's default model; 3 workers on this machine's cores, {args.local_threads} torch "
                    "thread(s) each, 1 prefill + 2 decode to start"),
        ("planner", f"act: a look every {args.interval_s:g} s over {args.window_s:g} s, {args.confirmations} looks to "
                    f"confirm, cooldown {args.cooldown_s:g} s, min gain {args.min_gain:.0%}; moves only (3 workers); each "
                    f"decision measured over {args.measure_s:g} s after it")])
    rows = []
    for phase, seconds in phases:
        off, act = figures["off"][phase.name], figures["act"][phase.name]
        rows.append((f"{phase.name}: {phase.prompt} in / {phase.output} out, {phase.rate:g} req/s, {seconds:g} s",
                     f"{off[0]:.2f}", f"{off[1]:.0%}", f"{act[0]:.2f}", f"{act[1]:.0%}",
                     f"{act[0] / off[0]:.2f}x" if off[0] else "-", f"{off[3]} / {act[3]}"))
    print_table("goodput per phase (req/s, at the client) and attainment", rows,
                ("phase", "off goodput", "off attainment", "act goodput", "act attainment", "act / off",
                 "failed off / act"))
    made = [PlannerDecision.from_mapping(d) for d in decisions["act"]]

    def pct(error: float | None) -> str:
        return f"{error:+.0%}" if error is not None else "-"

    def rps(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    print_table("decisions (act), from the planner's record", [
        (d.number, time.strftime("%H:%M:%S", time.gmtime(d.at)), f"{d.current} -> {d.proposed}",
         "yes" if d.acted else "no", f"{d.predicted_goodput_rps:.2f}", rps(d.measured_goodput_rps), pct(d.error),
         rps(d.measured_rate_rps), rps(d.expected_goodput_rps), pct(d.model_error), d.detail[:40]) for d in made],
        ("#", "at", "resize", "acted", "predicted req/s", "measured after", "error", "offered after",
         "predicted for it", "error", "detail"))
    print(f"(predicted: the split's simulated goodput at the lengths of the window that set the decision off and the "
          f"rate offered over the {args.measure_s:g} s before it; predicted for it: the same simulation at the traffic "
          f"offered over the {args.measure_s:g} s it was measured over)")
    for d in made:  # the traffic it was taken for and what the workers' step fits took a request of it to cost
        print(f"decision {d.number}: {d.observed}")
    print(f"\nworkers at the end: off {', '.join(finals['off'])}; act {', '.join(finals['act'])}")
    off2, act2 = figures["off"]["phase 2"][0], figures["act"]["phase 2"][0]
    ratio = act2 / off2 if off2 else (float("inf") if act2 else 0.0)
    print(f"goal: act's goodput in phase 2 >= 1.3x the fixed split's: {ratio:.2f}x ({'met' if ratio >= 1.3 else 'NOT met'})")
    for what, errors in (("at the traffic that set it off", [d.error for d in made]),
                         ("at the traffic offered after it", [d.model_error for d in made])):
        within = sum(e is not None and abs(e) <= 0.2 for e in errors)
        print(f"goal: every decision's predicted goodput within 20% of measured, {what}: {within} of {len(made)} "
              f"({'met' if made and within == len(made) else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
