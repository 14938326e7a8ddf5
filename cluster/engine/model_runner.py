"""Turns a scheduled step into tensors, runs the model over them, and samples.

Owns the model and the paged KV cache: one tensor [layers, 2, blocks, block_size, kv_heads,
head_dim], each layer's attention holding views of its K and V parts.

Two attention backends (``kernels.triton_support``): the plain-torch path, and the fused Triton
kernels (the default on CUDA), whose step tensors cross to the device in one non-blocking copy
(``fused_inputs``) and whose decode-only steps replay as CUDA graphs (``cuda_graphs``) unless
``enforce_eager`` is set. On that path nothing here waits for the GPU before the sampled token
ids are read back, so the host builds the sampling batch while the forward pass runs; the next
step is scheduled once those ids are back (its decodes need them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from cluster.engine.cuda_graphs import DecodeGraphs, capture_sizes
from cluster.engine.fused_inputs import build_fused_step
from cluster.engine.host_memory import host_memory_bytes
from cluster.engine.kernels.triton_support import (
    choose_decode_splits,
    decode_split_choices,
    device_sm_count,
    interpreting,
    resolve_attention_backend,
)
from cluster.engine.kv_port import KVPort, KVPortFactory, KVStream, LayerSender, NoKVPort
from cluster.engine.memory import HugePagedZeros
from cluster.engine.models.attention import AttentionMetadata, PrefillSpan, visible_keys
from cluster.engine.models.config import ModelConfig
from cluster.engine.models.layers import SINGLE_RANK, ParallelGroup
from cluster.engine.models.loader import build_model, parameter_bytes
from cluster.engine.models.native_step import native_decode_step
from cluster.engine.quantization.kv_format import KVCacheFormat
from cluster.engine.request import Request
from cluster.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from cluster.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from cluster.engine.structured.masks import TokenMasks


@dataclass(frozen=True)
class PrefillPlan:
    query_start: int
    query_len: int
    context_len: int
    block_ids: tuple[int, ...]  # the blocks of the whole context (cached tokens and this chunk)


@dataclass(frozen=True)
class StepPlan:
    """A step in plain integers: what the driving rank of a tensor-parallel group sends the
    others over the control channel. Every rank turns it into the same tensors."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_lens: list[int]
    decode_block_table: list[list[int]]
    prefills: list[PrefillPlan]
    sample_rows: list[int]
    streams: tuple[KVStream, ...] = ()  # KV to send layer by layer during this step
    block_copies: tuple[tuple[int, int], ...] = ()  # (source, destination): KV copied before the forward


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    sampling_requests: list[Request]
    plan: StepPlan
    senders: list[LayerSender] = field(default_factory=list)
    decode_graph: bool = False  # a decode-only step that runs through ModelRunner.graphs
    transfer_errors: dict[str, str | None] = field(default_factory=dict)  # request id -> None or the error
    transfer_tail_s: float = 0.0  # time spent after the forward pass waiting for this step's sends


