"""The messages between Tandem's processes, as frozen dataclasses: what crosses a process
boundary is one of these, never a tuple or a dict whose keys are spelled in several files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping

from cluster.engine.chat_template import ChatPrompt
from cluster.engine.sampling_params import SamplingParams
from router.config import RouterConfig
from router.router import Decision, Topology


@dataclass(frozen=True)
class ServingInfo:
    """What an ingress needs to know of a deployment to serve it: the model, the request
    limits of its smallest generating worker, the names of its workers, and the registry and
    topology its router places over."""

    cluster: str
    model_dir: str
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int  # of the smallest decode (or colocated) worker: a request needing more can never run
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    colocated: tuple[str, ...]
    registry_url: str
    router_topology: Topology
    router_config: RouterConfig
    transfer_timeout_s: float = 60.0
    stream_layers: bool = True
    stream_token: str = ""  # presented on every connection to a worker's stream (cluster/protocol/stream.py)
    tool_call_format: str = "auto"  # the topology's model.tool_call_format
    pull_timeout_s: float = 5.0  # the topology's kv.pull_timeout_s: a peer pull not done by then is recomputed

    @property
    def workers(self) -> tuple[str, ...]:
        return self.prefill + self.decode + self.colocated


# -- an API's call, as it hands it to the request path (cluster/ingress/request_path.py) ------------


@dataclass(frozen=True)
class ApiRequest:
    """One request as an API edge (gRPC, HTTP, ``tandem run --disaggregated``) read it, before
    the request path checks it. ``sampling`` is a SamplingParams, or a mapping of its fields not
    yet checked; empty values mean the path's defaults (a fresh id, the default SLO class)."""

    prompt: str | list[int] | ChatPrompt
    request_id: str = ""
    model: str = ""
    sampling: SamplingParams | Mapping[str, Any] = field(default_factory=dict)
    max_tokens_to_context: bool = False  # without max_tokens: generate until the context (or KV cache) ends
    slo_class: str = ""
    priority: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    arrival: float | None = None  # when the call reached the API (time.time())
    api: str | None = None  # the API it came through, for metrics (None: the request path's own)
    traceparent: str | None = None  # the caller's trace, when tracing is on


# -- the stream between an ingress and a generating worker (cluster/protocol/stream.py) -----------
#
# One Hello opens a connection; then, per request, one WorkerRequest goes out and TokenDeltas come
# back, the last one carrying ``end``, or the stream ends early with a RequestFailed (the caller
# sees it) or a WorkerFailure (another placement may work). codec.py turns each into plain data.


@dataclass(frozen=True)
class Hello:
    """A connection's first frame: the cluster's stream token."""

    token: str


@dataclass(frozen=True)
class WorkerRequest:
    """One placement of a request, sent to the decode (or colocated) worker that runs it."""

    request_id: str  # this placement's id (a moved request has ``<id>.<n>``)
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # the engine's: the request's own plus its SLO class's
    prefill: str | None = None  # the router's Decision.prefill: the worker computing the KV; None: here
    transfer_timeout_s: float = 60.0
    stream_layers: bool = True
    resumed_tokens: int = 0  # the prompt's last tokens are output an earlier placement streamed (a grammar replays them)
    kv_source: str | None = None  # the router's Decision.kv_source: a peer whose cached prefix is pulled first ...
    kv_source_blocks: int = 0  # ... until this worker holds this many leading blocks (then it prefills the rest)
    pull_timeout_s: float = 5.0  # a pull not done by then ends, and the prefix is computed here instead


