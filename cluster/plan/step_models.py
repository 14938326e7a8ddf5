"""Where the simulator's workers get their step times: a running cluster's registry, a profile
file saved from one, or a hardware profile (roofline).

From a cluster: each worker's load report holds its recent steps (``StepSample``: tokens,
attention, decodes, context, seconds, KV blocks sent and the transfer's tail); reading the
registry a few times a second while the cluster serves (``watch_s``) gathers more of them.
Steps are pooled per role and fitted with the router's own ``StepTimeModel.fit``, the model
the router itself places by. The worker's engine limits (blocks, budget, batch) come from the
same reports; the control-plane cost per message (``hop_s``) from the TTFT correction the
router learned (what its step-time model leaves out: round trips).

A profile file (JSON) keeps all of it, so a plan can be made again without the cluster.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping

from cluster.plan.errors import ProfileError
from cluster.plan.simulator import WorkerSpec
from cluster.registry.load import StepSample, WorkerLoad, read_loads
from cluster.topology import ROLES
from router.cost_model import StepTimeModel

# A role the profile lacks borrows another's measured engine: a colocated worker is a decode
# worker's engine prefilling for itself, and either can stand for a prefill worker.
STAND_INS = {"prefill": ("prefill", "colocated", "decode"), "decode": ("decode", "colocated"),
             "colocated": ("colocated", "decode")}
HOPS_ON_SERVICE_PATH = {"remote": 4, "local": 2}  # messages between placement and the first token at the ingress


@dataclass(frozen=True)
class RoleProfile:
    role: str
    tp: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    steps: tuple[StepSample, ...]

    def model(self) -> StepTimeModel:
        return StepTimeModel.fit(self.steps, self.max_num_batched_tokens)

    def spec(self) -> WorkerSpec:
        return WorkerSpec(self.model(), self.num_blocks, self.block_size, self.max_num_batched_tokens,
                          self.max_num_seqs, self.max_model_len, tp=self.tp)


@dataclass(frozen=True)
class Profile:
    source: str
    roles: Mapping[str, RoleProfile]
    hop_s: float = 0.0

    def spec(self, role: str) -> WorkerSpec:
        """A worker of ``role`` as measured (or as a stand-in role was); a side of its step-time
        model that its own steps could not fit (a decode worker whose recent steps were all
        decodes has no prefill fit) is taken from the other roles' fits."""
        for name in STAND_INS[role]:
            if name in self.roles:
                spec = self.roles[name].spec()
                model = spec.model
                others = [self.roles[r].model() for r in self.roles if r != name]
                for side in ("prefill", "decode"):
                    if getattr(model, side) is None:
                        fitted = next((getattr(o, side) for o in others if getattr(o, side) is not None), None)
                        model = replace(model, **{side: fitted})
                return replace(spec, model=model)
        raise ProfileError(f"the profile ({self.source}) has no worker that can stand for a {role} worker")

    def save(self, path: str | Path) -> Path:
        data = {"source": self.source, "hop_s": self.hop_s,
                "roles": {role: {**{k: v for k, v in asdict(p).items() if k != "steps"},
                                 "steps": [s.row() for s in p.steps]}
                          for role, p in self.roles.items()}}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ProfileError(f"--profile: cannot read {path}: {exc.strerror}") from None
        except ValueError:
            raise ProfileError(f"--profile: {path} is not valid JSON") from None
        try:
            roles = {}
            for role, p in data["roles"].items():
                if role not in ROLES:
                    raise ProfileError(f"--profile: {path}: unknown role {role!r}")
                steps = tuple(StepSample(*row) for row in p.pop("steps"))
                roles[role] = RoleProfile(**p, steps=steps)
            return cls(str(data.get("source", path)), roles, float(data.get("hop_s", 0.0)))
        except (KeyError, TypeError) as exc:
            raise ProfileError(f"--profile: {path} is not a tandem plan profile ({exc})") from None


def pool_steps(reports: Iterable[WorkerLoad], steps_by_worker: Mapping[str, list[StepSample]], tps: Mapping[str, int],
               max_model_len: int, source: str, hop_s: float = 0.0) -> Profile:
    """A profile from load reports (one per worker) and the steps gathered per worker."""
    roles: dict[str, RoleProfile] = {}
    for load in reports:
        current = roles.get(load.role)
        steps = tuple(steps_by_worker.get(load.worker, load.steps))
        if current is None:
            roles[load.role] = RoleProfile(load.role, tps.get(load.worker, 1), load.num_blocks, load.block_size,
                                           load.max_num_batched_tokens, load.max_num_seqs, max_model_len, steps)
        else:
            roles[load.role] = RoleProfile(load.role, current.tp, min(current.num_blocks, load.num_blocks),
                                           current.block_size, current.max_num_batched_tokens, current.max_num_seqs,
                                           max_model_len, current.steps + steps)
    if not roles:
        raise ProfileError(f"{source}: no worker has reported to the registry")
    return Profile(source, roles, hop_s)


class StepCollector:
    """Gathers the steps in workers' reports over time: each report holds the last steps, so
    consecutive reads overlap; only the new ones are kept."""

    def __init__(self):
        self.steps: dict[str, list[StepSample]] = {}
        self.reports: dict[str, WorkerLoad] = {}

    def add(self, loads: Mapping[str, WorkerLoad]) -> None:
        for worker, load in loads.items():
            self.reports[worker] = load
            kept = self.steps.setdefault(worker, [])
            kept += _new_steps(kept, list(load.steps))


def _new_steps(kept: list[StepSample], window: list[StepSample]) -> list[StepSample]:
    """The steps of ``window`` after its longest prefix that ends ``kept``."""
    for overlap in range(min(len(kept), len(window)), 0, -1):
        if kept[-overlap:] == window[:overlap]:
            return window[overlap:]
    return window


def collect_from_registry(client, cluster: str, workers: list[str], watch_s: float = 0.0,
                          every_s: float = 0.25) -> StepCollector:
    """Reads the workers' reports now and, for ``watch_s`` seconds, every ``every_s``."""
    collector = StepCollector()
    deadline = time.monotonic() + watch_s
    while True:
        collector.add(read_loads(client, cluster, workers))
        if time.monotonic() >= deadline:
            return collector
        time.sleep(every_s)


def hop_from_corrections(corrections: Mapping[str, float]) -> float:
    """The cost of one control-plane message, from the router's learned TTFT corrections
    (each path's correction spread over the messages on it); 0 when none was learned."""
    hops = [value / HOPS_ON_SERVICE_PATH[path] for path, value in corrections.items()
            if path in HOPS_ON_SERVICE_PATH and value and value > 0]
    return sum(hops) / len(hops) if hops else 0.0