def device_memory_bytes(device: torch.device) -> int:
    """What a KV budget is a fraction of: a GPU's free memory, or the node's RAM (its cgroup's
    limit where that is lower, as in a container)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_memory_bytes()


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path,
        block_size: int,
        max_model_len: int,
        device: str = "cpu",
        group: ParallelGroup = SINGLE_RANK,
        progress: Callable[[int, int, str], None] | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        max_num_seqs: int = 128,
        load_format: str = "safetensors",
        kv_port: KVPortFactory | None = None,
    ):
        """``enforce_eager`` keeps decode steps out of CUDA graphs (graphs need the Triton
        backend and a single rank); ``max_num_seqs`` sizes the largest graph; ``kv_port`` makes
        this rank's KV moves (``cluster/engine/kv_port.py``), None for an engine that moves none."""
        self.config = config
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.attention_backend = resolve_attention_backend(attention_backend, self.device)
        self.model = build_model(config, model_dir, max_model_len, group, self.device, progress, load_format)
        if self.attention_backend == "triton":
            self.model.use_triton_matmuls()
        self.weight_bytes = parameter_bytes(self.model)
        self.sampler = Sampler()
        self.sliding_window = config.sliding_window
        self.kv_cache = torch.empty(0)
        self._kv_memory: HugePagedZeros | None = None
        self.num_blocks = 0
        self.after_layer: Callable[[int], None] | None = None  # see AttentionMetadata.after_layer
        self.tp_rank = group.rank
        self.kv_port = kv_port
        self._transfers: KVPort | None = None
        self.use_decode_graphs = self.attention_backend == "triton" and not enforce_eager and group.size == 1
        self.max_num_seqs = max_num_seqs
        self.graphs: DecodeGraphs | None = None
        self.native_step = None  # the fused CPU decode step (models/native_step.py), once the KV cache exists
        self._sm_count = device_sm_count(self.device)
        self._kv_heads = self.model.attention_layers()[0].num_kv_heads  # this rank's

    @property
    def transfers(self) -> KVPort:
        """This rank's KV-transfer pairs (created on first use, after the KV cache)."""
        if self._transfers is None:
            if self.kv_port is None:
                raise NoKVPort("this engine was built without a KV port: it cannot send or receive KV")
            self._transfers = self.kv_port(self.kv_cache, self.tp_rank, str(self.device))
        return self._transfers

    # -- KV cache -------------------------------------------------------------------------

    @property
    def kv_format(self) -> KVCacheFormat:
        return KVCacheFormat(self.config.kv_cache_dtype, self.config.dtype)

    @property
    def block_bytes(self) -> int:
        attn = self.model.attention_layers()[0]
        return 2 * self.config.num_layers * self.block_size * attn.num_kv_heads * self.kv_format.row_bytes(attn.head_dim)

    def blocks_for_memory_fraction(self, fraction: float) -> int:
        return int(device_memory_bytes(self.device) * fraction) // self.block_bytes

    def allocate_kv_cache(self, num_blocks: int, fault_in_background: bool = False) -> None:
        """``fault_in_background``: a CPU cache's pages are faulted in by a thread while the
        engine already runs (:class:`~cluster.engine.memory.HugePagedZeros`)."""
        attention = self.model.attention_layers()
        first, fmt = attention[0], self.kv_format
        shape = (len(attention), 2, num_blocks, self.block_size, first.num_kv_heads, fmt.row_width(first.head_dim))
        if self.device.type == "cpu":
            self._kv_memory = HugePagedZeros(shape, fmt.storage_dtype, background=fault_in_background)
            self.kv_cache = self._kv_memory.tensor
        else:
            self.kv_cache = torch.zeros(shape, dtype=fmt.storage_dtype, device=self.device)
        for index, attn in enumerate(attention):
            attn.k_cache = self.kv_cache[index, 0]
            attn.v_cache = self.kv_cache[index, 1]
            attn.kv_format = fmt if fmt.quantized else None
        self.num_blocks = num_blocks
        if self.attention_backend == "torch":
            self.native_step = native_decode_step(self.model, self.block_size)
        if self.attention_backend == "triton" and self.device.type == "cuda" and not interpreting():
            self.warm_up_kernels()
        if self.use_decode_graphs:
            blocks_per_seq = -(-self.max_model_len // self.block_size)
            self.graphs = DecodeGraphs(self.model, capture_sizes(self.max_num_seqs), blocks_per_seq, self._kv_heads,
                                       self.device)
            self.graphs.capture()

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compiles every Triton kernel variant a step can launch before the first request does:
        one step of a decode and a one-token prompt chunk per decode split count, through the
        whole model. They write no KV (slot -1) and read only block 0; the outputs are dropped.
        Without this, a step that first meets a split count (a batch size, a context length)
        stalls for the compilation, in the middle of serving. With packed weights, a prompt chunk
        longer than a decode tile also runs once: the quantized matmul's prompt tiles."""
        for splits in decode_split_choices():
            step = build_fused_step([0, 0], [0, 0], [-1, -1], [0, 1], [1], [[0]], [(1, 1, 1, [0])], splits,
                                    self.device)
            meta = AttentionMetadata(slot_mapping=step.slot_mapping, num_decodes=1, fused=step.fused)
            self.model.compute_logits(self.model(step.input_ids, step.positions, meta))
        if self.model.packed_bytes():
            from cluster.engine.kernels.triton_quantized_matmul import DECODE_ROWS

            rows = min(DECODE_ROWS + 1, self.max_model_len)
            blocks = [0] * -(-rows // self.block_size)
            step = build_fused_step([0] * rows, range(rows), [-1] * rows, [rows - 1], [], [], [(0, rows, rows, blocks)],
                                    1, self.device)
            meta = AttentionMetadata(slot_mapping=step.slot_mapping, num_decodes=0, fused=step.fused)
            self.model.compute_logits(self.model(step.input_ids, step.positions, meta))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one step -------------------------------------------------------------------------

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        plan, sampling = self.plan(out)
        return self.build_inputs(plan, sampling)

    def plan(self, out: SchedulerOutput) -> tuple[StepPlan, list[Request]]:
        """The step's token ids, positions, cache slots and attention layout, and the requests
        that sample a token (in the order of ``sample_rows``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []

        decode_lens: list[int] = []
        decode_table: list[list[int]] = []
        for request in out.decodes:
            pos = request.num_computed_tokens
            input_ids.append(request.token_ids[pos])
            positions.append(pos)
            slots.append(request.block_ids[pos // bs] * bs + pos % bs)
            decode_lens.append(pos + 1)
            decode_table.append(request.block_ids[: -(-(pos + 1) // bs)])
            sample_rows.append(len(input_ids) - 1)
            sampling.append(request)
        # The fused CPU step runs every row alike (its context length and block table): a verify's
        # rows go in as decode rows there, each attending up to itself (every row's KV is written
        # before any attends), which spares a decode-only step of verifies the prompt chunks'
        # layout (a mask, per-row tables: a batch-1 verify's prepare took 165 us, 101 this way, 2 cores).
        verifies_as_decodes = self.native_step is not None
        for request, count in out.verifies if verifies_as_decodes else ():
            start, blocks = request.num_computed_tokens, request.block_ids
            input_ids.extend([request.token_ids[start], *request.spec_token_ids[: count - 1]])
            for pos in range(start, start + count):
                positions.append(pos)
                slots.append(blocks[pos // bs] * bs + pos % bs)
                decode_lens.append(pos + 1)
                decode_table.append(blocks[: -(-(pos + 1) // bs)])
            sample_rows.extend(range(len(input_ids) - count, len(input_ids)))
            sampling.extend([request] * count)
        widest = max((len(row) for row in decode_table), default=0)
        decode_table = [row + [0] * (widest - len(row)) for row in decode_table]

        prefills: list[PrefillPlan] = []
        streams: list[KVStream] = []
        for request, count in out.prefills:
            start = request.num_computed_tokens
            end = start + count
            blocks = request.block_ids
            prefills.append(PrefillPlan(
                query_start=len(input_ids), query_len=count, context_len=end, block_ids=tuple(blocks[: -(-end // bs)]),
            ))
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if end == request.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(request)
            if request.transfer is not None and end == request.num_prompt_tokens:
                target = request.transfer
                blocks = tuple(blocks[target.first_block : -(-end // bs)])
                streams.append(KVStream(target.pair, request.request_id, blocks, target.tag_base, target.timeout_s,
                                        target.streaming))
        for request, count in () if verifies_as_decodes else out.verifies:
            # The last token and the guesses, each a row attending up to itself; every row samples.
            start, end = request.num_computed_tokens, request.num_computed_tokens + count
            blocks = request.block_ids
            prefills.append(PrefillPlan(
                query_start=len(input_ids), query_len=count, context_len=end, block_ids=tuple(blocks[: -(-end // bs)]),
            ))
            input_ids.extend([request.token_ids[start], *request.spec_token_ids[: count - 1]])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            sample_rows.extend(range(len(input_ids) - count, len(input_ids)))
            sampling.extend([request] * count)
        plan = StepPlan(input_ids, positions, slots, decode_lens, decode_table, prefills, sample_rows, tuple(streams),
                        tuple(out.block_copies))
        return plan, sampling

    def build_inputs(self, plan: StepPlan, sampling: list[Request] | None = None) -> StepInputs:
        senders = self.transfers.senders(list(plan.streams)) if plan.streams else []
        after_layer = self._layer_hook(senders)
        if self.attention_backend == "triton":
            if self._graph_fits(plan, after_layer):
                return self._graph_inputs(plan, sampling)
            return self._fused_inputs(plan, sampling, senders, after_layer)
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(plan.slots, dtype=torch.long, device=device),
            num_decodes=len(plan.decode_lens),
            after_layer=after_layer,
        )
        if plan.decode_lens:
            meta.decode_context_lens = plan.decode_lens
            meta.decode_lens = torch.tensor(plan.decode_lens, dtype=torch.long)
            meta.decode_block_table = torch.tensor(plan.decode_block_table, dtype=torch.long, device=device)
        for prefill in plan.prefills:
            span = PrefillSpan(prefill.query_start, prefill.query_len, prefill.context_len)
            start = prefill.context_len - prefill.query_len
            if start > 0:
                span.block_ids = torch.tensor(prefill.block_ids, dtype=torch.long, device=device)
            if start > 0 or (self.sliding_window is not None and prefill.context_len > self.sliding_window):
                query_positions = torch.arange(start, prefill.context_len)
                span.mask = visible_keys(query_positions, prefill.context_len, self.sliding_window).to(device)
            meta.prefills.append(span)
        return StepInputs(
            input_ids=torch.tensor(plan.input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(plan.positions, dtype=torch.long, device=device),
            meta=meta,
            sample_rows=torch.tensor(plan.sample_rows, dtype=torch.long, device=device),
            sampling_requests=sampling or [],
            plan=plan,
            senders=senders,
        )

    def _graph_fits(self, plan: StepPlan, after_layer) -> bool:
        return (
            self.graphs is not None and not plan.prefills and after_layer is None
            and 0 < len(plan.decode_lens) <= self.graphs.sizes[-1]
        )

    def _graph_inputs(self, plan: StepPlan, sampling: list[Request] | None) -> StepInputs:
        """A decode-only step: its values go into the graphs' persistent buffers in ``execute``;
        the tensors here are only what the rest of the step reads (every row samples)."""
        rows = len(plan.decode_lens)
        buffers = self.graphs.buffers
        return StepInputs(
            input_ids=buffers.input_ids[:rows],
            positions=buffers.positions[:rows],
            meta=self.graphs.metas[self.graphs.bucket_for(rows)],
            sample_rows=torch.arange(rows, device=self.device),
            sampling_requests=sampling or [],
            plan=plan,
            decode_graph=True,
        )

    def _fused_inputs(self, plan: StepPlan, sampling: list[Request] | None, senders: list[LayerSender],
                      after_layer) -> StepInputs:
        longest = max(plan.decode_lens, default=0)
        step = build_fused_step(
            plan.input_ids, plan.positions, plan.slots, plan.sample_rows, plan.decode_lens, plan.decode_block_table,
            [(p.query_start, p.query_len, p.context_len, p.block_ids) for p in plan.prefills],
            choose_decode_splits(len(plan.decode_lens), self._kv_heads, self._sm_count, longest),
            self.device,
        )
        meta = AttentionMetadata(slot_mapping=step.slot_mapping, num_decodes=len(plan.decode_lens),
                                 after_layer=after_layer, fused=step.fused)
        return StepInputs(step.input_ids, step.positions, meta, step.sample_rows, sampling or [], plan, senders)

    def join_transfer(self, layout, spec, prefill_side: bool) -> None:
        self.transfers.join(layout, spec, prefill_side)

    def leave_transfer(self, pair: str) -> None:
        if self._transfers is not None:
            self._transfers.leave(pair)

    def draft_port(self, kv_cache: torch.Tensor) -> KVPort:
        """The KV port of a draft model's cache (``kv_cache``) beside this rank, over its pairs."""
        return self.transfers.draft_port(kv_cache)

    def receive(self, pair: str, request_id: str, dst_blocks: list[int], tag_base: int, timeout_s: float) -> str | None:
        """Receives a request's KV into ``dst_blocks``; returns None, or the error."""
        return self.transfers.receive(pair, request_id, dst_blocks, tag_base, timeout_s)

    def send(self, pair: str, request_id: str, block_ids: list[int], tag_base: int, timeout_s: float) -> str | None:
        """Sends every layer of ``block_ids`` over ``pair`` at once (outside a step: a pull of
        cached KV) and waits for the sends; returns None, or the error."""
        stream = KVStream(pair, request_id, tuple(block_ids), tag_base, timeout_s, streaming=False)
        return self.transfers.finish(self.transfers.senders([stream]))[request_id]

    def _layer_hook(self, senders: list[LayerSender]) -> Callable[[int], None] | None:
        hooks = [s.after_layer for s in senders if s.streaming] + ([self.after_layer] if self.after_layer else [])
        if not hooks:
            return None
        if len(hooks) == 1:
            return hooks[0]

        def run_all(layer: int) -> None:
            for hook in hooks:
                hook(layer)

        return run_all

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Runs the model; returns logits for the rows that sample a token."""
        if inputs.plan.block_copies:
            self.copy_blocks(inputs.plan.block_copies)
        if inputs.decode_graph:
            plan = inputs.plan
            hidden = self.graphs.run(plan.input_ids, plan.positions, plan.slots, plan.decode_lens,
                                     plan.decode_block_table)
            return self.model.compute_logits(hidden)
        rows = self._native_rows(inputs) if self.native_step is not None else None
        if rows is not None:
            hidden = self._execute_native(inputs, *rows)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
        if inputs.senders:
            started = time.perf_counter()
            inputs.transfer_errors = self.transfers.finish(inputs.senders)
            inputs.transfer_tail_s = time.perf_counter() - started
        return logits

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies whole blocks' KV (every layer, keys and values, an 8-bit cache's scales with
        them) from each source block to its destination: a partial prefix hit."""
        sources = torch.tensor([source for source, _ in copies], device=self.kv_cache.device)
        destinations = torch.tensor([destination for _, destination in copies], device=self.kv_cache.device)
        self.kv_cache.index_copy_(2, destinations, self.kv_cache.index_select(2, sources))

    def _native_rows(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each row's context length and block table for the fused CPU step (None for an empty
        step). A prompt token is a row attending to the cache up to its own position: every row's
        keys and values are written before any row attends. Steps of every width run there: its
        matmuls beat widened weights and torch's from 1 row to 2,048 (``quantized_matmul.py``), and
        a 512-token prompt of the default model took 599 ms against 883 through the torch path."""
        plan, meta = inputs.plan, inputs.meta
        if not plan.input_ids:
            return None
        if not plan.prefills:  # a decode-only step: build_inputs made both already
            return meta.decode_lens, meta.decode_block_table
        tables = list(plan.decode_block_table)
        for prefill in plan.prefills:
            tables.extend([list(prefill.block_ids)] * prefill.query_len)
        widest = max(len(table) for table in tables)
        table = torch.tensor([table + [0] * (widest - len(table)) for table in tables], dtype=torch.long)
        lengths = torch.tensor([position + 1 for position in plan.positions], dtype=torch.long)
        return lengths, table

    def _execute_native(self, inputs: StepInputs, lengths: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The step through the fused CPU step; layer hooks (KV streaming) run once it has written
        every layer."""
        hidden = self.model.model.embed_tokens(inputs.input_ids).contiguous()
        hidden = self.native_step(hidden, inputs.positions, inputs.meta.slot_mapping, table, lengths)
        if inputs.meta.after_layer is not None:
            for layer in range(self.config.num_layers):
                inputs.meta.after_layer(layer)
        return hidden

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request], masks: TokenMasks | None = None) -> SamplerOutput:
        """One token per row; a request with several rows in a row (a verify) has its guesses
        before each row counted in that row's output, for penalties. ``masks``: the grammar
        masks of the constrained rows."""
        penalised = [r.params.has_penalties for r in requests]
        outputs = []
        guess = 0  # the row's place among its request's rows: the guesses before it
        for row, (request, penalties) in enumerate(zip(requests, penalised)):
            guess = guess + 1 if row and requests[row - 1] is request else 0
            outputs.append(request.output_token_ids + request.spec_token_ids[:guess] if penalties else ())
        batch = SamplingBatch.build(
            [r.params for r in requests],
            [r.prompt_token_ids if p else () for r, p in zip(requests, penalised)],
            outputs,
            [r.generator for r in requests],
            self.config.vocab_size,
            device=self.device,
            token_bitmask=masks.bitmask if masks is not None else None,
            masked_rows=masks.rows if masks is not None and len(masks.rows) < masks.num_rows else None,
        )
        return self.sampler(logits, batch)
