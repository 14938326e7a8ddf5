"""What the live planner sizes the pools for: the traffic of the last window as the registry
measured it (offered rate, prompt and output lengths, goodput and attainment) and the workers'
step times as they reported them."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.registry.goodput import GoodputReader
from cluster.registry.load import read_loads
from cluster.plan.step_models import Profile, pool_steps


@dataclass(frozen=True)
class Observation:
    at: float
    window_s: float
    requests: int  # ended in the window, refused ones included
    rate_rps: float  # offered: requests over the window's span
    goodput_rps: float
    attainment: float
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    # Each SLO class's share of the window's requests, largest first: a simulation judges its
    # requests by their classes' objectives, as the registry judged these (none: the router's default class).
    class_shares: tuple[tuple[str, float], ...] = ()

    @property
    def has_traffic(self) -> bool:
        """Enough to size pools for: requests whose lengths are known."""
        return self.requests > 0 and bool(self.mean_prompt_tokens) and bool(self.mean_output_tokens)

    def describe(self) -> str:
        if not self.has_traffic:
            return f"no traffic in the last {self.window_s:g} s"
        return (f"{self.rate_rps:.2f} req/s offered, {self.mean_prompt_tokens:.0f} in / {self.mean_output_tokens:.0f} "
                f"out, goodput {self.goodput_rps:.2f} req/s, attainment {self.attainment:.0%} "
                f"(last {self.window_s:g} s)")


def observe(reader: GoodputReader, window_s: float, now: float) -> Observation:
    w, classes = reader.window_and_class_requests(window_s, now=now)
    total = sum(classes.values())
    shares = tuple(sorted(((c, n / total) for c, n in classes.items()), key=lambda cs: (-cs[1], cs[0]))) if total else ()
    return Observation(now, window_s, w.requests, w.rate_rps, w.goodput_rps, w.attainment, w.mean_prompt_tokens,
                       w.mean_output_tokens, shares)


def measured_profile(client, cluster: str, workers: list[str], tps: dict[str, int],
                     max_model_len: int) -> tuple[Profile, set[str]]:
    """The workers' step times as their latest reports hold them, pooled per role (the
    router's own fit, as ``tandem plan --from-cluster`` reads them), and the nodes they run on."""
    loads = read_loads(client, cluster, workers)
    return (pool_steps(loads.values(), {}, tps, max_model_len, f"cluster {cluster}"),
            {load.node_id for load in loads.values()})
