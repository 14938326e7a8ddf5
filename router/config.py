"""The router's configuration: SLO classes and the placement policy, as frozen dataclasses.

Built from a mapping (the ``router:`` section of a topology YAML, or flags); every error names
the key to fix. A policy is a name and scorer weights; the named presets are

    round_robin      {round_robin: 1}
    least_loaded     {least_loaded: 1}
    prefix_affinity  {prefix_affinity: 1}, ties by load
    slo (default)    objectives filter + {prefix_affinity: 1, slo_headroom: 0.5, least_loaded: 0.2}

and any of them can be re-weighted (``weights:``). Only ``slo`` admits by objectives
(``admission_control``): the others place every request, as their namesakes in other systems do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from cluster.engine.request_limits import MAX_SLO_CLASS_CHARS, quote

SCORERS = ("round_robin", "least_loaded", "prefix_affinity", "slo_headroom")
OVERLOAD_ACTIONS = ("reject", "queue", "admit")

PRESETS: dict[str, dict[str, float]] = {
    "round_robin": {"round_robin": 1.0},
    "least_loaded": {"least_loaded": 1.0},
    "prefix_affinity": {"prefix_affinity": 1.0, "least_loaded": 0.01},
    "slo": {"prefix_affinity": 1.0, "least_loaded": 0.2, "slo_headroom": 0.5},
}


_TYPES = {
    "policy": (str, "a string"),
    "weights": (Mapping, "a mapping of scorer name to weight"),
    "admission_control": (bool, "true or false"),
    "slo_classes": (Mapping, "a mapping of class name to {ttft_ms, tpot_ms, priority, on_overload}"),
    "default_class": (str, "a string"),
}


class RouterConfigError(ValueError):
    """A router setting that cannot work; the message names the key."""


@dataclass(frozen=True)
class SloClass:
    """Latency objectives of a class of requests (None: no objective) and what happens when no
    pair can meet them now: ``reject`` at once, ``queue`` (by priority) until one can, or
    ``admit`` best-effort (it counts against goodput)."""

    name: str
    ttft_s: float | None
    tpot_s: float | None
    priority: int = 0
    on_overload: str = "queue"


DEFAULT_SLO_CLASSES = (
    SloClass("interactive", ttft_s=1.0, tpot_s=0.1, priority=1, on_overload="reject"),
    SloClass("standard", ttft_s=5.0, tpot_s=0.25, priority=0, on_overload="queue"),
    SloClass("batch", ttft_s=None, tpot_s=None, priority=-1, on_overload="admit"),
)


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "slo"
    weights: Mapping[str, float] = field(default_factory=lambda: dict(PRESETS["slo"]))
    admission_control: bool = True
    slo_classes: tuple[SloClass, ...] = DEFAULT_SLO_CLASSES
    default_class: str = "standard"
    skip_prefill_fraction: float = 0.9  # a decode worker caching this much of a prompt may prefill it itself
    local_prefill_max_tokens: int = 256  # ... and so may one with at most this many prompt tokens left to compute
    migration_limit: int = 3  # times a request may move to another worker after one failed under it
    load_refresh_s: float = 0.05  # how stale the router's view of load may get
    registry_retry_s: float = 1.0  # after a registry failure, how long to place by load only before trying again
    queue_limit: int = 4096  # requests the router may hold waiting; past it, one that would wait is rejected
    correction_limit_s: float = 0.5  # bound of the learned TTFT correction, either way
    correction_half_life_s: float = 30.0  # the correction halves after this long without a finished request
    prefill_shortlist: int = 16  # prefill workers a placement pairs with decode workers: those soonest done

    def slo_class(self, name: str | None) -> SloClass:
        name = name or self.default_class
        for cls in self.slo_classes:
            if cls.name == name:
                return cls
        known = ", ".join(c.name for c in self.slo_classes)
        raise RouterConfigError(f"unknown slo_class {quote(name)}; known: {known}")

    @classmethod
    def for_policy(cls, policy: str, **overrides: Any) -> "RouterConfig":
        return cls.from_mapping({"policy": policy, **overrides})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, where: str = "router") -> "RouterConfig":
        data = dict(data or {})
        for key, (kind, wanted) in _TYPES.items():
            if key in data and not isinstance(data[key], kind):
                raise RouterConfigError(f"{where}.{key}: must be {wanted}; got {quote(data[key])}")
        known = {"policy", "weights", "admission_control", "slo_classes", "default_class", "skip_prefill_fraction",
                 "load_refresh_s", "registry_retry_s", "queue_limit", "correction_limit_ms", "correction_half_life_s",
                 "local_prefill_max_tokens", "migration_limit", "prefill_shortlist"}
        if "replicas" in data:
            raise RouterConfigError(f"{where}.replicas: the router runs inside each ingress replica (one router "
                                    "each), so server.replicas sets how many; remove router.replicas")
        unknown = sorted(set(data) - known)
        if unknown:
            raise RouterConfigError(f"{where}.{unknown[0]}: unknown key; known: {', '.join(sorted(known))}")
        policy = data.get("policy", "slo")
        if policy not in PRESETS:
            raise RouterConfigError(f"{where}.policy: unknown policy {quote(policy)}; known: {', '.join(PRESETS)}")
        weights = dict(PRESETS[policy])
        for name, weight in dict(data.get("weights") or {}).items():
            if name not in SCORERS:
                raise RouterConfigError(f"{where}.weights.{name}: unknown scorer; known: {', '.join(SCORERS)}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
                raise RouterConfigError(f"{where}.weights.{name}: must be a number >= 0, got {quote(weight)}")
            weights[name] = float(weight)
        if not any(weights.values()):
            raise RouterConfigError(f"{where}.weights: at least one scorer needs a positive weight")
        classes = tuple(_slo_class(name, spec, f"{where}.slo_classes.{name}")
                        for name, spec in dict(data["slo_classes"]).items()) if "slo_classes" in data \
            else DEFAULT_SLO_CLASSES
        config = cls(
            policy=policy, weights=weights, admission_control=bool(data.get("admission_control", policy == "slo")),
            slo_classes=classes, default_class=data.get("default_class", "standard"),
            skip_prefill_fraction=_fraction(data.get("skip_prefill_fraction", 0.9), f"{where}.skip_prefill_fraction"),
            load_refresh_s=_positive(data.get("load_refresh_s", 0.05), f"{where}.load_refresh_s"),
            registry_retry_s=_positive(data.get("registry_retry_s", 1.0), f"{where}.registry_retry_s"),
            queue_limit=_count(data.get("queue_limit", 4096), f"{where}.queue_limit"),
            correction_limit_s=_non_negative(data.get("correction_limit_ms", 500), f"{where}.correction_limit_ms") / 1000,
            correction_half_life_s=_positive(data.get("correction_half_life_s", 30.0),
                                             f"{where}.correction_half_life_s"),
            local_prefill_max_tokens=_count(data.get("local_prefill_max_tokens", 256),
                                            f"{where}.local_prefill_max_tokens", minimum=0),
            migration_limit=_count(data.get("migration_limit", 3), f"{where}.migration_limit", minimum=0),
            prefill_shortlist=_count(data.get("prefill_shortlist", 16), f"{where}.prefill_shortlist"),
        )
        try:
            config.slo_class(config.default_class)
        except RouterConfigError as exc:
            raise RouterConfigError(f"{where}.default_class: {exc}") from None
        return config


def _slo_class(name: str, spec: Any, where: str) -> SloClass:
    if not isinstance(spec, Mapping):
        raise RouterConfigError(f"{where}: expected a mapping with ttft_ms, tpot_ms, priority, on_overload")
    unknown = sorted(set(spec) - {"ttft_ms", "tpot_ms", "priority", "on_overload"})
    if unknown:
        raise RouterConfigError(f"{where}.{unknown[0]}: unknown key; known: on_overload, priority, tpot_ms, ttft_ms")
    if len(str(name)) > MAX_SLO_CLASS_CHARS:
        raise RouterConfigError(f"{where}: a class name may have at most {MAX_SLO_CLASS_CHARS} characters "
                                f"(requests must be able to name it)")
    on_overload = spec.get("on_overload", "queue")
    if on_overload not in OVERLOAD_ACTIONS:
        raise RouterConfigError(f"{where}.on_overload: must be one of {', '.join(OVERLOAD_ACTIONS)}, "
                                f"got {quote(on_overload)}")
    priority = spec.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RouterConfigError(f"{where}.priority: must be an integer, got {quote(priority)}")

    def seconds(key: str) -> float | None:
        value = spec.get(key)
        return None if value is None else _positive(value, f"{where}.{key}") / 1000.0

    return SloClass(str(name), seconds("ttft_ms"), seconds("tpot_ms"), priority, on_overload)


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise RouterConfigError(f"{where}: must be a positive number, got {quote(value)}")
    return float(value)


def _non_negative(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise RouterConfigError(f"{where}: must be a number >= 0, got {value!r}")
    return float(value)


def _count(value: Any, where: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RouterConfigError(f"{where}: must be an integer >= {minimum}, got {value!r}")
    return value


def _fraction(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise RouterConfigError(f"{where}: must be in (0, 1], got {quote(value)}")
    return float(value)
