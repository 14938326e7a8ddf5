"""Reading a topology file: YAML to a :class:`ClusterSpec`, with every mistake found reported
as ``FILE:LINE: dotted.key: what is wrong``. Each section is read through the checks its
dataclass declares (``spec.py``); what spans keys (pools that must come together, ports taken
twice, the model's shape) is checked here."""

from __future__ import annotations

import difflib
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit

import yaml

from cluster.topology.checks import Bad, Check, describe
from cluster.topology.spec import (
    ROLES,
    ClusterSpec,
    KVSpec,
    ModelSpec,
    NodeConstraints,
    ObservabilitySpec,
    PoolSpec,
    PlannerSpec,
    RaySpec,
    SPECULATING_ROLES,
    RegistrySpec,
    ServerSpec,
    SpeculativeSpec,
    TLSSpec,
    TracingSpec,
    checked_keys,
    sections_of,
)
from router.config import RouterConfig, RouterConfigError

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


def spec_before_model_check(path: str | Path | None) -> ClusterSpec | None:
    """The topology at ``path`` (None: the default one) checked in every way but against its
    model, or None where it cannot be read or has errors. The model's check imports torch (1.4 s
    on the 2-core machine): ``tandem up`` starts Ray with this spec while that check runs."""
    try:
        text = "" if path is None else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    spec, _, _ = _check(text, str(path or "<topology>"), check_model=False)
    if spec is not None and spec.model.path and not Path(spec.model.path).expanduser().exists():
        return None  # an error said at once, or a model elsewhere (a warning): checked before Ray starts
    return spec


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
    """One mapping of the file: reports unknown keys, reads the known ones through their checks
    (those its dataclass declares)."""

    def __init__(self, ctx: _Context, where: str, value: Any, checks: Mapping[str, Check],
                 sections: Mapping[str, type] = {}):
        self.ctx, self.where, self.checks, self.sections = ctx, where, checks, sections
        self.data: dict = {}
        self.bad: set[str] = set()
        known = sorted([*checks, *sections])
        if value is None:
            return
        if not isinstance(value, dict):
            ctx.error(where, f"must be a mapping with the keys {', '.join(known)}; got {describe(value)}")
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
            except Bad as exc:
                self.bad.add(name)
                self.ctx.error(self.key(name) + (f".{exc.sub}" if exc.sub else ""), str(exc))
        return out

    def section(self, name: str) -> "_Section":
        cls = self.sections[name]
        return _Section(self.ctx, self.key(name), self.data.get(name), checked_keys(cls), sections_of(cls))


def _unknown_key(key: Any, known: list[str]) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown key; {hint}known: {', '.join(known)}"


# The file's top level: ``cluster`` (holding ClusterSpec.name), then ClusterSpec's sections.
_CLUSTER = {"name": checked_keys(ClusterSpec)["name"]}
_TOP = {"cluster": object, **sections_of(ClusterSpec)}
_SECTIONS = tuple(_TOP)


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


