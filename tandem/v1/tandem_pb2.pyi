from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "speculative", "json_schema", "json_object", "regex", "grammar", "choice")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    speculative: bool
    json_schema: str
    json_object: bool
    regex: str
    grammar: Grammar
    choice: Choice
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., speculative: _Optional[bool] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., choice: _Optional[_Union[Choice, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("text", "syntax")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SYNTAX_FIELD_NUMBER: _ClassVar[int]
    text: str
    syntax: str
    def __init__(self, text: _Optional[str] = ..., syntax: _Optional[str] = ...) -> None: ...

class Choice(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class Objectives(_message.Message):
    __slots__ = ("ttft_ms", "tpot_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tpot_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "chat", "sampling", "slo_class", "objectives", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    OBJECTIVES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: TokenIds
    chat: Chat
    sampling: SamplingParams
    slo_class: str
    objectives: Objectives
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., slo_class: _Optional[str] = ..., objectives: _Optional[_Union[Objectives, _Mapping]] = ..., priority: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class FunctionTool(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "tools", "tool_mode", "tool_function", "parallel_tool_calls")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_MODE_FIELD_NUMBER: _ClassVar[int]
    TOOL_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[FunctionTool]
    tool_mode: str
    tool_function: str
    parallel_tool_calls: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[FunctionTool, _Mapping]]] = ..., tool_mode: _Optional[str] = ..., tool_function: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "ttft_ms", "tpot_ms", "e2e_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., e2e_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finished", "finish_reason", "usage", "timings", "prefill_worker", "decode_worker", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finished: bool
    finish_reason: str
    usage: Usage
    timings: Timings
    prefill_worker: str
    decode_worker: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "architecture", "max_model_len", "vocab_size", "block_size", "has_tokenizer", "slo_classes", "default_slo_class", "has_chat_template")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASSES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    has_tokenizer: bool
    slo_classes: _containers.RepeatedScalarFieldContainer[str]
    default_slo_class: str
    has_chat_template: bool
    def __init__(self, name: _Optional[str] = ..., architecture: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., slo_classes: _Optional[_Iterable[str]] = ..., default_slo_class: _Optional[str] = ..., has_chat_template: _Optional[bool] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("name", "role", "state", "tp", "kv_blocks_used", "kv_blocks", "waiting", "running", "receiving", "prefix_cache_hit_rate", "registry", "pid", "unpaired", "pair_rebuilds", "speculation", "node_id", "node_address", "started_at", "drain", "transfer_groups", "host_tier", "pulls", "draft")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    RECEIVING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UNPAIRED_FIELD_NUMBER: _ClassVar[int]
    PAIR_REBUILDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    state: str
    tp: int
    kv_blocks_used: int
    kv_blocks: int
    waiting: int
    running: int
    receiving: int
    prefix_cache_hit_rate: float
    registry: str
    pid: int
    unpaired: _containers.RepeatedScalarFieldContainer[str]
    pair_rebuilds: int
    speculation: Speculation
    node_id: str
    node_address: str
    started_at: float
    drain: str
    transfer_groups: _containers.RepeatedScalarFieldContainer[str]
    host_tier: HostTier
    pulls: PeerPulls
    draft: DraftPrompts
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., tp: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., receiving: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., registry: _Optional[str] = ..., pid: _Optional[int] = ..., unpaired: _Optional[_Iterable[str]] = ..., pair_rebuilds: _Optional[int] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ..., node_id: _Optional[str] = ..., node_address: _Optional[str] = ..., started_at: _Optional[float] = ..., drain: _Optional[str] = ..., transfer_groups: _Optional[_Iterable[str]] = ..., host_tier: _Optional[_Union[HostTier, _Mapping]] = ..., pulls: _Optional[_Union[PeerPulls, _Mapping]] = ..., draft: _Optional[_Union[DraftPrompts, _Mapping]] = ...) -> None: ...

class DraftPrompts(_message.Message):
    __slots__ = ("prompt_tokens_fed", "prompts_received", "forwards")
    PROMPT_TOKENS_FED_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens_fed: int
    prompts_received: int
    forwards: int
    def __init__(self, prompt_tokens_fed: _Optional[int] = ..., prompts_received: _Optional[int] = ..., forwards: _Optional[int] = ...) -> None: ...

class HostTier(_message.Message):
    __slots__ = ("blocks", "used", "offloaded_blocks", "loaded_blocks", "load_seconds")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    used: int
    offloaded_blocks: int
    loaded_blocks: int
    load_seconds: float
    def __init__(self, blocks: _Optional[int] = ..., used: _Optional[int] = ..., offloaded_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class PeerPulls(_message.Message):
    __slots__ = ("pulled", "recomputed", "blocks")
    PULLED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pulled: int
    recomputed: int
    blocks: int
    def __init__(self, pulled: _Optional[int] = ..., recomputed: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class WorkerEvent(_message.Message):
    __slots__ = ("worker", "role", "event", "node_id", "node_address", "at", "detail")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    worker: str
    role: str
    event: str
    node_id: str
    node_address: str
    at: float
    detail: str
    def __init__(self, worker: _Optional[str] = ..., role: _Optional[str] = ..., event: _Optional[str] = ..., node_id: _Optional[str] = ..., node_address: _Optional[str] = ..., at: _Optional[float] = ..., detail: _Optional[str] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("method", "num_tokens", "adaptive", "proposed_tokens", "accepted_tokens", "verify_steps", "acceptance_rate", "tokens_per_verify")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_VERIFY_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_tokens: int
    adaptive: bool
    proposed_tokens: int
    accepted_tokens: int
    verify_steps: int
    acceptance_rate: float
    tokens_per_verify: float
    def __init__(self, method: _Optional[str] = ..., num_tokens: _Optional[int] = ..., adaptive: _Optional[bool] = ..., proposed_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., verify_steps: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., tokens_per_verify: _Optional[float] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("name", "policy", "registry", "waiting", "in_flight", "placed", "local_prefills", "rejected", "queued_decisions", "placed_by_load_only", "placed_after_waiting", "last_rejection", "live_workers", "failed_workers", "waiting_by_class", "ttft_correction_s", "ttft_prediction_error", "goodput_records_waiting", "rejected_by_class", "warm_up_s", "prefill_path_remeasures")
    class WaitingByClassEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class TtftCorrectionSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RejectedByClassEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PLACED_BY_LOAD_ONLY_FIELD_NUMBER: _ClassVar[int]
    PLACED_AFTER_WAITING_FIELD_NUMBER: _ClassVar[int]
    LAST_REJECTION_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_BY_CLASS_FIELD_NUMBER: _ClassVar[int]
    TTFT_CORRECTION_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_PREDICTION_ERROR_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_RECORDS_WAITING_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BY_CLASS_FIELD_NUMBER: _ClassVar[int]
    WARM_UP_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PATH_REMEASURES_FIELD_NUMBER: _ClassVar[int]
    name: str
    policy: str
    registry: str
    waiting: int
    in_flight: int
    placed: int
    local_prefills: int
    rejected: int
    queued_decisions: int
    placed_by_load_only: int
    placed_after_waiting: int
    last_rejection: str
    live_workers: _containers.RepeatedScalarFieldContainer[str]
    failed_workers: _containers.RepeatedScalarFieldContainer[str]
    waiting_by_class: _containers.ScalarMap[str, int]
    ttft_correction_s: _containers.ScalarMap[str, float]
    ttft_prediction_error: float
    goodput_records_waiting: int
    rejected_by_class: _containers.ScalarMap[str, int]
    warm_up_s: float
    prefill_path_remeasures: int
    def __init__(self, name: _Optional[str] = ..., policy: _Optional[str] = ..., registry: _Optional[str] = ..., waiting: _Optional[int] = ..., in_flight: _Optional[int] = ..., placed: _Optional[int] = ..., local_prefills: _Optional[int] = ..., rejected: _Optional[int] = ..., queued_decisions: _Optional[int] = ..., placed_by_load_only: _Optional[int] = ..., placed_after_waiting: _Optional[int] = ..., last_rejection: _Optional[str] = ..., live_workers: _Optional[_Iterable[str]] = ..., failed_workers: _Optional[_Iterable[str]] = ..., waiting_by_class: _Optional[_Mapping[str, int]] = ..., ttft_correction_s: _Optional[_Mapping[str, float]] = ..., ttft_prediction_error: _Optional[float] = ..., goodput_records_waiting: _Optional[int] = ..., rejected_by_class: _Optional[_Mapping[str, int]] = ..., warm_up_s: _Optional[float] = ..., prefill_path_remeasures: _Optional[int] = ...) -> None: ...

class SloWindow(_message.Message):
    __slots__ = ("window_s", "requests", "met", "ttft_met", "tpot_met", "failed", "mean_ttft_s", "mean_tpot_s", "goodput_rps", "attainment")
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MET_FIELD_NUMBER: _ClassVar[int]
    TTFT_MET_FIELD_NUMBER: _ClassVar[int]
    TPOT_MET_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    MEAN_TTFT_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_TPOT_S_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_RPS_FIELD_NUMBER: _ClassVar[int]
    ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    window_s: float
    requests: int
    met: int
    ttft_met: int
    tpot_met: int
    failed: int
    mean_ttft_s: float
    mean_tpot_s: float
    goodput_rps: float
    attainment: float
    def __init__(self, window_s: _Optional[float] = ..., requests: _Optional[int] = ..., met: _Optional[int] = ..., ttft_met: _Optional[int] = ..., tpot_met: _Optional[int] = ..., failed: _Optional[int] = ..., mean_ttft_s: _Optional[float] = ..., mean_tpot_s: _Optional[float] = ..., goodput_rps: _Optional[float] = ..., attainment: _Optional[float] = ...) -> None: ...

class GoodputView(_message.Message):
    __slots__ = ("cluster", "classes", "workers")
    class ClassesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SloWindow
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SloWindow, _Mapping]] = ...) -> None: ...
    class WorkersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SloWindow
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SloWindow, _Mapping]] = ...) -> None: ...
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    cluster: SloWindow
    classes: _containers.MessageMap[str, SloWindow]
    workers: _containers.MessageMap[str, SloWindow]
    def __init__(self, cluster: _Optional[_Union[SloWindow, _Mapping]] = ..., classes: _Optional[_Mapping[str, SloWindow]] = ..., workers: _Optional[_Mapping[str, SloWindow]] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("cluster", "model", "workers", "routers", "last_minute", "last_hour", "serving", "health", "worker_events", "planner")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTERS_FIELD_NUMBER: _ClassVar[int]
    LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    LAST_HOUR_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    WORKER_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PLANNER_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    model: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    routers: _containers.RepeatedCompositeFieldContainer[RouterStatus]
    last_minute: GoodputView
    last_hour: GoodputView
    serving: bool
    health: str
    worker_events: _containers.RepeatedCompositeFieldContainer[WorkerEvent]
    planner: PlannerStatus
    def __init__(self, cluster: _Optional[str] = ..., model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., routers: _Optional[_Iterable[_Union[RouterStatus, _Mapping]]] = ..., last_minute: _Optional[_Union[GoodputView, _Mapping]] = ..., last_hour: _Optional[_Union[GoodputView, _Mapping]] = ..., serving: _Optional[bool] = ..., health: _Optional[str] = ..., worker_events: _Optional[_Iterable[_Union[WorkerEvent, _Mapping]]] = ..., planner: _Optional[_Union[PlannerStatus, _Mapping]] = ...) -> None: ...

class PlannerStatus(_message.Message):
    __slots__ = ("mode", "latest_at", "observed", "proposal", "waiting", "decisions")
    MODE_FIELD_NUMBER: _ClassVar[int]
    LATEST_AT_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    latest_at: float
    observed: str
    proposal: str
    waiting: str
    decisions: _containers.RepeatedCompositeFieldContainer[PlannerDecision]
    def __init__(self, mode: _Optional[str] = ..., latest_at: _Optional[float] = ..., observed: _Optional[str] = ..., proposal: _Optional[str] = ..., waiting: _Optional[str] = ..., decisions: _Optional[_Iterable[_Union[PlannerDecision, _Mapping]]] = ...) -> None: ...

class PlannerDecision(_message.Message):
    __slots__ = ("number", "at", "mode", "current", "proposed", "acted", "predicted_goodput_rps", "predicted_attainment", "observed", "detail", "measured_goodput_rps", "measured_attainment", "measured_at", "measured_rate_rps", "expected_goodput_rps")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GOODPUT_RPS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    MEASURED_GOODPUT_RPS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_ATTAINMENT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    MEASURED_RATE_RPS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_GOODPUT_RPS_FIELD_NUMBER: _ClassVar[int]
    number: int
    at: float
    mode: str
    current: str
    proposed: str
    acted: bool
    predicted_goodput_rps: float
    predicted_attainment: float
    observed: str
    detail: str
    measured_goodput_rps: float
    measured_attainment: float
    measured_at: float
    measured_rate_rps: float
    expected_goodput_rps: float
    def __init__(self, number: _Optional[int] = ..., at: _Optional[float] = ..., mode: _Optional[str] = ..., current: _Optional[str] = ..., proposed: _Optional[str] = ..., acted: _Optional[bool] = ..., predicted_goodput_rps: _Optional[float] = ..., predicted_attainment: _Optional[float] = ..., observed: _Optional[str] = ..., detail: _Optional[str] = ..., measured_goodput_rps: _Optional[float] = ..., measured_attainment: _Optional[float] = ..., measured_at: _Optional[float] = ..., measured_rate_rps: _Optional[float] = ..., expected_goodput_rps: _Optional[float] = ...) -> None: ...
