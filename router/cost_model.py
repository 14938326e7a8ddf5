"""Predicted step times of one worker, fitted to the steps it measured and reported.

Two linear models, each fitted by non-negative least squares to the worker's recent steps
(a start-up profile seeds them, so they exist before the first request), without the steps
that something outside the model slowed (``fit_robust``):

    prefill step  = a + b * tokens + c * attention     (attention: sum of chunk x context)
    decode step   = a + b * rows + c * context tokens    (rows: one per sequence plus its guesses)

and the transfer tail per KV block sent: the time a prefill step waits, after its last layer,
for its sends to complete, per block sent (zero until the worker has sent something); and the
time to load one block from the worker's host KV tier, as its loads measured it: each load's
wait from queued to copied (in the background, while other requests' steps run; the request
waits that long before its prefill), over the blocks loaded (``DEFAULT_HOST_LOAD_S_PER_BLOCK``
until it has loaded one).

A prompt's prefix may sit in three places on a worker (``TierHits``): blocks in its device cache
cost nothing, blocks in its host tier cost their load, the rest are computed
(``tiered_prefill_seconds``). ``host_block_worth`` says what a host block saves of its recompute.

A worker that decodes speculatively makes more than one token a sequence per step: TPOT is the
step's time over the tokens a sequence gets from it, both as its recent decode steps measured
(guess rows and kept guesses per sequence). The rates follow the worker's recent batches: where
its batch grows past the size at which guesses pay, it stops guessing and they fall to 0 over
the steps it reports.

A prefill worker that also builds a draft model's KV of prompts (for decode workers drafting
with it) reports its draft's seconds apart in each step: the prefill line is fitted without them,
and ``draft_s_per_token`` (its draft's seconds over the tokens fed) says what that work adds to a
prompt's prefill where a decode worker asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cluster.registry.kv_index import TierHits
from cluster.registry.load import StepSample

MIN_SAMPLES = 3
OUTLIER_MADS = 4.0  # a step slower than the fit by this many (scaled) median absolute deviations is a hiccup
OUTLIER_FLOOR_S = 0.001  # ... and by at least this much: exact timings are never hiccups
OUTLIER_ROUNDS = 3
RECENT_DECODE_STEPS = 32  # the latest steps with decodes that the measured step scale is taken over ...
SCALE_TRIM = 8  # ... without the slowest 1 in this many (a collection pause is not the worker's pace)
# A host-tier block's load until the worker has measured one: the order of what this 2-core CPU
# measured for the default model's 720 KiB blocks, 8-bit on the host, when loads were made whole
# before the forward (2.3-3.3 ms); made layer by layer in the background they wait 0.1-0.5 ms a
# block (kv_tiers/host_store.py), so this errs high; a GPU's pinned copies are faster still, and
# the first load a worker reports replaces it.
DEFAULT_HOST_LOAD_S_PER_BLOCK = 0.003
# A block pulled from a peer's cache until the sending worker has measured its sends (its
# transfer tail per block): the order of what gloo on this 2-core CPU moved for the default
# model's blocks in benchmarks/kv_transfer.py; the first measured send replaces it.
DEFAULT_PULL_S_PER_BLOCK = 0.004


def fit_nonnegative(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> tuple[float, ...] | None:
    """Least-squares coefficients >= 0 (a coefficient that comes out negative is pinned at 0
    and the rest refitted); None with fewer than ``MIN_SAMPLES`` rows."""
    if len(rows) < MIN_SAMPLES:
        return None
    x, y = np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        coef[:] = 0.0
        coef[active] = solution
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        active.remove(min(negative, key=lambda i: coef[i]))
    return tuple(float(max(c, 0.0)) for c in coef)


def fit_robust(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> tuple[float, ...] | None:
    """``fit_nonnegative`` without the hiccups: a step that a collection pause or another
    process on the core slowed (a 613 ms step among 7 ms ones, measured) pulls a least-squares
    line far off, and the model then predicts every batch from it. Steps slower than the fit
    by ``OUTLIER_MADS`` scaled median absolute deviations of the residuals are dropped and the
    rest refitted, up to ``OUTLIER_ROUNDS`` times; only slow ones, as nothing makes a step
    faster than its work."""
    coef = fit_nonnegative(rows, seconds)
    if coef is None:
        return None
    x, y = np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float)
    kept = np.ones(len(y), dtype=bool)
    for _ in range(OUTLIER_ROUNDS):
        residual = y - x @ np.asarray(coef)
        centre = np.median(residual[kept])
        spread = 1.4826 * np.median(np.abs(residual[kept] - centre))
        keep = residual <= centre + max(OUTLIER_MADS * spread, OUTLIER_FLOOR_S)
        if (keep == kept).all() or keep.sum() < MIN_SAMPLES:
            break
        kept = keep
        coef = fit_nonnegative(x[kept].tolist(), y[kept].tolist())
    return coef


def _prefill_only(step: StepSample) -> bool:
    return bool(step.prefill_tokens and not step.decodes)


def _decode_only(step: StepSample) -> bool:
    return bool(step.decodes and not step.prefill_tokens)


@dataclass(frozen=True)
class StepTimeModel:
    prefill: tuple[float, float, float] | None  # (a, b per token, c per attention unit)
    decode: tuple[float, float, float] | None  # (a, b per sequence, c per context token)
    transfer_s_per_block: float
    max_num_batched_tokens: int
    guesses_per_sequence: float = 0.0  # speculative decoding, per sequence and decode step: rows checking guesses
    accepted_per_sequence: float = 0.0  # ... and guesses kept (tokens beyond one)
    host_load_s_per_block: float = DEFAULT_HOST_LOAD_S_PER_BLOCK  # a block loaded from the host tier
    draft_s_per_token: float = 0.0  # a prefill worker's draft model, per prompt token it builds the draft's KV of

    @classmethod
    def fit(cls, steps: Sequence[StepSample], max_num_batched_tokens: int) -> "StepTimeModel":
        prefill = [s for s in steps if _prefill_only(s)]
        decode = [s for s in steps if _decode_only(s)]
        sent = [s for s in steps if s.kv_blocks_sent]
        blocks = sum(s.kv_blocks_sent for s in sent)
        sequences = sum(s.decodes for s in decode)
        host_loaded = sum(s.host_loaded_blocks for s in steps)
        drafted = [s for s in prefill if s.draft_tokens]
        draft_tokens = sum(s.draft_tokens for s in drafted)
        return cls(
            prefill=fit_robust([(1.0, s.prefill_tokens, s.prefill_attention) for s in prefill],
                               [s.seconds - s.transfer_tail_s - s.draft_s for s in prefill]),
            decode=fit_robust([(1.0, s.decodes + s.guess_tokens, s.decode_context) for s in decode],
                              [s.seconds for s in decode]),
            transfer_s_per_block=sum(s.transfer_tail_s for s in sent) / blocks if blocks else 0.0,
            max_num_batched_tokens=max_num_batched_tokens,
            guesses_per_sequence=sum(s.guess_tokens for s in decode) / sequences if sequences else 0.0,
            accepted_per_sequence=sum(s.accepted_tokens for s in decode) / sequences if sequences else 0.0,
            host_load_s_per_block=(sum(s.host_load_s for s in steps) / host_loaded if host_loaded
                                   else DEFAULT_HOST_LOAD_S_PER_BLOCK),
            draft_s_per_token=sum(s.draft_s for s in drafted) / draft_tokens if draft_tokens else 0.0,
        )

    def gap_filled_by(self, steps: Sequence[StepSample]) -> bool:
        """Whether ``steps`` hold enough samples to fit a phase this model has no fit for."""
        if self.prefill is not None and self.decode is not None:
            return False
        prefills = sum(1 for s in steps if _prefill_only(s)) if self.prefill is None else 0
        decodes = sum(1 for s in steps if _decode_only(s)) if self.decode is None else 0
        return prefills >= MIN_SAMPLES or decodes >= MIN_SAMPLES

    def prefill_seconds(self, tokens: int, cached: int = 0) -> float:
        """Time to compute ``tokens`` prompt tokens after ``cached`` ones, in budget-sized chunks."""
        if tokens <= 0 or self.prefill is None:
            return 0.0
        a, b, c = self.prefill
        budget = self.max_num_batched_tokens
        total, done = 0.0, cached
        while tokens > 0:
            chunk = min(tokens, budget)
            done += chunk
            total += a + b * chunk + c * chunk * done
            tokens -= chunk
        return total

    def tiered_prefill_seconds(self, tokens: int, block_size: int, hits: TierHits) -> float:
        """Time to the prompt's KV on a worker holding ``hits`` of it: device blocks are free,
        host blocks are loaded, the rest computed after them."""
        cached = hits.blocks * block_size
        return self.host_load_seconds(hits.host) + self.prefill_seconds(tokens - cached, cached)

    def host_load_seconds(self, blocks: int) -> float:
        return self.host_load_s_per_block * max(0, blocks)

    def host_block_worth(self, tokens: int, block_size: int, hits: TierHits) -> float:
        """What the host blocks of ``hits`` are worth against device hits, in [0, 1]: the share
        of their recompute that loading them saves (0 with none, or when loading is slower)."""
        if not hits.host:
            return 0.0
        device = hits.device * block_size
        recompute = self.prefill_seconds(tokens - device, device) - self.prefill_seconds(
            tokens - hits.blocks * block_size, hits.blocks * block_size)
        if recompute <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.host_load_seconds(hits.host) / recompute))

    @property
    def pull_s_per_block(self) -> float:
        """Sending one cached block to a peer: as this worker's sends measured, else the default."""
        return self.transfer_s_per_block or DEFAULT_PULL_S_PER_BLOCK

    def queue_seconds(self, queued_tokens: int) -> float:
        """Time to work through a queue of prompt tokens (their attention terms unknown)."""
        if queued_tokens <= 0 or self.prefill is None:
            return 0.0
        a, b, _ = self.prefill
        return a * -(-queued_tokens // self.max_num_batched_tokens) + b * queued_tokens

    def decode_step_seconds(self, sequences: int, context_tokens: int) -> float:
        """A decode step of ``sequences`` with their guesses, at the measured rate."""
        if self.decode is None:
            return 0.0
        a, b, c = self.decode
        return a + b * sequences * (1.0 + self.guesses_per_sequence) + c * context_tokens

    @property
    def tokens_per_step(self) -> float:
        """Tokens a decoding sequence gets from one step (1 plus its kept guesses)."""
        return 1.0 + self.accepted_per_sequence

    def tpot_seconds(self, sequences: int, context_tokens: int) -> float:
        """Time per output token of one of ``sequences``: a step over the tokens it makes."""
        return self.decode_step_seconds(sequences, context_tokens) / self.tokens_per_step

    def draft_prompt_seconds(self, tokens: int) -> float:
        """A prefill worker's draft model over ``tokens`` prompt tokens (0 until it has built one)."""
        return self.draft_s_per_token * max(0, tokens)

    def transfer_seconds(self, blocks: int) -> float:
        return self.transfer_s_per_block * max(0, blocks)


def pulled_prefill_seconds(receiver: StepTimeModel, sender: StepTimeModel, tokens: int, block_size: int,
                           own: TierHits, peer: TierHits, measured_s_per_block: float = 0.0) -> float:
    """Time to the prompt's KV on a worker holding ``own`` of it that pulls the blocks after them
    from a peer holding ``peer``: its own host blocks loaded, the peer's blocks past ``own``
    sent (those in the peer's host tier loaded there first), the rest computed here after them.
    A block travels at ``measured_s_per_block`` (the receiver's pulls as measured), else at the
    sender's measured sends, else the default. A peer holding no more than ``own`` gives plain
    ``tiered_prefill_seconds``."""
    if peer.blocks <= own.blocks:
        return receiver.tiered_prefill_seconds(tokens, block_size, own)
    pulled = peer.blocks - own.blocks
    peer_host = peer.blocks - max(own.blocks, peer.device)  # of the pulled blocks, those on the peer's host tier
    cached = peer.blocks * block_size
    return (receiver.host_load_seconds(own.host) + sender.host_load_seconds(peer_host)
            + (measured_s_per_block or sender.pull_s_per_block) * pulled
            + receiver.prefill_seconds(tokens - cached, cached))


def measured_step_scale(model: StepTimeModel, steps: Sequence[StepSample], recent: int = RECENT_DECODE_STEPS) -> float:
    """How much longer the worker's latest steps with decodes took than its decode fit
    predicts for their batches: the fit leaves out what a running sequence waits for besides
    its own decode, the prompts prefilled in the same steps and the slow steps that contended
    cores make (``fit_robust`` drops them), but a sequence's TPOT counts every step it is in.
    Under an overload these are most of it: 4x the load the quick start serves measured 396-508
    ms TPOTs where the fit predicted under 100. The slowest steps by that ratio, one in
    ``SCALE_TRIM``, are left out: one pause among a window of 7 ms steps would stop admission.
    1.0 with no decode steps or no fit."""
    if model.decode is None:
        return 1.0
    pairs = [(s.seconds, model.decode_step_seconds(s.decodes, s.decode_context)) for s in steps if s.decodes][-recent:]
    pairs = [(measured, predicted) for measured, predicted in pairs if predicted > 0]
    if not pairs:
        return 1.0
    pairs.sort(key=lambda pair: pair[0] / pair[1])
    kept = pairs[:len(pairs) - len(pairs) // SCALE_TRIM]
    return sum(m for m, _ in kept) / sum(p for _, p in kept)
