"""Picks each row's next token from a batch of logits, vectorised over the batch.

Order (DESIGN.md, "Sampling order"): repetition penalty, then frequency and presence penalties,
then a constrained row's grammar mask (tokens its grammar refuses go to -inf), then greedy rows
take the argmax; random rows are divided by their temperature, truncated by
top-k, top-p and min-p, and drawn. Returned log-probabilities are those of the raw logits,
before any of this, the grammar's mask included (vLLM v1's default).

The draw uses the exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token picks
token ``i`` with probability ``probs[i]``, and needs no cumulative sum or search. A request with
a seed owns a CPU generator from which exactly one row of ``V`` draws is taken per step, so its
tokens do not depend on which other requests share the batch or where its row sits.

On a GPU everything after the batch's parameters are uploaded (without blocking: pinned memory)
runs there for the whole batch at once; the host waits once, for the sampled ids.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured.bitmask import apply_token_masks


def skip_one_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Consumes one step's draws, as when another process (a prefill worker) sampled the
    request's token from a generator with the same seed: the next draw then matches."""
    torch.empty(vocab_size).exponential_(generator=generator)


def _host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``; on CUDA copied from pinned memory without blocking,
    so building a batch never waits for the forward pass still running on the GPU."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return _host_to_device(torch.tensor(values, dtype=dtype), device)


