"""The engine: requests in, one scheduled step at a time, outputs out.

A prefill worker runs this engine until each request's first token; a decode worker runs it
with requests whose KV arrives already computed; the colocated mode runs both phases here.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from itertools import islice
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from cluster.engine.block_hash import hash_token_blocks, request_hash_keys
from cluster.engine.block_manager import BlockManager
from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.kernels.threads import torch_ops_single_threaded
from cluster.engine.kernels.triton_support import BackendUnavailableError, resolve_attention_backend
from cluster.engine.kv_port import KVPortFactory, KVStream
from cluster.engine.kv_tiers.copy_queue import CopyJob, CopyQueue
from cluster.engine.kv_tiers.host_pool import HostBlockPool, Load, Offload
from cluster.engine.kv_tiers.host_store import HostKVStore, host_block_bytes, host_format
from cluster.engine.kv_tiers.size import parse_host_cache
from cluster.engine.model_runner import ModelRunner, device_memory_bytes
from cluster.engine.models.config import ModelConfig
from cluster.engine.models.read_config import load_model_config
from cluster.engine.models.source import ModelSource, resolve_model_source
from cluster.engine.quantization.choice import QuantizationChoiceError, resolve_quantization
from cluster.engine.request import FinishReason, Request, RequestStatus, TransferTarget, row_runs
from cluster.engine.sampler import make_generator, skip_one_draw
from cluster.engine.sampling_params import InvalidRequestError, SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerOutput
from cluster.engine.speculative.config import SpeculativeConfigError
from cluster.engine.speculative.draft import DraftProposer
from cluster.engine.speculative.draft_model import check_draft, draft_quantization, read_draft
from cluster.engine.speculative.policy import (FITTED_STEPS, REFIT_STEPS, GuessGate, StepCost, catch_up_share,
                                                plan_guesses, update_acceptance, update_continuation, worth_a_row)
from cluster.engine.speculative.proposer import NgramProposer, Proposer
from cluster.engine.speculative.verify import accepted_prefix
from cluster.engine.structured.backend import GrammarBackend
from cluster.engine.structured.masks import StepMasks
from cluster.engine.structured.matcher import Matcher
from cluster.engine.structured.spec import StructuredOutput
from cluster.engine.request_limits import check_request_id, check_stop_token_ids
from cluster.engine.prompt import Prompt, prompt_token_ids
from cluster.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    proposed_tokens: int = 0  # speculative guesses checked for this request ...
    accepted_tokens: int = 0  # ... and kept


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    delta_text: str
    finished: bool
    finish_reason: str | None
    error: str | None
    usage: Usage
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    scheduled_time: float | None = None  # when it left the queue (placed, or first scheduled)
    error_kind: str | None = None  # with an error: "invalid", "rejected" or "unavailable"


@dataclass(frozen=True)
class StepRecord:
    """One step's shape and time: what the router's cost model is fitted to."""

    num_decode_tokens: int
    num_prefill_tokens: int
    seconds: float
    context_tokens: int  # KV tokens the decodes attended to
    prefill_attention: int = 0  # sum over prefill chunks of chunk tokens x tokens attended (the quadratic term)
    kv_blocks_sent: int = 0
    transfer_tail_s: float = 0.0  # of ``seconds``, the wait for sends after the last layer
    guess_tokens: int = 0  # rows that checked a speculative guess (counted in neither of the above)
    accepted_tokens: int = 0  # of those guesses, the ones kept (each a token beyond one per decode)
    draft_seconds: float = 0.0  # of ``seconds``, the draft model's forwards (speculative ``draft``) ...
    draft_prompt_tokens: int = 0  # ... where they built prompts' draft KV to send, the tokens fed (prompt_draft_model)
    host_loaded_blocks: int = 0  # blocks loaded from the host tier since the last step's record ...
    host_load_s: float = 0.0  # ... and their loads' waits, each from queued to copied (see EngineStats)


LOAD_WAIT_S = 0.02  # a step with nothing to run waits up to this for a host-tier load in flight
PREFILL_STEPS_KEPT = 16  # the latest prefill-only steps kept apart from the rest (``EngineStats.prefill_steps``)
DECODE_STEPS_PER_WIDTH = 2  # the latest decode-only steps kept per batch width (``EngineStats.decode_steps``)


@dataclass
class EngineStats:
    """Counters an operator (and the benchmarks) read; ``steps`` keeps the recent steps."""

    num_steps: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: deque = field(default_factory=lambda: deque(maxlen=4096))
    # The latest prefill-only steps, however many decode steps came since: a decode worker's
    # prompts are a few steps among thousands of decodes, and its load reports carry these so
    # that the router's fit of its prefill follows what it measured, not its start-up profile.
    prefill_steps: deque = field(default_factory=lambda: deque(maxlen=PREFILL_STEPS_KEPT))
    # The latest decode-only steps of each batch width (1, 2-3, 4-7, ...: a power of two and up),
    # for the same reports: after a run of one-sequence steps (a worker just started again, a
    # quiet hour) the latest steps hold no wide batch, and a decode fit from them alone put a
    # batch of 60 at 259 ms a token where it ran at about 63: a burst then found 3 of 64 refused.
    decode_steps: dict = field(default_factory=dict)
    proposed_tokens: int = 0  # speculative decoding: guesses checked ...
    accepted_tokens: int = 0  # ... and kept ...
    verify_steps: int = 0  # ... over this many request-steps
    host_offloaded_blocks: int = 0  # blocks copied to the host tier as the device cache evicted them ...
    host_loaded_blocks: int = 0  # ... and back, as prefix hits (in the background, while other requests run)
    # The engine's thread on copies between tiers, on the steps' path: the offloads it made itself
    # (evictions not written back ahead) and its waits for copies in the background (write-backs
    # of blocks it reallocated; loads of blocks a peer's pull sends).
    host_copy_seconds: float = 0.0
    # Each load's wait, from queued to copied: what a request that hits the host tier waits before
    # its prefill, and what the router's cost model prices a host hit by (per block loaded).
    host_load_seconds: float = 0.0
    host_written_back_blocks: int = 0  # of the offloads, those copied ahead of eviction, off the critical path
    host_load_failures: int = 0  # loads whose copy failed (their requests ended with the error)

    def record(self, step: StepRecord) -> None:
        self.steps.append(step)
        if step.num_prefill_tokens and not step.num_decode_tokens:
            self.prefill_steps.append(step)
        elif step.num_decode_tokens and not step.num_prefill_tokens:
            width = step.num_decode_tokens.bit_length()  # 1; 2-3; 4-7; ...
            self.decode_steps.setdefault(width, deque(maxlen=DECODE_STEPS_PER_WIDTH)).append(step)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens a request's step emitted when it checked guesses (1 + kept guesses)."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _log(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


RunnerFactory = Callable[[EngineConfig, ModelConfig, Path, int, Callable | None], ModelRunner]
"""(engine config, model config, model directory, max_model_len, progress) -> the runner: how
the layers above give the engine its tensor-parallel ranks (``cluster/parallel/tp_runner.py``)
and a KV port (``cluster/engine/kv_port.py``), which the engine itself never imports."""


def single_rank_runner(cfg: EngineConfig, model_config: ModelConfig, model_dir: Path, max_model_len: int,
                       progress, kv_port: KVPortFactory | None = None) -> ModelRunner:
    """The runner of an engine of one rank."""
    return ModelRunner(model_config, model_dir, cfg.block_size, max_model_len, cfg.device, progress=progress,
                       attention_backend=cfg.attention_backend, enforce_eager=cfg.enforce_eager,
                       max_num_seqs=cfg.max_num_seqs, load_format=cfg.load_format, kv_port=kv_port)


class LLMEngine:
    def __init__(self, config: EngineConfig, verbose: bool = True, make_runner: RunnerFactory | None = None,
                 fault_kv_in_background: bool = False):
        """``make_runner`` builds the model runner (see :data:`RunnerFactory`); without it the
        engine runs one rank and moves no KV. ``fault_kv_in_background``: the engine is ready
        while a CPU KV cache's pages are still being faulted in."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        source = resolve_model_source(config.model)
        model_dir = source.path
        model_config = load_model_config(source, config.dtype)
        shipped = "gguf" if source.is_gguf else model_config.quant_method
        self.model_config = replace(model_config, quantization=self._quantization(shipped),
                                    kv_cache_dtype=config.kv_cache_dtype,
                                    cpu_matmul_dtype=config.resolved_cpu_matmul_dtype())
        self.max_model_len = self._max_model_len()
        self.tokenizer = self._load_tokenizer(source, verbose)
        progress = (lambda done, total, unit: _log(f"loading weights: {done}/{total} {unit}")) if verbose else None
        started = time.perf_counter()
        self.runner = self._make_runner(model_dir, progress, make_runner)
        self.proposer: Proposer | None = self._make_proposer(progress)
        # The draft model, guessing (the proposer) or only building the prompts' KV it sends.
        self.draft: DraftProposer | None = (self.proposer if isinstance(self.proposer, DraftProposer) else
                                            self._load_draft(config.prompt_draft_model, progress)
                                            if config.prompt_draft_model else None)
        self._draft_port = None  # the draft's KV port (made on first use, over the runner's)
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks, fault_kv_in_background)
        if self.draft is not None:
            self.draft.allocate(num_blocks)
        # Where the fused native step runs the model, torch's own ops around it run single-threaded
        # (kernels/threads.py: its OpenMP threads spun through the kernels' next step).
        fused = getattr(self.runner, "native_step", None) is not None
        self._torch_threads = torch_ops_single_threaded if fused else nullcontext
        if verbose:
            _log(
                f"{self.model_config.architecture} from {model_dir}: {self.runner.weight_bytes / 2**20:.1f} MiB of "
                f"{self._weights_kind()} weights, {num_blocks} KV blocks of "
                f"{config.block_size} tokens ({num_blocks * self.runner.block_bytes / 2**20:.0f} MiB), "
                f"ready in {time.perf_counter() - started:.1f}s"
            )
        self.host_store, host_pool = self._host_tier(verbose)
        # Two copiers in the background: write-backs to the host tier, and loads back from it (on
        # one CPU thread, out of the way of the steps' threads: on CUDA a copy is a DMA anyway).
        self.copy_queue = CopyQueue(self.host_store.offload) if self.host_store is not None else None
        self.load_queue = (CopyQueue(self.host_store.load, name="kv-host-loads", torch_threads=1)
                           if self.host_store is not None else None)
        self._loads: deque[CopyJob] = deque()  # loads in flight, in the order queued (and made)
        # write-back after each step: the blocks the next step could evict at most
        self._write_back_blocks = config.max_num_batched_tokens // config.block_size + config.max_num_seqs
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, host_pool)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            extra_hash_keys=(self.model_config.architecture, source.name),
            partial_hits=self.draft is None,  # a draft's cache holds the same blocks: copied alike, or not at all
        )
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.speculative = config.speculative  # None: one token per decode step
        self._cost: StepCost | None = None  # the step cost the speculative policy uses (_step_cost)
        self._cost_fitted_at: int | None = None
        self.guess_gate = GuessGate()  # whether any guess could pay in a step, before any lookup
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.grammars: GrammarBackend | None = None  # made by the first constrained request (_matcher)
        self._masks: StepMasks | None = None
        self.stats = EngineStats()
        self._host_loads_recorded = (0, 0.0)  # the host loads counted in step records so far
        self._failed_loads: list[Request] = []  # waiting requests to end at the next step: a load failed
        self.transfer_errors: dict[str, str | None] = {}  # request id -> None (sent) or the error

    def _host_tier(self, verbose: bool) -> tuple[HostKVStore | None, HostBlockPool | None]:
        """The host KV tier (``config.host_cache``), or (None, None) when off."""
        size = parse_host_cache(self.config.host_cache)
        if size is None:
            return None, None
        attn = self.runner.model.attention_layers()[0]
        fmt = host_format(self.runner.kv_format, self.runner.device.type)
        block_bytes = host_block_bytes(fmt, len(self.runner.model.attention_layers()), self.config.block_size,
                                       attn.num_kv_heads, attn.head_dim)
        slots = size.num_blocks(block_bytes)
        if slots < 1:
            raise EngineConfigError(f"host_cache {self.config.host_cache} holds no block of {block_bytes} bytes; "
                                    "give it more memory or a block count")
        store = HostKVStore(self.runner.kv_cache, self.runner.kv_format, fmt, slots, attn.head_dim)
        if verbose:
            _log(f"host KV tier: {slots} blocks of {fmt.name} ({slots * block_bytes / 2**20:.0f} MiB)")
        return store, HostBlockPool(slots)

    def _move_between_tiers(self) -> None:
        """Makes the offloads the block manager recorded (evicted blocks to the host tier) before
        anything writes those blocks, and queues its loads (host hits back) on the load copier,
        which makes them while the steps run; first, where the block manager's ordering rule says
        so, waits for the write-backs in flight."""
        if self.copy_queue is not None:
            if self.copy_queue.idle:
                self.block_manager.copies_done()
            elif self.block_manager.must_wait_for_copies():
                started = time.perf_counter()
                self.copy_queue.wait()
                self.block_manager.copies_done()
                self.stats.host_copy_seconds += time.perf_counter() - started
        moves = self.block_manager.drain_moves()
        if not moves:
            return
        # Offloads before loads: a block evicted may be a load's target (the block manager's
        # rule keeps every other pair of these copies apart, in blocks and in slots).
        offloads = [move for move in moves if isinstance(move, Offload)]
        if offloads:
            started = time.perf_counter()
            self.host_store.offload(offloads)
            self.stats.host_offloaded_blocks += len({move.slot for move in offloads})
            self.stats.host_copy_seconds += time.perf_counter() - started
        job = self.load_queue.submit([move for move in moves if isinstance(move, Load)])
        if job is not None:
            self._loads.append(job)

    def _collect_loads(self) -> None:
        """The loads whose copies are made, oldest first: their blocks are loaded (the requests
        that hold them may run), or, where a copy failed, uncached, and the requests that hold
        them marked to end with the error (a waiting one at the next step, one still receiving
        KV at its admission)."""
        while self._loads and self._loads[0].done.is_set():
            job = self._loads.popleft()
            blocks = [move.block_id for move in job.moves]
            if job.error is None:
                self.stats.host_loaded_blocks += len(blocks)
                self.stats.host_load_seconds += job.wait_seconds
            else:
                self._mark_load_failed(blocks, job.error)
            self.block_manager.loads_done(blocks, failed=job.error is not None)

    def _mark_load_failed(self, blocks: list[int], error: BaseException) -> None:
        failed = set(blocks)
        message = f"loading the prompt's cached prefix from the host KV tier failed: {error}"
        _log(message)
        self.stats.host_load_failures += 1
        holders = [r for r in self.scheduler.waiting if r.status is RequestStatus.LOADING]
        for request in holders + list(self.scheduler.receiving.values()):
            index = next((i for i, b in enumerate(request.block_ids) if b in failed), None)
            if index is not None and request.load_failure is None:
                request.load_failure = (index, message)
                if request.status is RequestStatus.LOADING:
                    self._failed_loads.append(request)

    def _end_failed_loads(self) -> list[RequestOutput]:
        """Ends the requests marked by a failed load (waiting, or admitted since), with its error."""
        outputs = []
        for request in self._failed_loads:
            if not request.finished:
                self.scheduler.finish(request, FinishReason.ERROR, request.load_failure[1])
                outputs.append(self._output(request, []))
        self._failed_loads.clear()
        return outputs

    def _wait_for_loads(self, block_ids: Sequence[int]) -> None:
        """Until none of these blocks is being loaded: the engine's thread waits (a peer's pull
        sends them at once)."""
        started = time.perf_counter()
        while self._loads and self.block_manager.is_loading(block_ids):
            self._loads[0].done.wait()
            self._collect_loads()
        self.stats.host_copy_seconds += time.perf_counter() - started

    def _wait_for_any_load(self) -> None:
        """A step with nothing to run while loads are in flight: waits a while for the oldest,
        rather than have the caller spin."""
        if self._loads:
            self._loads[0].done.wait(LOAD_WAIT_S)

    def _write_back(self) -> None:
        """After a step's forward: the free cached blocks next in line for eviction are copied
        to the host tier in the background, so that evicting them costs the step no copy."""
        if self.copy_queue is None:
            return
        offloads = self.block_manager.write_back(self._write_back_blocks)
        self.copy_queue.submit(offloads)
        self.stats.host_offloaded_blocks += len(offloads)
        self.stats.host_written_back_blocks += len(offloads)

    def _host_loads(self) -> tuple[int, float]:
        """Blocks loaded from the host tier so far, and their loads' waits."""
        return self.stats.host_loaded_blocks, self.stats.host_load_seconds

    def _weights_kind(self) -> str:
        dtype = str(self.model_config.dtype).removeprefix("torch.")
        kind = self.model_config.quantization
        if kind == "checkpoint":
            kind = f"{self.model_config.quant_method}-packed"
        return {"none": dtype, "gguf": f"GGUF-packed ({dtype} activations)"}.get(kind, f"{kind} ({dtype} activations)")

    def _quantization(self, shipped: str | None) -> str:
        """On CUDA the quantized kernels are the Triton backend's: the backend is resolved first."""
        device = torch.device(self.config.device)
        try:
            backend = resolve_attention_backend(self.config.attention_backend, device)
            return resolve_quantization(self.config.quantization, shipped, device.type, backend)
        except (BackendUnavailableError, QuantizationChoiceError) as exc:
            raise EngineConfigError(str(exc)) from None

    def _make_runner(self, model_dir: Path, progress, make_runner: RunnerFactory | None) -> ModelRunner:
        cfg = self.config
        try:
            resolve_attention_backend(cfg.attention_backend, torch.device(cfg.device))
        except BackendUnavailableError as exc:
            raise EngineConfigError(str(exc)) from None
        if make_runner is not None:
            return make_runner(cfg, self.model_config, model_dir, self.max_model_len, progress)
        if cfg.tensor_parallel_size != 1:
            raise EngineConfigError(f"tensor_parallel_size {cfg.tensor_parallel_size} needs a tensor-parallel runner: "
                                    "build the engine through tandem.LLM or a worker")
        return single_rank_runner(cfg, self.model_config, model_dir, self.max_model_len, progress)

    def _make_proposer(self, progress) -> Proposer | None:
        """The speculative proposer; a draft model is checked against the target, then loaded as
        a runner of one rank on the engine's device (its KV cache sized with the target's)."""
        spec, cfg = self.config.speculative, self.config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec)
        return self._load_draft(spec.draft_model, progress)

    def _load_draft(self, path: str, progress) -> DraftProposer:
        """A draft model, checked against the target, loaded as a runner of one rank on the
        engine's device (its KV cache sized with the target's)."""
        cfg = self.config
        try:
            draft = read_draft(path, cfg.dtype)
            check_draft(draft, self.model_config, self.tokenizer, self.max_model_len)
        except SpeculativeConfigError as exc:
            raise EngineConfigError(str(exc)) from None
        device = torch.device(cfg.device)
        try:
            backend = resolve_attention_backend(cfg.attention_backend, device)
            quantization = draft_quantization(draft, self.model_config.quantization, device.type, backend)
        except (BackendUnavailableError, QuantizationChoiceError) as exc:
            raise EngineConfigError(f"speculative.draft_model: {exc}") from None
        config = replace(draft.config, quantization=quantization, kv_cache_dtype="auto")
        runner = ModelRunner(config, draft.source.path, cfg.block_size, self.max_model_len, cfg.device,
                             progress=progress, attention_backend=cfg.attention_backend,
                             enforce_eager=cfg.enforce_eager, max_num_seqs=cfg.max_num_seqs,
                             load_format=cfg.load_format)
        return DraftProposer(runner, max_rows_fitted=cfg.max_num_seqs, target_weight_bytes=self.runner.weight_bytes)

    def check_health(self) -> None:
        """Raises when a part of the engine outside this process (a tensor-parallel rank) has
        died; an idle caller learns it without waiting for the next step to fail."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Stops the engine's other processes (tensor-parallel ranks) and threads, if it has any."""
        if self._masks is not None:
            self._masks.close()
        for queue in (self.copy_queue, self.load_queue):
            if queue is not None:  # a copy under way ends first; none queued behind it is made
                queue.close()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len or limit
        if wanted > limit:
            raise EngineConfigError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

    @staticmethod
    def _load_tokenizer(source: ModelSource, verbose: bool) -> Tokenizer | None:
        try:
            return Tokenizer(source)
        except TokenizerError as exc:
            if verbose:
                _log(f"no text tokenizer ({exc}); requests must give token ids")
            return None

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        useful = cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        share = cfg.kv_share
        block_bytes = self.runner.block_bytes  # a draft model's KV has a block for each of the target's
        if self.draft is not None:
            block_bytes += self.draft.block_bytes
        budget = device_memory_bytes(self.runner.device) * cfg.kv_cache_memory_fraction * share
        by_memory = int(budget) // block_bytes
        if by_memory < 1:
            memory = device_memory_bytes(self.runner.device) / 2**20
            shared = f", shared by {round(1 / share)} ranks," if share < 1 else ""
            raise EngineConfigError(
                f"kv_cache_memory_fraction {cfg.kv_cache_memory_fraction:g} of {memory:.0f} MiB{shared} leaves no "
                f"room for a single KV block of {block_bytes / 2**20:.2f} MiB")
        return min(by_memory, useful)

    # -- requests -------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt) -> list[int]:
        return prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        transfer: TransferTarget | None = None,
        resumed_tokens: int = 0,
    ) -> Request:
        """Queues a request; raises InvalidRequestError (naming what to fix) if it can never run.
        With ``transfer``, the prompt's KV streams to a decode worker as it is computed.
        ``resumed_tokens``: the prompt's last tokens are output a failed placement already
        streamed (a constrained request's grammar starts past them)."""
        if transfer is not None and transfer.draft_first_block is not None and (self.draft is None or self.proposer):
            raise InvalidRequestError(f"{self.config.engine_name} loads no draft model to build the prompt's draft KV "
                                      "(prompt_draft_model): ask for the model's KV only")
        request = self._make_request(request_id, prompt, params, priority, arrival_time, cache_salt, resumed_tokens)
        request.transfer = transfer
        self.scheduler.add(request)
        self._track(request)
        return request

    def _track(self, request: Request) -> None:
        if self.tokenizer is not None:
            self.detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer, request.params.stop)

    def _make_request(self, request_id, prompt, params, priority=0, arrival_time=None, cache_salt=None,
                      resumed_tokens=0) -> Request:
        params = params or SamplingParams()
        check_request_id(request_id)
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        check_stop_token_ids(params.stop_token_ids, self.model_config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has no tokenizer.json")
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            generator=make_generator(params.seed) if params.seed is not None else None,
        )
        if params.structured is not None:
            if not 0 <= resumed_tokens < len(token_ids):
                raise InvalidRequestError(f"resumed_tokens must be in [0, {len(token_ids)}), got {resumed_tokens}")
            request.grammar = self._matcher(params.structured, token_ids[len(token_ids) - resumed_tokens:])
        return request

    def _matcher(self, spec: StructuredOutput, replayed: Sequence[int]) -> Matcher:
        """A matcher of ``spec``'s grammar past the ``replayed`` tokens; InvalidRequestError naming
        the spec's field when it does not compile. The backend (its tokenizer: 0.2 s for the
        default model's) and the mask thread are made for the first constrained request."""
        if self.grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError(f"{spec.source}: structured output needs the model's tokenizer, and this "
                                          "model has no tokenizer.json")
            self.grammars = GrammarBackend(self.tokenizer.to_json(), self.model_config.vocab_size, self.eos_token_ids)
            self._masks = StepMasks(self.model_config.vocab_size)
        matcher = self.grammars.matcher(spec)
        if not matcher.replay(replayed):
            raise InvalidRequestError(f"{spec.source}: the output so far does not match the {spec.kind}: "
                                      f"{matcher.error.splitlines()[0] if matcher.error else ''}")
        return matcher

    # -- decode side of disaggregation ----------------------------------------------------

    def reserve_transfer(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                         priority: int = 0, cache_salt: str | None = None,
                         resumed_tokens: int = 0) -> tuple[int, list[int]] | None:
        """Holds blocks for a prompt whose KV a prefill worker will send. Returns (blocks
        already cached here, block ids the KV must go to), or None when blocks are short.
        ``resumed_tokens`` as in :meth:`add_request`."""
        request = self._make_request(request_id, prompt, params, priority, None, cache_salt, resumed_tokens)
        first_block = self.scheduler.reserve_for_transfer(request)
        self._move_between_tiers()
        if first_block is None:
            return None
        self._track(request)
        request.times.first_scheduled = time.monotonic()
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.stats.cached_prompt_tokens += request.num_cached_tokens
        return first_block, request.block_ids[first_block:]

    @property
    def transfer_layers(self) -> int:
        """Layers of KV one request's transfer may carry: the model's, and its draft's after them
        (a decode worker spaces its transfers' tag ranges by this)."""
        draft = self.draft.runner.config.num_layers if self.draft is not None else 0
        return self.model_config.num_layers + draft

    def draft_destination(self, request_id: str) -> tuple[int, list[int]] | None:
        """For a reserved request, the first block whose draft KV a prefill worker would have to
        send (the leading ones hold it here already) and the block ids from there on, where it
        would land (``receive_transfer``'s ``draft_blocks``); None without a draft model."""
        if self.draft is None:
            return None
        request = self.scheduler.receiving[request_id]
        first = self.draft.filled_blocks(request)
        return first, request.block_ids[first:]

    def draft_catch_up_s_per_token(self) -> float | None:
        """What the speculative policy charges a prompt token this engine's draft catches up on
        (None: no draft, or no cost to judge by yet)."""
        return self.draft.catch_up_s_per_token(self._step_cost()) if self.draft is not None else None

    def draft_kv_port(self):
        """The KV port of the draft's cache, over the runner's pairs (made on first use)."""
        if self._draft_port is None:
            self._draft_port = self.runner.draft_port(self.draft.runner.kv_cache)
        return self._draft_port

    def receive_transfer(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int,
                         timeout_s: float, draft_blocks: list[int] | None = None) -> str | None:
        """Receives a reserved request's KV on every rank, then, with ``draft_blocks`` (the
        request's blocks from its :meth:`draft_destination`), the draft's KV of the prompt that the
        prefill worker built beside it; None, or the error."""
        error = self.runner.receive(pair, request_id, dst_blocks, tag_base, timeout_s)
        if error is None and draft_blocks is not None:
            error = self.draft_kv_port().receive(pair, request_id, draft_blocks, tag_base, timeout_s)
            error = f"draft model's KV: {error}" if error else None
        return error

    def admit_transfer(self, request_id: str, first_token: int, logprob: float | None = None,
                       top_logprobs: list[tuple[int, float]] | None = None,
                       draft_first_block: int | None = None) -> RequestOutput:
        """The KV has arrived and the prefill worker sampled ``first_token`` (with its logprobs,
        when asked for; under the request's grammar, which replays it here): the request joins
        the batch (or finishes, if that token ends it). ``draft_first_block``: the draft's KV of
        the prompt arrived too, from that block on (``receive_transfer``'s ``draft_blocks``)."""
        request = self.scheduler.receiving[request_id]
        if request.load_failure is not None:  # a block it holds from the host tier did not load
            self.scheduler.finish(request, FinishReason.ERROR, request.load_failure[1])
            return self._output(request, [])
        request = self.scheduler.admit_transferred(request_id, first_token)
        if draft_first_block is not None and not request.finished:
            self.draft.received(request, draft_first_block)
        if request.grammar is not None and self._grammar_ends(request, first_token):
            self.scheduler.finish(request, FinishReason.STOP)
        self._fail_refused([request])
        if logprob is not None and request.params.logprobs is not None:
            request.logprobs.append(logprob)
            request.top_logprobs.append([tuple(pair) for pair in top_logprobs or []])
        if request.generator is not None and not request.params.greedy:
            skip_one_draw(request.generator, self.model_config.vocab_size)
        detokenizer = self.detokenizers.get(request_id)
        if detokenizer is not None and detokenizer.append(first_token):
            self.scheduler.finish(request, FinishReason.STOP)
        request.times.first_token = time.monotonic()
        self.stats.generated_tokens += 1
        return self._output(request, [first_token])

    # -- a prefix pulled from a peer's cache (either side) ----------------------------------

    def reserve_pull(self, request_id: str, prompt: Sequence[int], params: SamplingParams, blocks: int,
                     priority: int = 0, cache_salt: str | None = None,
                     resumed_tokens: int = 0) -> tuple[int, list[int]] | None:
        """Holds the prompt's first ``blocks`` blocks for KV a peer will send from its cache.
        Returns (blocks already cached here, block ids the pulled KV must go to), or None when
        blocks are short; the request waits until :meth:`admit_pull`."""
        request = self._make_request(request_id, prompt, params, priority, None, cache_salt, resumed_tokens)
        first_block = self.scheduler.reserve_for_pull(request, blocks)
        self._move_between_tiers()
        if first_block is None:
            return None
        self._track(request)
        return first_block, request.block_ids[first_block:]

    def admit_pull(self, request_id: str, pulled_blocks: int) -> None:
        """The pull ended with ``pulled_blocks`` received (0: it failed): the request is
        prefilled here from there on, the blocks that did not arrive computed like the rest (where
        the load of a block it holds from the host tier failed, it ends at the next step with that
        error)."""
        request = self.scheduler.admit_pulled(request_id, pulled_blocks)
        if request.load_failure is not None:
            self._failed_loads.append(request)
        request.times.first_scheduled = time.monotonic()
        self.stats.prompt_tokens += request.num_prompt_tokens
        self.stats.cached_prompt_tokens += request.num_cached_tokens

    def pin_prefix(self, prompt: Sequence[int], first_block: int, blocks: int,
                   cache_salt: str | None = None) -> list[int]:
        """The sending side of a pull: the block ids of the prompt's blocks ``first_block`` to
        at most ``blocks`` that this engine caches (host-tier ones loaded back to the device),
        referenced until :meth:`unpin`."""
        keys = request_hash_keys(self.scheduler.extra_hash_keys, cache_salt)
        hashes = hash_token_blocks(list(prompt[:blocks * self.config.block_size]), self.config.block_size, keys)
        pinned = self.scheduler.pin_prefix(hashes[:blocks], first_block)
        self._move_between_tiers()
        self._wait_for_loads(pinned)
        sent = next((i for i, block in enumerate(pinned) if self.block_manager.block_hash_of(block) is None),
                    len(pinned))  # up to the first block whose load failed (uncached)
        self.block_manager.free(pinned[sent:])
        return pinned[:sent]

    def unpin(self, block_ids: Sequence[int]) -> None:
        self.block_manager.free(block_ids)

    def send_blocks(self, pair: str, request_id: str, block_ids: Sequence[int], tag_base: int,
                    timeout_s: float) -> str | None:
        """Sends the KV of ``block_ids`` (pinned) over ``pair`` from every rank; None, or the error."""
        return self.runner.send(pair, request_id, list(block_ids), tag_base, timeout_s)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        return self._output(request, []) if request is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def loads_in_flight(self) -> bool:
        """Host-tier loads queued, under way, or made and not yet taken in by a step (their blocks
        stay referenced until then: a loop with no request to step steps for these too)."""
        return bool(self._loads)

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules, runs and samples one step; returns an output for every request that got
        a token or finished."""
        started = time.perf_counter()
        accepted_before = self.stats.accepted_tokens
        draft_before = self.draft.forward_seconds if self.draft is not None else 0.0
        self._collect_loads()
        failed = self._end_failed_loads() if self._failed_loads else []
        out = self.scheduler.schedule()
        self._move_between_tiers()
        self.stats.num_preemptions += len(out.preempted)
        if out.is_empty:
            self._wait_for_any_load()
            return failed
        now = time.monotonic()
        for request, _ in out.prefills:
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
                self.stats.prompt_tokens += request.num_prompt_tokens
                self.stats.cached_prompt_tokens += request.num_cached_tokens
        draws = {id(r): r.generator.get_state() for r, _ in out.verifies if r.generator is not None and not r.params.greedy}
        with self._torch_threads():
            inputs = self.runner.prepare(out)
            masks = self._masks.start(inputs.sampling_requests) if self._masks is not None else None
            logits = self.runner.execute(inputs)  # the constrained rows' masks are built meanwhile
            masks = masks.result() if masks is not None else None
            sampled = self.runner.sample(logits, inputs.sampling_requests, masks) if inputs.sampling_requests else None
        self.transfer_errors.update(inputs.transfer_errors)
        prompt_drafts_before = self.draft.prompt_tokens if self.draft is not None else 0
        if self.draft is not None and self.proposer is None:
            inputs.transfer_tail_s += self._build_prompt_drafts(out)

        tokens: dict[str, list[int]] = {}
        stopped: set[str] = set()
        runs = row_runs(inputs.sampling_requests) if sampled is not None else []
        sampling = [request for request, _, _ in runs]  # each once, in row order
        for request, row, rows in runs:
            emitted = sampled.token_ids[row : row + rows]
            if rows > 1:  # a verify: its guesses checked against its rows' samples, cut at a stop
                emitted = accepted_prefix(emitted, request.spec_token_ids)
                emitted = emitted[: self.scheduler.tokens_before_stop(request, emitted)]
                self._count_guesses(request, rows - 1, len(emitted) - 1, draws.get(id(request)), len(emitted))
            detokenizer = self.detokenizers.get(request.request_id)
            for index, token in enumerate(emitted):
                if sampled.logprobs is not None and request.params.logprobs is not None:
                    request.logprobs.append(sampled.logprobs[row + index])
                    request.top_logprobs.append(sampled.top_logprobs[row + index] if sampled.top_logprobs else [])
                ends_text = detokenizer is not None and detokenizer.append(token)
                if (request.grammar is not None and self._grammar_ends(request, token)) or ends_text:
                    stopped.add(request.request_id)
                    emitted = emitted[: index + 1]
                    break
            tokens[request.request_id] = emitted
        self.scheduler.update(out, tokens, frozenset(stopped))
        self._fail_refused(sampling)
        if self.proposer is not None:
            self._propose(out)
        draft_seconds = self.draft.forward_seconds - draft_before if self.draft is not None else 0.0
        if self._masks is not None:  # the next step's, built while this one's outputs are handed out
            self._masks.build_ahead(self.scheduler.running)

        now = time.monotonic()
        outputs = failed
        for request in sampling:
            if request.times.first_token is None:
                request.times.first_token = now
            outputs.append(self._output(request, list(request.token_ids[-len(tokens[request.request_id]):])))
        self.stats.generated_tokens += sum(len(t) for t in tokens.values())
        self.stats.num_steps += 1
        self.stats.record(
            StepRecord(
                num_decode_tokens=len(out.decodes) + len(out.verifies),
                num_prefill_tokens=out.num_tokens - len(out.decodes) - sum(n for _, n in out.verifies),
                seconds=time.perf_counter() - started,
                context_tokens=sum(r.num_computed_tokens for r in out.decodes)
                + sum(r.num_computed_tokens for r, _ in out.verifies),
                prefill_attention=sum(n * r.num_computed_tokens for r, n in out.prefills),  # counts are past the step
                kv_blocks_sent=sum(len(s.src_blocks) for s in inputs.plan.streams),
                transfer_tail_s=inputs.transfer_tail_s,
                guess_tokens=sum(n - 1 for _, n in out.verifies),
                accepted_tokens=self.stats.accepted_tokens - accepted_before,
                draft_seconds=draft_seconds,
                draft_prompt_tokens=self.draft.prompt_tokens - prompt_drafts_before if self.draft is not None else 0,
                host_loaded_blocks=self._host_loads()[0] - self._host_loads_recorded[0],
                host_load_s=self._host_loads()[1] - self._host_loads_recorded[1],
            )
        )
        self._host_loads_recorded = self._host_loads()
        self._write_back()
        return outputs

    def _build_prompt_drafts(self, out: SchedulerOutput) -> float:
        """An engine that only prefills, with a draft model: the draft's KV of the step's prompt
        chunks whose transfer asks for it, built as the model's was; a prompt's last chunk sends
        those blocks after the model's (a failure of either is the transfer's). Returns the
        seconds the sends took (the step's transfer tail, as the model's sends after its forward)."""
        chunks = [(r, n) for r, n in out.prefills if r.transfer is not None and r.transfer.draft_first_block is not None]
        if not chunks and not out.preempted:
            return 0.0
        self.draft.build_prompts(out, chunks)
        started = time.perf_counter()
        bs = self.config.block_size
        for request, count in chunks:
            end, target = request.num_computed_tokens + count, request.transfer
            if end != request.num_prompt_tokens:
                continue
            stream = KVStream(target.pair, request.request_id, tuple(request.block_ids[target.draft_first_block:
                                                                                       -(-end // bs)]),
                              target.tag_base, target.timeout_s, streaming=False)
            port = self.draft_kv_port()
            error = port.finish(port.senders([stream]))[request.request_id]
            if error is not None and self.transfer_errors.get(request.request_id) is None:
                self.transfer_errors[request.request_id] = f"draft model's KV: {error}"
        return time.perf_counter() - started

    @staticmethod
    def _grammar_ends(request: Request, token: int) -> bool:
        """Advances the request's grammar past ``token``: True when that ended the grammar. A
        token the grammar refuses (which masking prevents) leaves it in error: see _fail_refused."""
        return request.grammar.accept(token) and request.grammar.ended

    def _fail_refused(self, requests: Sequence[Request]) -> None:
        """Ends with an error the requests whose grammar refused a token they were given."""
        for request in requests:
            if request.grammar is not None and request.grammar.error:
                error = request.grammar.error.splitlines()[0]
                self.scheduler.finish(request, FinishReason.ERROR, f"the grammar refused a token: {error}")

    # -- speculative decoding ---------------------------------------------------------------

    def _count_guesses(self, request: Request, proposed: int, accepted: int, draws, emitted: int) -> None:
        """Counts a verify's guesses; a seeded request's generator is put back to where one draw
        per emitted token leaves it, as without guesses (rows past the first miss drew too)."""
        request.num_proposed_tokens += proposed
        request.num_accepted_tokens += accepted
        request.acceptance = update_acceptance(request.acceptance, proposed, accepted)
        request.continuation = update_continuation(request.continuation, proposed, accepted)
        self.proposer.observe(request, proposed, accepted)
        self.stats.proposed_tokens += proposed
        self.stats.accepted_tokens += accepted
        self.stats.verify_steps += 1
        if draws is not None:
            request.generator.set_state(draws)
            for _ in range(emitted):
                skip_one_draw(request.generator, self.model_config.vocab_size)

    def _step_cost(self) -> StepCost | None:
        """The step cost fitted to the latest ``FITTED_STEPS`` steps (start-up profile included),
        fitted again every ``REFIT_STEPS`` steps: refitting every step over the whole history cost
        a 32-stream batch 7% of its time. Where the latest steps all had one width (a steady batch,
        or guesses stopped paying) the line goes through every step kept (``EngineStats.steps``);
        only where those too had one width is there no line, and the policy guesses one a request
        to measure again: for n-gram guesses a row each, which also corrects a fit a load spike
        spoiled (kept, a bad fit stopped an n-gram engine's guessing for good on a loaded run).
        Without the whole history a steady batch would measure so every ``FITTED_STEPS`` steps,
        each time with a step of twice its rows. A draft's measuring guess
        costs its catch-up (a self-draft paid it in 5% of its batch-1 steps, 0.67x), so with a
        draft the last fit stays, and until a first fit exists it is tried again after every step
        that checked guesses rather than every 16 steps."""
        steps = self.stats.steps
        drafting = isinstance(self.proposer, DraftProposer)
        first_spread = drafting and self._cost is None and steps and steps[-1].guess_tokens > 0
        if self._cost_fitted_at is None or first_spread or self.stats.num_steps - self._cost_fitted_at >= REFIT_STEPS:
            fitted = StepCost.fit(self._step_points(islice(reversed(steps), FITTED_STEPS)))
            if fitted is None and not drafting:
                fitted = StepCost.fit(self._step_points(steps))
            self._cost = fitted or (self._cost if drafting else None)
            self._cost_fitted_at = self.stats.num_steps
        return self._cost

    def _step_points(self, steps) -> list[tuple[int, float]]:
        """(rows, seconds of the target's forward) of the steps a decode step's cost is fitted to."""
        return [(s.num_decode_tokens + s.num_prefill_tokens + s.guess_tokens, s.seconds - s.draft_seconds)
                for s in steps if s.num_prefill_tokens <= self.config.max_num_seqs]

    def _propose(self, out) -> None:
        """Guesses for the next step of every decoding request that may speculate, as many as
        :func:`plan_guesses` finds worth their rows (and the proposer's own steps). The proposer
        is told of every step, guesses or none (a draft model catches its KV up when guessing resumes)."""
        spec, scheduler, proposer = self.speculative, self.scheduler, self.proposer
        decoding = []
        rows = 0
        for request in scheduler.running:
            remaining = request.num_tokens - request.num_computed_tokens
            rows += remaining
            if remaining == 1 and request.num_output_tokens and request.params.speculative:
                request.acceptance = update_acceptance(request.acceptance, 0, 0)  # drifts back while not guessing
                decoding.append(request)
        cost = self._step_cost() if spec.adaptive else None
        if cost is not None and decoding and not (
                worth_a_row(max(r.acceptance for r in decoding), rows, cost)
                and self.guess_gate.open(len(decoding), rows, proposer.best_first_odds(decoding),
                                         max(r.continuation for r in decoding), spec.num_tokens, cost)):
            decoding = []  # no request's own odds pay for a row, or no guess could pay: no lookups either
        candidates, rooms = [], []
        for request in decoding:
            room = min(spec.num_tokens, request.params.max_tokens - request.num_output_tokens - 1,
                       self.max_model_len - request.num_tokens - 1)
            if room > 0:
                candidates.append(request)
                rooms.append(room)
        available = proposer.available(candidates, rooms) if candidates else []
        if spec.adaptive and any(available):
            behind = [catch_up_share(n, min(r.params.max_tokens - r.num_output_tokens, self.max_model_len - r.num_tokens))
                      for r, n in zip(candidates, proposer.catch_up(candidates))]
            counts = plan_guesses(proposer.first_odds(candidates), [r.continuation for r in candidates], available, rows,
                                  cost, proposer.round_cost(cost), behind)
        else:
            counts = available
        if proposer.writes_kv:  # the guesses' KV goes into their look-ahead slots: held now, from free blocks only
            spare = len(scheduler.running)  # a block each for the next step's plain decodes
            counts = [min(n, max(0, scheduler.reserve_lookahead(r, r.num_tokens + n, spare) - r.num_tokens)) if n else 0
                      for r, n in zip(candidates, counts)]
        guesses = proposer.propose(out, candidates, counts)
        for request, proposal in zip(candidates, guesses):
            if proposal and request.grammar is not None:  # guesses the grammar refuses could never be kept
                proposal = proposal[: request.grammar.valid_prefix(proposal)]
            request.spec_token_ids = proposal

    def _output(self, request: Request, new_token_ids: list[int]) -> RequestOutput:
        finished = request.finished
        if finished and request.times.finished is None:
            request.times.finished = time.monotonic()
        detok = self.detokenizers.get(request.request_id)
        text, delta = (detok.text, detok.take_delta(finished)) if detok is not None else ("", "")
        if finished:
            self.detokenizers.pop(request.request_id, None)
        wants_logprobs = request.params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids,
            new_token_ids=new_token_ids,
            text=text,
            delta_text=delta,
            finished=finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            error=request.error,
            usage=Usage(request.num_prompt_tokens, request.num_cached_tokens, request.num_output_tokens,
                        request.num_proposed_tokens, request.num_accepted_tokens),
            logprobs=list(request.logprobs) if wants_logprobs else None,
            top_logprobs=list(request.top_logprobs) if wants_logprobs else None,
            arrival_time=request.times.arrival,
            first_token_time=request.times.first_token,
            finish_time=request.times.finished,
            scheduled_time=request.times.first_scheduled,
        )
