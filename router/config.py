"""The router's configuration: SLO classes and the placement policy, as frozen dataclasses.

Built from a mapping (the ``router:`` section of a topology YAML, or flags); every error names
the key to fix. Each key is declared once, on its field (:func:`setting`): its default, the reader
that checks it and its doc; :meth:`RouterConfig.from_mapping`, :meth:`RouterConfig.to_mapping`
and the topology reference (``docs/topology.md``) walk these declarations.

A policy is a name and scorer weights; the named presets are

    round_robin      {round_robin: 1}
    least_loaded     {least_loaded: 1}
    prefix_affinity  {prefix_affinity: 1}, ties by load
    slo (default)    objectives filter + {prefix_affinity: 1, slo_headroom: 0.5, least_loaded: 0.2}

and any of them can be re-weighted (``weights:``). Only ``slo`` admits by objectives
(``admission_control``): the others place every request, as their namesakes in other systems do.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable, Mapping

from cluster.engine.request_limits import MAX_SLO_CLASS_CHARS, quote

SCORERS = ("round_robin", "least_loaded", "prefix_affinity", "slo_headroom")
OVERLOAD_ACTIONS = ("reject", "queue", "admit")
SLO_CLASS_KEYS = ("ttft_ms", "tpot_ms", "priority", "on_overload", "max_wait_ms")

PRESETS: dict[str, dict[str, float]] = {
    "round_robin": {"round_robin": 1.0},
    "least_loaded": {"least_loaded": 1.0},
    "prefix_affinity": {"prefix_affinity": 1.0, "least_loaded": 0.01},
    "slo": {"prefix_affinity": 1.0, "least_loaded": 0.2, "slo_headroom": 0.5},
}

# Reads one key's value from the file: read(value, where, earlier), ``where`` the dotted key an
# error names, ``earlier`` the fields read before it (the policy, for weights).
Reader = Callable[[Any, str, Mapping[str, Any]], Any]


class RouterConfigError(ValueError):
    """A router setting that cannot work; the message names the key."""


@dataclass(frozen=True)
class SloClass:
    """Latency objectives of a class of requests (None: no objective) and what happens when no
    pair can meet them now: ``reject`` at once, ``queue`` (by priority) until one can, or
    ``admit`` best-effort (it counts against goodput). A ``queue`` class waits at most
    ``max_wait_s`` (None: its TTFT objective, see :attr:`wait_bound_s`)."""

    name: str
    ttft_s: float | None
    tpot_s: float | None
    priority: int = 0
    on_overload: str = "queue"
    max_wait_s: float | None = None

    @property
    def wait_bound_s(self) -> float | None:
        """The longest a request of this class is held for a placement: ``max_wait_s``, else
        the TTFT objective (a request held longer could not meet it), else no bound; an
        ``admit`` class is never refused, so without ``max_wait_s`` it waits (for room) unbounded."""
        if self.max_wait_s is not None:
            return self.max_wait_s
        return None if self.on_overload == "admit" else self.ttft_s


DEFAULT_SLO_CLASSES = (
    SloClass("interactive", ttft_s=1.0, tpot_s=0.1, priority=1, on_overload="reject"),
    SloClass("standard", ttft_s=5.0, tpot_s=0.25, priority=0, on_overload="queue"),
    SloClass("batch", ttft_s=None, tpot_s=None, priority=-1, on_overload="admit"),
)


def _slo_class(name: str, spec: Any, where: str) -> SloClass:
    if not isinstance(spec, Mapping):
        raise RouterConfigError(f"{where}: expected a mapping with ttft_ms, tpot_ms, priority, on_overload, "
                                "max_wait_ms")
    unknown = sorted(set(spec) - set(SLO_CLASS_KEYS))
    if unknown:
        raise RouterConfigError(f"{where}.{unknown[0]}: unknown key; known: {', '.join(sorted(SLO_CLASS_KEYS))}")
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

    ttft_s, max_wait_s = seconds("ttft_ms"), seconds("max_wait_ms")
    if max_wait_s is not None and ttft_s is not None and max_wait_s > ttft_s:
        raise RouterConfigError(f"{where}.max_wait_ms: must be at most ttft_ms ({_milliseconds(ttft_s)}): a request "
                                f"held longer cannot meet its TTFT objective; raise ttft_ms instead")
    return SloClass(str(name), ttft_s, seconds("tpot_ms"), priority, on_overload, max_wait_s)


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


def _share(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise RouterConfigError(f"{where}: must be in [0, 1), got {quote(value)}")
    return float(value)


def _slo_class_dict(cls: SloClass) -> dict[str, Any]:
    return {"ttft_ms": _milliseconds(cls.ttft_s), "tpot_ms": _milliseconds(cls.tpot_s),
            "priority": cls.priority, "on_overload": cls.on_overload, "max_wait_ms": _milliseconds(cls.max_wait_s)}


def _milliseconds(seconds: float | None) -> float | int | None:
    """The shortest millisecond figure that reads back as exactly ``seconds``."""
    if seconds is None:
        return None
    for digits in range(16):
        ms = round(seconds * 1000, digits)
        if ms / 1000 == seconds:
            return int(ms) if ms == int(ms) else ms
    return seconds * 1000


def setting(default: Any = MISSING, read: Reader | None = None, doc: str = "", *,
            factory: Callable[[], Any] | None = None, yaml: str | None = None,
            must_be: tuple[type, str] | None = None, by_policy: Callable[[str], Any] | None = None,
            write: Callable[[Any], Any] | None = None, shown: str | None = None) -> Any:
    """One key of the ``router:`` section, declared once: its default, the reader that checks
    and converts its YAML value (``read(value, where, earlier)``, ``earlier`` the fields read
    before it), and its doc. ``yaml``: its name in the file, when not the field's; ``must_be``:
    the type checked before any other mistake is looked for; ``by_policy``: its default for a
    policy, when that is not ``default``; ``write``: the field's value as the file writes it;
    ``shown``: the default as the reference writes it, when the value alone does not say it."""
    metadata = {"read": read, "doc": doc, "yaml": yaml, "must_be": must_be, "by_policy": by_policy,
                "write": write, "shown": shown}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def yaml_key(f: Field) -> str:
    """The name of a RouterConfig field in the ``router:`` section."""
    return f.metadata["yaml"] or f.name


def _alone(check: Callable[..., Any], **options: Any) -> Reader:
    """A reader that needs the value alone, not the keys read before it."""
    return lambda value, where, earlier: check(value, where, **options)


def _as_given(value: Any, where: str, earlier: Mapping[str, Any]) -> Any:
    return value


def _policy(policy: str, where: str, earlier: Mapping[str, Any]) -> str:
    if policy not in PRESETS:
        raise RouterConfigError(f"{where}: unknown policy {quote(policy)}; known: {', '.join(PRESETS)}")
    return policy


def _weights(overrides: Mapping[str, Any], where: str, earlier: Mapping[str, Any]) -> dict[str, float]:
    """The policy's preset, re-weighted."""
    weights = dict(PRESETS[earlier["policy"]])
    for name, weight in dict(overrides or {}).items():
        if name not in SCORERS:
            raise RouterConfigError(f"{where}.{name}: unknown scorer; known: {', '.join(SCORERS)}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0:
            raise RouterConfigError(f"{where}.{name}: must be a number >= 0, got {quote(weight)}")
        weights[name] = float(weight)
    if not any(weights.values()):
        raise RouterConfigError(f"{where}: at least one scorer needs a positive weight")
    return weights


def _slo_classes(classes: Mapping[str, Any], where: str, earlier: Mapping[str, Any]) -> tuple[SloClass, ...]:
    return tuple(_slo_class(name, spec, f"{where}.{name}") for name, spec in dict(classes).items())


def _seconds_from_ms(value: Any, where: str) -> float:
    return _non_negative(value, where) / 1000


@dataclass(frozen=True)
class RouterConfig:
    policy: str = setting("slo", _policy, """
        ``slo``, ``prefix_affinity``, ``least_loaded`` or ``round_robin``.""", must_be=(str, "a string"))
    weights: Mapping[str, float] = setting(
        factory=lambda: dict(PRESETS["slo"]), read=_weights, by_policy=lambda policy: dict(PRESETS[policy]),
        write=dict, must_be=(Mapping, "a mapping of scorer name to weight"), shown="the policy's", doc="""
        Scorer name to weight >= 0, over the policy's preset: ``round_robin``, ``least_loaded``,
        ``prefix_affinity``, ``slo_headroom``.""")
    admission_control: bool = setting(True, _as_given, """
        Refuse or queue requests no pair can serve within their objectives.""",
        must_be=(bool, "true or false"), by_policy=lambda policy: policy == "slo", shown="true for ``slo``")
    slo_classes: tuple[SloClass, ...] = setting(DEFAULT_SLO_CLASSES, _slo_classes, """
        Class name to ``{ttft_ms, tpot_ms, priority, on_overload, max_wait_ms}``: objectives in
        milliseconds (null: none), an integer priority, and ``reject``, ``queue`` or ``admit`` when
        no pair can meet them. ``max_wait_ms``: the longest a ``queue`` request waits in the
        router (default: its ``ttft_ms``, at most that; none without one); a request predicted at
        arrival to wait longer, or still waiting then, is refused at once (HTTP 429 / gRPC
        RESOURCE_EXHAUSTED) with a ``Retry-After`` from the queue, so those kept meet their
        objectives. Giving this key replaces the three default classes.""",
        must_be=(Mapping, "a mapping of class name to {ttft_ms, tpot_ms, priority, on_overload, max_wait_ms}"),
        write=lambda classes: {cls.name: _slo_class_dict(cls) for cls in classes},
        shown=", ".join(cls.name for cls in DEFAULT_SLO_CLASSES))
    default_class: str = setting("standard", _as_given, """
        The class of a request that names none; must be one of ``slo_classes``.""", must_be=(str, "a string"))
    skip_prefill_fraction: float = setting(0.9, _alone(_fraction), """
        A decode worker caching this share of a prompt may prefill it itself, in (0, 1].""")
    local_prefill_max_tokens: int = setting(256, _alone(_count, minimum=0), """
        ... and so may one with at most this many prompt tokens left to compute (0: only by the
        share above). The router then compares the predicted TTFT and TPOT of prefilling there
        against a prefill worker's, and picks what meets the objectives with the most headroom
        (conditional disaggregation, per request). Where the prefill workers take turns with
        the decode worker on the same CPU cores (threads outnumbering the cores they share, as
        in the quick start), such a prompt is prefilled where it decodes: another worker on
        those cores would give it no cores of its own, and would add the call and the KV
        transfer.""")
    migration_limit: int = setting(3, _alone(_count, minimum=0), """
        Times a request may move after a worker failed under it: a decode worker that died
        mid-stream (prompt and the tokens already sent are prefilled elsewhere and the stream
        resumes), or a prefill worker that died before its KV landed. An integer >= 0.""")
    load_refresh_s: float = setting(0.05, _alone(_positive), """
        How stale the router's view of load may get, > 0.""")
    registry_retry_s: float = setting(1.0, _alone(_positive), """
        After a registry failure, seconds of placing by load only before trying again, > 0.""")
    queue_limit: int = setting(4096, _alone(_count), """
        Requests the router may hold until it can place them; past it, a request of a ``queue``
        class is rejected (RESOURCE_EXHAUSTED) instead of waiting. An integer >= 1.""")
    correction_limit_s: float = setting(0.5, _alone(_seconds_from_ms), """
        Bound, either way, of the TTFT correction the router learns from finished requests (what
        its step-time models leave out: control-plane hops, contention), >= 0.""",
        yaml="correction_limit_ms", write=_milliseconds)
    correction_half_life_s: float = setting(30.0, _alone(_positive), """
        Seconds after which an unrefreshed correction has halved, > 0.""")
    prefill_shortlist: int = setting(16, _alone(_count), """
        Prefill workers a placement pairs with every decode worker: those predicted to have the
        prompt prefilled soonest (queue, then prefill with their cached prefix). Pairs grow as
        prefill x decode workers, so a large pool is cut to this many first. An integer >= 1.""")

    class_headroom: float = setting(0.2, _alone(_share), """
        Share of a decode worker's TPOT budget that requests of a class with a looser TPOT
        objective leave to a tighter class: while a tighter class runs on the worker or arrived
        within ``class_headroom_window_s``, looser ones are placed there only while its predicted
        TPOT stays within (1 - this) x the tighter objective (``standard`` within 80 ms of
        ``interactive``'s 100 ms by default), so the tighter class finds a batch it can join.
        In [0, 1); 0: up to the tighter objective itself.""")
    class_headroom_window_s: float = setting(30.0, _alone(_positive), """
        Seconds after its last request that a class still counts as arriving, > 0.""")

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
        """Reads the ``router:`` section. Of several mistakes, the first reported is a wrong
        type, then ``replicas``, then an unknown key, then a bad value (in :data:`_READ_ORDER`),
        then a ``default_class`` that is not among the classes."""
        data = dict(data or {})
        for f in _READ_ORDER:
            key, must_be = yaml_key(f), f.metadata["must_be"]
            if must_be and key in data and not isinstance(data[key], must_be[0]):
                raise RouterConfigError(f"{where}.{key}: must be {must_be[1]}; got {quote(data[key])}")
        known = {yaml_key(f) for f in _READ_ORDER}
        if "replicas" in data:
            raise RouterConfigError(f"{where}.replicas: the router runs inside each ingress replica (one router "
                                    "each), so server.replicas sets how many; remove router.replicas")
        unknown = sorted(set(data) - known)
        if unknown:
            raise RouterConfigError(f"{where}.{unknown[0]}: unknown key; known: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for f in _READ_ORDER:
            key = yaml_key(f)
            values[f.name] = f.metadata["read"](data[key], f"{where}.{key}", values) if key in data \
                else _default(f, values)
        config = cls(**values)
        try:
            config.slo_class(config.default_class)
        except RouterConfigError as exc:
            raise RouterConfigError(f"{where}.default_class: {exc}") from None
        return config

    def to_mapping(self) -> dict[str, Any]:
        """The ``router:`` section as a file writes it, every key given, in :data:`_READ_ORDER`."""
        mapping = {}
        for f in _READ_ORDER:
            value = getattr(self, f.name)
            mapping[yaml_key(f)] = f.metadata["write"](value) if f.metadata["write"] else value
        return mapping


# The order the keys are read in (so which of several bad values is reported first) and written
# back in (``tandem validate``); the fields keep theirs, the reference's.
_READ_ORDER: tuple[Field, ...] = tuple(sorted(fields(RouterConfig), key=lambda f: (
    "policy", "weights", "admission_control", "slo_classes", "default_class", "skip_prefill_fraction",
    "load_refresh_s", "registry_retry_s", "queue_limit", "correction_limit_s", "correction_half_life_s",
    "local_prefill_max_tokens", "migration_limit", "prefill_shortlist", "class_headroom",
    "class_headroom_window_s").index(f.name)))


def _default(f: Field, earlier: Mapping[str, Any]) -> Any:
    """A missing key's value: the policy's default where it has one, else the field's."""
    if f.metadata["by_policy"]:
        return f.metadata["by_policy"](earlier["policy"])
    return f.default_factory() if f.default is MISSING else f.default
