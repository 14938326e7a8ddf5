"""Sizing the pools: simulate candidate topologies under a workload and keep the one with the
highest goodput per worker (or per GPU) among those whose SLO attainment meets the goal.

Candidates: every prefill:decode split and every colocated pool up to ``max_ranks`` ranks,
with each pool's TP degree from ``tps`` (a degree the step models know). Each is simulated
with the router's own code (``cluster/plan/simulator.py``) and judged with ``tandem bench``'s
own metrics.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from cluster.bench.arrivals import Arrivals
from cluster.bench.metrics import ATTAINMENT_GOAL, Objectives, summarize
from cluster.bench.workloads import Workload
from cluster.plan.simulator import Pools, SimConfig, WorkerSpec, simulate
from cluster.topology import ClusterSpec


@dataclass(frozen=True)
class Evaluation:
    pools: Pools
    summary: dict
    utilisation: dict[str, float]

    @property
    def ranks(self) -> int:
        return self.pools.ranks()

    @property
    def workers(self) -> int:
        return len(self.pools.workers())

    @property
    def attainment(self) -> float:
        return self.summary["goodput"]["attainment"]

    @property
    def goodput_rps(self) -> float:
        return self.summary["goodput"]["goodput_rps"]

    def per(self, unit: str) -> float:
        return self.goodput_rps / (self.ranks if unit == "gpu" else self.workers)

    def figures(self) -> dict:
        s = self.summary
        return {"goodput_rps": self.goodput_rps, "attainment": self.attainment, "ttft_p90_ms": s["ttft"]["p90_ms"],
                "ttft_p50_ms": s["ttft"]["p50_ms"], "tpot_p90_ms": s["tpot"]["p90_ms"],
                "tpot_p50_ms": s["tpot"]["p50_ms"], "e2e_p90_ms": s["e2e"]["p90_ms"],
                "throughput_rps": s["request_throughput_rps"], "failed": s["failed"],
                "utilisation": {k: round(v, 3) for k, v in self.utilisation.items()}}


def evaluate(pools: Pools, workload: Workload, arrivals: Arrivals, objectives: Objectives | None,
             config: SimConfig, class_objectives=None) -> Evaluation:
    result = simulate(pools, workload, arrivals, config)
    return Evaluation(pools, summarize(result.results, objectives, class_objectives), result.utilisation)


def candidates(spec_for: Callable[[str, int], WorkerSpec | None], max_ranks: int, tps: Sequence[int] = (1,),
               disaggregated: bool = True, colocated: bool = True) -> list[Pools]:
    """Every topology of at most ``max_ranks`` ranks whose roles and TP degrees have a spec."""
    out = []
    if disaggregated:
        for tp_p, tp_d in itertools.product(tps, tps):
            p_spec, d_spec = spec_for("prefill", tp_p), spec_for("decode", tp_d)
            if p_spec is None or d_spec is None:
                continue
            for p in range(1, max_ranks // tp_p + 1):
                for d in range(1, (max_ranks - p * tp_p) // tp_d + 1):
                    out.append(Pools(prefill=(p, p_spec), decode=(d, d_spec)))
    if colocated:
        for tp in tps:
            spec = spec_for("colocated", tp)
            if spec is not None:
                out += [Pools(colocated=(c, spec)) for c in range(1, max_ranks // tp + 1)]
    return out


def search(pools: Sequence[Pools], workload: Workload, arrivals: Arrivals, objectives: Objectives | None,
           config: SimConfig, per: str = "gpu", goal: float = ATTAINMENT_GOAL, class_objectives=None,
           progress: Callable[[int, int, Evaluation], None] | None = None) -> tuple[Evaluation | None, list[Evaluation]]:
    """Every candidate's evaluation (best first) and the best that meets ``goal``, or None."""
    evaluations = []
    for i, candidate in enumerate(pools):
        evaluation = evaluate(candidate, workload, arrivals, objectives, config, class_objectives)
        evaluations.append(evaluation)
        if progress:
            progress(i + 1, len(pools), evaluation)
    ranked = sorted(evaluations, key=lambda e: (e.attainment < goal, -e.per(per), -e.attainment, e.ranks))
    best = ranked[0] if ranked and ranked[0].attainment >= goal else None
    return best, ranked


def topology_for(base: ClusterSpec, pools: Pools, gpus: bool = False) -> ClusterSpec:
    """The base topology with its pools sized as ``pools`` says (GPUs per rank when ``gpus``)."""
    def pool(role: str):
        replicas, spec = getattr(pools, role)
        current = base.pool(role)
        if not replicas:
            return replace(current, replicas=0)
        changes = dict(replicas=replicas, tp=spec.tp, max_num_seqs=spec.max_num_seqs,
                       max_num_batched_tokens=spec.max_num_batched_tokens)
        if gpus:
            changes["gpus_per_rank"] = 1
        return replace(current, **changes)

    return replace(base, prefill=pool("prefill"), decode=pool("decode"), colocated=pool("colocated"))


def pools_of(spec: ClusterSpec, spec_for: Callable[[str, int], WorkerSpec | None]) -> Pools:
    """The pools of a topology, each worker shaped by ``spec_for(role, tp)``."""
    def pool(role: str):
        p = spec.pool(role)
        if not p.replicas:
            return (0, None)
        worker = spec_for(role, p.tp)
        if worker is None:
            raise ValueError(f"{role}: no step-time model for TP {p.tp}")
        return (p.replicas, replace(worker, max_num_seqs=p.max_num_seqs,
                                    max_num_batched_tokens=p.max_num_batched_tokens or worker.max_num_batched_tokens,
                                    block_size=spec.kv.block_size, prefix_caching=spec.kv.prefix_caching,
                                    num_blocks=spec.kv.num_blocks or worker.num_blocks))

    return Pools(prefill=pool("prefill"), decode=pool("decode"), colocated=pool("colocated"))