def first_argmax(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first largest value (a NaN counts as largest), as ``argmax(dim=-1)``.
    On the CPU through numpy's vectorised argmax: torch's took 27 us a row of the default model's
    49,152 logits on one thread, numpy's 3 (a verify of 8 guesses at batch 1 samples 9 rows)."""
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.dim() == 2:
        return torch.from_numpy(values.contiguous().numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def make_generator(seed: int) -> torch.Generator:
    """CPU generator seeded for one request; the engine keeps it on the request and passes it every step."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingBatch:
    """The per-row sampling parameters of one step, as tensors. Build it with :meth:`build`."""

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float32; None when every row has 1.0
    min_p: torch.Tensor | None  # [B] float32; None when every row has 0.0
    repetition_penalty: torch.Tensor | None  # [B] float32; None when every row has 1.0
    presence_penalty: torch.Tensor | None  # [B] float32; None when every row has 0.0
    frequency_penalty: torch.Tensor | None  # [B] float32; None when every row has 0.0
    prompt_mask: torch.Tensor | None  # [B, V] bool: token is in the prompt or the output
    output_counts: torch.Tensor | None  # [B, V] int32: occurrences of each token in the output
    generators: list[torch.Generator | None]  # per row; None = the global RNG
    random_rows: list[bool]  # per row: temperature > 0 (kept on the host, to avoid reading the device)
    all_greedy: bool
    all_random: bool
    max_num_logprobs: int | None  # max of params.logprobs over rows; None when no row asks
    num_logprobs: list[int | None] | None = None  # per row params.logprobs; None = max_num_logprobs for all
    token_bitmask: torch.Tensor | None = None  # [C, words] int32: the allowed tokens of constrained rows ...
    masked_rows: torch.Tensor | None = None  # ... [C] int64, the rows they are; None: every row

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str = "cpu",
        token_bitmask: torch.Tensor | None = None,
        masked_rows: torch.Tensor | None = None,
    ) -> "SamplingBatch":
        """Penalty tensors are only built when some row has penalties, each with one scatter over a
        padded token tensor (no Python loop per token). ``token_bitmask`` (on the host) holds the
        grammar masks of the ``masked_rows`` (None: every row; ``structured/bitmask.py``)."""
        if not (len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators)):
            raise ValueError(
                f"params, prompt_token_ids, output_token_ids and generators must have one entry per row, got "
                f"{len(params)}, {len(prompt_token_ids)}, {len(output_token_ids)} and {len(generators)}"
            )

        def column(name: str, dtype: torch.dtype, off: float) -> torch.Tensor | None:
            values = [getattr(p, name) for p in params]
            if all(v == off for v in values):
                return None
            return _to_device(values, dtype, device)

        repetition = column("repetition_penalty", torch.float32, 1.0)
        presence = column("presence_penalty", torch.float32, 0.0)
        frequency = column("frequency_penalty", torch.float32, 0.0)
        output_counts = prompt_mask = None
        if repetition is not None or presence is not None or frequency is not None:
            output_counts = _token_counts(output_token_ids, vocab_size, device)
        if repetition is not None:
            in_prompt = torch.zeros(len(params), vocab_size + 1, dtype=torch.bool, device=device)
            in_prompt.scatter_(1, _padded(prompt_token_ids, vocab_size, device), True)
            prompt_mask = in_prompt[:, :vocab_size] | (output_counts > 0)

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=_to_device([p.temperature for p in params], torch.float32, device),
            top_k=column("top_k", torch.int64, 0),
            top_p=column("top_p", torch.float32, 1.0),
            min_p=column("min_p", torch.float32, 0.0),
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            generators=list(generators),
            random_rows=[not p.greedy for p in params],
            all_greedy=all(p.greedy for p in params),
            all_random=not any(p.greedy for p in params),
            max_num_logprobs=max(asked) if asked else None,
            num_logprobs=[p.logprobs for p in params] if asked else None,
            token_bitmask=_host_to_device(token_bitmask, device) if token_bitmask is not None else None,
            masked_rows=_host_to_device(masked_rows, device) if masked_rows is not None else None,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]  # [B] sampled ids
    logprobs: list[float] | None  # raw logprob of the sampled token per row; None when no row asked
    # Per row, that row's top-n (id, logprob), best first; [] for rows that asked for none.
    top_logprobs: list[list[tuple[int, float]]] | None


def _padded(seqs: Sequence[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """[B, L] int64 of the sequences, right-padded with ``pad``."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    width = int(lengths.max()) if len(seqs) else 0
    out = torch.full((len(seqs), width), pad, dtype=torch.int64)
    out[torch.arange(width) < lengths[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(seqs)), dtype=torch.int64
    )
    return _host_to_device(out, device)


def _token_counts(seqs: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[B, V] int32 occurrence counts; padding lands in an extra column that is then dropped."""
    index = _padded(seqs, vocab_size, device)
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Returns penalised float32 logits (the input is left untouched).

    Repetition (HF/vLLM rule) on tokens of the prompt or output: a positive logit is divided by
    the penalty, a non-positive one multiplied, so a penalty > 1 always makes the token less
    likely. Then, on output tokens only: ``logit -= frequency * count + presence * (count > 0)``.
    """
    logits = logits.float()
    if batch.repetition_penalty is not None:
        penalty = batch.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(batch.prompt_mask, penalised, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * batch.output_counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (batch.output_counts > 0)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks to -inf what top-k and then top-p drop, with one sort for both.

    The sort is descending and stable, so top-k keeps exactly k tokens and, among ties, the
    lowest ids: ``top_k=1`` picks the same token as ``argmax``. Top-p keeps a token when the
    probability of the tokens ranked above it (renormalised after top-k) is below ``top_p``:
    the smallest set reaching ``top_p``, never empty.
    """
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab)
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        # Rows with top_p == 1 keep everything even if rounding pushes the running sum past 1.
        drop = (mass_above >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _exponential_noise(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """q ~ Exp(1) of probs' shape: one batched draw from the global RNG for rows without a
    generator, and one row of V draws from its own generator for each seeded random row."""
    rows, vocab = probs.shape
    random_row = batch.random_rows
    seeded = [i for i, g in enumerate(batch.generators) if g is not None and random_row[i]]
    q = torch.empty_like(probs)
    if len(seeded) < sum(random_row):
        q.exponential_()
    if seeded:
        draws = torch.stack([torch.empty(vocab).exponential_(generator=batch.generators[i]) for i in seeded])
        q[_to_device(seeded, torch.int64, probs.device)] = _host_to_device(draws, probs.device).to(probs.dtype)
    # An exact 0 would turn a masked token's 0/0 into NaN, which argmax would pick.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = logits.float().log_softmax(dim=-1)

        logits = apply_penalties(logits, batch)
        if batch.token_bitmask is not None:
            logits = apply_token_masks(logits, batch.token_bitmask, batch.masked_rows)
        if batch.all_greedy:
            token_ids = first_argmax(logits)
        else:
            greedy = batch.temperature == 0.0
            # Greedy rows of a mixed batch go through with temperature 1 and are replaced below.
            scaled = logits / torch.where(greedy, 1.0, batch.temperature)[:, None]
            scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
            probs = scaled.softmax(dim=-1)
            if batch.min_p is not None:
                floor = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
                probs = probs.masked_fill(probs < floor, 0.0)
            token_ids = first_argmax(probs / _exponential_noise(probs, batch))
            if not batch.all_random:
                token_ids = torch.where(greedy, first_argmax(logits), token_ids)

        if raw_logprobs is None:
            return SamplerOutput(token_ids=token_ids.tolist(), logprobs=None, top_logprobs=None)
        sampled = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1).tolist()
        top_values, top_ids = raw_logprobs.topk(batch.max_num_logprobs, dim=-1)
        wanted = batch.num_logprobs or [batch.max_num_logprobs] * len(sampled)
        top = [
            list(zip(ids[: n or 0], values[: n or 0]))
            for ids, values, n in zip(top_ids.tolist(), top_values.tolist(), wanted)
        ]
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=sampled, top_logprobs=top)