@dataclass(frozen=True)
class Usage:
    """A request's token counts (the protocol's own: the engine's ``Usage`` lives beside torch)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    proposed_tokens: int = 0  # speculative guesses the decode worker checked ...
    accepted_tokens: int = 0  # ... and kept (the request's trace shows both)


@dataclass(frozen=True)
class Finished:
    """How a request ended: the one place its finish reason and usage are named."""

    finish_reason: str
    usage: Usage


@dataclass(frozen=True)
class TransferReport:
    """What the KV hand-off of one placement did, with its wall-clock times (for the trace)."""

    prefill: str
    blocks_cached_on_decode: int
    blocks_sent: int
    prefill_cached_tokens: int
    bytes: int
    prefill_span: tuple[float, float]  # the prefill worker's call, start and end
    receive_span: tuple[float, float]  # this worker's receive, start and end
    admitted_at: float  # when the request joined the decode batch
    draft_bytes: int = 0  # of ``bytes``, the draft model's KV of the prompt, built by the prefill worker


@dataclass(frozen=True)
class PullReport:
    """What a pull of a cached prefix from a peer did (``source``), with its wall-clock span
    (for the trace): ``blocks_pulled`` arrived after the ``blocks_held`` the worker cached
    itself; with ``error`` none arrived and the prefix was computed here."""

    source: str
    blocks_asked: int  # the leading blocks the router expected to hold after the pull
    blocks_held: int  # of them, those this worker cached already (they did not travel)
    blocks_pulled: int
    bytes: int
    span: tuple[float, float]  # from the ask to the last layer received (or the failure)
    error: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    """The tokens a worker produced since its caller read the last ones; the last delta of a
    request carries ``end``, the first after a KV hand-off ``transfer``, the first after a
    peer pull ``pull``."""

    token_ids: list[int]
    text: str
    logprobs: list | None = None  # (logprob, [(token id, logprob)]) per token, when asked for
    transfer: TransferReport | None = None
    end: Finished | None = None
    pull: PullReport | None = None

    @property
    def final(self) -> bool:
        return self.end is not None


class FailureKind(str, Enum):
    """Why another placement may work where this one failed."""

    RETRY = "retry"  # a worker failed (``worker`` names it when it was found dead)
    NO_ROOM = "no_room"  # the decode worker had no free KV blocks at that moment
    UNPAIRED = "unpaired"  # the decode worker cannot take KV from ``worker`` (a prefill worker) now


@dataclass(frozen=True)
class WorkerFailure:
    """A placement that failed in a way another placement may not: it ends the stream."""

    kind: FailureKind
    message: str
    worker: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FailureKind(self.kind))

    final = True

    @property
    def failed_worker(self) -> str | None:
        """The worker found dead, if one was."""
        return self.worker if self.kind is FailureKind.RETRY else None

    @property
    def unpaired(self) -> str | None:
        """The prefill worker whose pair with the decode worker is out of use, if that was it."""
        return self.worker if self.kind is FailureKind.UNPAIRED else None


@dataclass(frozen=True)
class RequestFailed:
    """A request ended with an error its caller sees: ``kind`` ``invalid``, ``not_found``,
    ``rejected`` or ``unavailable``. From a worker, or from the request path to the API."""

    kind: str
    message: str
    request_id: str = ""  # set on a request path's first message
    retry_after_s: float | None = None  # rejected: when the router predicts a retry could be placed

    final = True
    finished = True


# -- the prefill worker's answer to a decode worker (a Ray call) ----------------------------------


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token: int | None
    prompt_tokens: int
    cached_tokens: int  # hits in this prefill worker's own prefix cache
    blocks_sent: int
    error: str | None
    first_logprob: float | None = None  # when the request asked for logprobs
    first_top_logprobs: list[tuple[int, float]] | None = None
    service_s: float = 0.0  # the prefill worker's own time on the call: the caller's wait beyond it is the hop
    draft_s_per_token: float | None = None  # its draft's measured seconds a prompt token (None: no draft, none yet)


# -- a decode worker's pull of a peer's cached prefix (a Ray call to the peer) ---------------------


@dataclass(frozen=True)
class PullRequest:
    """Asks a peer to send the KV of a prompt's cached blocks ``first_block`` up to ``blocks``
    over the pair ``pair`` (the asker receives there, with ``tag_base``). ``prompt_token_ids``
    holds the tokens of those blocks only. A peer that gets it past ``deadline`` (wall clock: it
    was stalled) sends nothing: the asker has given up and computes the prefix itself."""

    request_id: str
    prompt_token_ids: list[int]
    first_block: int
    blocks: int
    pair: str
    tag_base: int
    deadline: float


@dataclass(frozen=True)
class PullOffer:
    """The peer's answer: it has pinned ``blocks`` blocks (the leading ones past
    ``first_block`` that it caches, maybe fewer than asked, 0 with ``error``) and is sending
    them; it unpins them once sent, or once the send fails at the deadline."""

    request_id: str
    blocks: int
    error: str | None = None


# -- the request path's messages to its API (cluster/ingress/request_path.py) ---------------------


@dataclass(frozen=True)
class Timings:
    """A request's times in ms, counted from its arrival at the API."""

    queue_ms: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float


@dataclass(frozen=True)
class Ending:
    """What the last message of a request adds: how it finished (reason and usage as the
    request path counts them), its times and where it ran. ``router_told`` settles once the
    router has the request's record (it is told after the last message is handed over)."""

    finished: Finished
    timings: Timings
    decision: Decision
    transfer: TransferReport | None
    migrations: int
    router_told: Any = None  # an asyncio.Future
    pull: PullReport | None = None  # the last placement's pull of a peer's cached prefix, if it made one

    @property
    def finish_reason(self) -> str:
        return self.finished.finish_reason

    @property
    def usage(self) -> Usage:
        return self.finished.usage


@dataclass(frozen=True)
class Output:
    """A request's tokens since its last message, as the request path hands them to an API;
    the first carries ``request_id``, the first of each placement ``placement`` (prefill
    worker, decode worker; "" for none), the last ``end``."""

    token_ids: list[int]
    text: str
    logprobs: list | None = None
    request_id: str = ""
    placement: tuple[str, str] | None = None
    end: Ending | None = None

    @property
    def finished(self) -> bool:
        return self.end is not None


# -- `tandem scale` and the process that owns a deployment (cluster/deployment/control.py) ----------
#
# One Hello, one ScaleRequest; ScaleProgress lines come back while it runs, then one ScaleResult.


@dataclass(frozen=True)
class ScaleRequest:
    """``add`` a worker to the pool ``role``; ``remove`` the worker ``worker`` (drained first:
    its requests in flight finish, or after ``timeout_s`` move); ``move`` it to the pool ``role``."""

    action: str
    role: str = ""
    worker: str = ""
    timeout_s: float = 60.0


@dataclass(frozen=True)
class ScaleProgress:
    """One step of a resize, as a line for the operator."""

    line: str
    final: bool = False


@dataclass(frozen=True)
class ScaleResult:
    """How a resize ended: ``ok``, or ``message`` says why not (one line naming what to change);
    ``worker`` is the worker added (add, move) or removed (remove); ``members`` the pools after."""

    ok: bool
    message: str = ""
    worker: str = ""
    members: dict[str, list[str]] = field(default_factory=dict)
    final: bool = True