def _check(text: str, source: str, model_elsewhere: bool = False, check_model: bool = True
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
        ctx.error("", f"the top level must be a mapping of sections ({', '.join(_SECTIONS)}); got {describe(data)}")
        return None, ctx.errors, []
    top = _Section(ctx, "", data, {}, _TOP)
    cluster = _Section(ctx, "cluster", top.data.get("cluster"), _CLUSTER).values()
    spec = ClusterSpec(
        name=cluster.get("name", "tandem"),
        model=ModelSpec(**top.section("model").values()),
        prefill=_pool(top, "prefill"),
        decode=_pool(top, "decode"),
        colocated=_pool(top, "colocated", default_replicas=0),
        kv=KVSpec(**top.section("kv").values()),
        router=_router(ctx, top.data.get("router")),
        registry=_registry(top),
        server=_server(top),
        observability=_observability(top),
        ray=_ray(top),
        planner=_planner(top),
    )
    _check_pools(ctx, spec)
    _check_peer_pull(ctx, spec)
    if spec.planner.mode != "off" and (spec.colocated.replicas or not spec.prefill.replicas or not spec.decode.replicas):
        ctx.error("planner.mode", f"{spec.planner.mode} sizes prefill and decode pools: the topology needs both and "
                  "no colocated workers (or set planner.mode: off)")
    _check_ports(ctx, spec)
    _check_exposure(ctx, spec)
    if check_model:
        _check_model(ctx, spec, model_elsewhere or spec.ray.address is not None)
    for issues in (ctx.errors, ctx.warnings):
        issues.sort(key=lambda issue: issue.line or 0)
    return (None if ctx.errors else spec), ctx.errors, ctx.warnings


def _pool(top: _Section, role: str, default_replicas: int = 1) -> PoolSpec:
    section = top.section(role)
    node_section = section.section("node")
    pool = PoolSpec(node=NodeConstraints(**node_section.values()), speculative=_speculative(section, role),
                    **{"replicas": default_replicas, **section.values()})
    gpus = pool.node.gpus
    if gpus is not None and pool.tp * pool.gpus_per_rank > gpus and "tp" not in section.bad:
        ranks = f"{pool.tp} ranks of 1 GPU do" if pool.tp != 1 else "1 rank of 1 GPU does"
        top.ctx.error(f"{role}.tp", f"{ranks} not fit on a node of {gpus} GPU{'s' if gpus != 1 else ''}")
    return pool


def _speculative(pool: _Section, role: str) -> SpeculativeSpec | None:
    """The pool's ``speculative`` mapping (null or absent: off); a prefill pool has none."""
    section = pool.section("speculative")
    if pool.data.get("speculative") is None or section.bad:
        return None
    if role not in SPECULATING_ROLES:
        pool.ctx.error(section.where, "prefill workers never speculate (each request leaves them at its first "
                       f"token); set it on {' or '.join(SPECULATING_ROLES)}")
        return None
    values = section.values()
    low, high = values.get("ngram_min", SpeculativeSpec.ngram_min), values.get("ngram_max", SpeculativeSpec.ngram_max)
    if low > high:
        pool.ctx.error(f"{section.where}.ngram_min", f"must not exceed ngram_max ({high}); got {low}")
        return None
    method, draft = values.get("method", SpeculativeSpec.method), values.get("draft_model")
    if method == "draft" and draft is None and "method" not in section.bad:
        pool.ctx.error(f"{section.where}.draft_model", "is required with method draft: the path of a smaller model "
                       "with the model's tokenizer")
        return None
    if method != "draft" and draft is not None:
        pool.ctx.error(f"{section.where}.draft_model", f"is read only with method draft (method is {method}); "
                       "remove it or set method: draft")
        return None
    place = values.get("draft_prompt_kv", SpeculativeSpec.draft_prompt_kv)
    if method != "draft" and place != "auto":
        pool.ctx.error(f"{section.where}.draft_prompt_kv", f"is read only with method draft (method is {method}); "
                       "remove it or set method: draft")
        return None
    if role == "colocated" and place != "auto":
        pool.ctx.error(f"{section.where}.draft_prompt_kv", f"a colocated pool has no prefill worker: its draft builds "
                       f"its prompts' KV itself; remove {place} (auto)")
        return None
    return SpeculativeSpec(**values)


def _check_pools(ctx: _Context, spec: ClusterSpec) -> None:
    prefill, decode, colocated = spec.prefill.replicas, spec.decode.replicas, spec.colocated.replicas
    if prefill and not decode:
        ctx.error("decode.replicas", "prefill workers need decode workers to send their KV to (at least 1)")
    elif decode and not prefill:
        ctx.error("prefill.replicas", "decode workers need prefill workers (at least 1), or use a colocated pool")
    elif not decode and not colocated:
        ctx.error("decode.replicas", "no worker generates: give decode (with prefill) or colocated workers")
    drafting = [role for role in SPECULATING_ROLES if spec.pool(role).replicas and spec.pool(role).speculative
                and spec.pool(role).speculative.method == "draft"]
    if spec.kv.host_cache is not None and drafting:
        where = "the prefill and decode workers" if spec.prompt_draft_model() else f"the {drafting[0]} workers"
        ctx.error("kv.host_cache", f"does not work with a draft model ({drafting[0]}.speculative.method draft: "
                  f"{where} load one, and its KV cache has no host tier); set it to null or use method ngram")


def _check_peer_pull(ctx: _Context, spec: ClusterSpec) -> None:
    """``kv.peer_pull`` only where a pull can happen: between decode workers, of cached prefixes."""
    if not spec.kv.peer_pull:
        return
    if not spec.decode.replicas:
        ctx.error("kv.peer_pull", "pulls go between decode workers and the topology has none (decode.replicas is "
                  "0); set kv.peer_pull: false, or declare decode workers")
    elif not spec.kv.prefix_caching:
        ctx.error("kv.peer_pull", "pulls send a peer's cached prefix, and kv.prefix_caching is false; set "
                  "kv.peer_pull: false, or kv.prefix_caching: true")


def _router(ctx: _Context, data: Any) -> RouterConfig:
    if data is None:
        return RouterConfig()
    if not isinstance(data, dict):
        ctx.error("router", f"must be a mapping; got {describe(data)}")
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


def _registry(top: _Section) -> RegistrySpec:
    registry = RegistrySpec(**top.section("registry").values())
    if registry.url and registry.password_env and urlsplit(registry.url).password:
        top.ctx.error("registry.password_env", "the URL holds a password already; give it in one place")
    elif registry.url and urlsplit(registry.url).password:
        top.ctx.warn("registry.url", "holds a password in the file; prefer password_env")
    return registry


def _server(top: _Section) -> ServerSpec:
    section = top.section("server")
    values = section.values()
    tls_section = section.section("tls")
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
    section = top.section("observability")
    values = section.values()
    tracing = TracingSpec(**section.section("tracing").values())
    if tracing.endpoint and tracing.exporter != "otlp":
        top.ctx.warn("observability.tracing.endpoint", f"is used only with exporter otlp (now {tracing.exporter})")
    return ObservabilitySpec(tracing=tracing, **values)


def _ray(top: _Section) -> RaySpec:
    ray = RaySpec(**top.section("ray").values())
    if ray.address and ray.num_cpus is not None:
        top.ctx.error("ray.num_cpus", "only for a local Ray: remove it, or ray.address to start one")
    return ray


def _planner(top: _Section) -> PlannerSpec:
    planner = PlannerSpec(**top.section("planner").values())
    for role in ("prefill", "decode"):
        low, high = getattr(planner, f"{role}_min"), getattr(planner, f"{role}_max")
        if high is not None and high < low:
            top.ctx.error(f"planner.{role}_max", f"must be at least {role}_min ({low}), got {high}")
    if planner.min_workers is not None and planner.max_workers is not None and planner.min_workers > planner.max_workers:
        top.ctx.error("planner.min_workers", f"must be at most max_workers ({planner.max_workers}), got {planner.min_workers}")
    if planner.max_workers is not None and planner.max_workers < planner.prefill_min + planner.decode_min:
        top.ctx.error("planner.max_workers", f"must be at least prefill_min + decode_min "
                      f"({planner.prefill_min + planner.decode_min}), got {planner.max_workers}")
    return planner


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
    from cluster.engine.models.source import resolve_model_source

    if not spec.model.path:
        from cluster.default_model import default_model_config

        try:
            config = default_model_config(spec.model.dtype)
        except (ValueError, OSError) as exc:
            ctx.error("model.path", f"the default model's config.json cannot be read: {exc}")
            return
        _check_against(ctx, spec, config)
        _check_quantization(ctx, spec, shipped="gguf")
        from cluster.default_model import DEFAULT_MODEL_NAME, cache_dir

        cached = cache_dir() / "models" / DEFAULT_MODEL_NAME
        _check_drafts(ctx, spec, config, cached if cached.is_file() else None, elsewhere)
        return
    path = Path(spec.model.path).expanduser()
    if not path.exists():
        _check_drafts(ctx, spec, None, None, elsewhere)
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
    _check_quantization(ctx, spec, shipped="gguf" if resolve_model_source(path).is_gguf else config.quant_method)
    _check_drafts(ctx, spec, config, path, elsewhere)


def _check_drafts(ctx: _Context, spec: ClusterSpec, config, model: Path | None, elsewhere: bool) -> None:
    """Each speculating pool's ``draft_model`` exists here (a warning where the models live
    ``elsewhere``) and can guess for the model at ``model`` (its tokenizer, vocabulary and context;
    None: the model is not readable here, so that is left to the workers, with a warning)."""
    from cluster.engine.speculative.config import SpeculativeConfigError
    from cluster.engine.speculative.draft_model import FIELD, check_draft_path

    for role in SPECULATING_ROLES:
        pool = spec.pool(role)
        speculative = pool.speculative
        if not pool.replicas or speculative is None or speculative.method != "draft":
            continue
        key = f"{role}.speculative.draft_model"
        path = Path(speculative.draft_model).expanduser()
        if not path.exists():
            if elsewhere:
                ctx.warn(key, f"{path} does not exist here; the draft is checked against the model only where both "
                         "are readable")
            else:
                ctx.error(key, f"{path} does not exist here: give a local model directory or .gguf file with the "
                          "model's tokenizer")
            continue
        if model is None or config is None:
            ctx.warn(key, "the model is not readable here: the draft's tokenizer, vocabulary and context are checked "
                     "against it by the workers")
            continue
        try:
            check_draft_path(str(path), model, config, spec.model.dtype, spec.model.max_model_len or
                             config.max_position_embeddings)
        except SpeculativeConfigError as exc:
            ctx.error(key, str(exc).removeprefix(f"{FIELD}: "))


def _check_quantization(ctx: _Context, spec: ClusterSpec, shipped: str | None) -> None:
    """``model.quantization`` has kernels on every pool's device (as each engine will resolve it;
    a GPU pool's engine on its default backend, Triton). ``kv.cache_dtype`` needs no check: every
    attention path reads an 8-bit cache (the native CPU kernels, the Triton kernels on a GPU, and
    the plain-torch path, which dequantizes rows with torch on any device)."""
    from cluster.engine.quantization.choice import QuantizationChoiceError, resolve_quantization

    for role in ROLES:
        pool = spec.pool(role)
        if not pool.replicas:
            continue
        try:
            resolve_quantization(spec.model.quantization, shipped, pool.device.partition(":")[0])
        except QuantizationChoiceError as exc:
            ctx.error("model.quantization", f"{role} pool ({pool.device}): {exc}")
            return


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
