"""A worker's start-up profile: measured step times for the router's cost model before the
first request, measured once per model, settings and machine and then kept.

The profile (:func:`measure`) runs a few prompts of growing length, twice over, then (for a worker
that generates) a decode batch that shrinks by two sequences a step, from up to ``DECODE_BATCH``
sequences down to two, then one, so the cost model sees the batch sizes it will predict rather than
a handful to extrapolate from (a fit from batches of 1 to 4 put 16 sequences at 111 ms a step where
they took about 30). The batch's sequences join it as a decode worker's do, with their prompts' KV
as if sent (blocks held, a first token given, nothing computed): a step's time does not depend on
the values in its KV, and the prompts are the other part's to measure. In process on 2 cores, the
default model's decode batch took 4.6 s with its prompts prefilled and one sequence fewer a step,
0.95-1.1 s now (its prompts part: 2.3-3.1 s). A fresh profile is bounded by time: prompts stop being
added after ``PROMPTS_TIME_LIMIT_S``, and the decode batch is cut after ``DECODE_TIME_LIMIT_S`` (its
widest batches measured first); the router gets what was measured by then. It is measured on a warm
engine (after the warm-up request), so its first prompt is not the model's first step.

Its two parts, the prompts and the decode batch, are kept apart, each under a key without the
worker's role (:func:`parts_of` says which a role needs): a worker whose engine settings match
one that started before it takes the parts that one measured. The quick start's workers share
their settings, so the second to measure measures only the decode batch, or nothing: the default
model's two profiles took 9.4-10.0 s measured whole, 6.9-7.0 s in parts (2 cores, in process).
A profile does not wait for its worker's KV cache to be faulted in: the fault-ins of the
machine pause while one is measured (``cluster/engine/node_quiet.py``).

Its steps are kept as JSON under ``<tandem cache>/step-profiles/``, keyed by everything that
sets a step's time and is known before a step runs (:func:`profile_key`): the checkpoint's files
(path, size, modification time), the engine settings that shape a step (dtype, quantization,
device, block size, token budget, batch limit, context length, KV blocks, TP degree, threads,
attention backend, native kernels), the machine (CPU model and count, the GPU's name), torch's
version and the profile's own recipe. What the key cannot see, the engine's code (a development
checkout edits it without a new version), is checked by a measured probe instead: a later start
with the same key runs its warm-up request, then the same request timed (:func:`probe`, alone on
the machine), and keeps the profile unless the probe's steps take less than
1/``PROBE_TOLERANCE`` (a quarter) of the kept steps of the same shapes (:func:`profile_holds`); then it
measures afresh. Only a faster probe contradicts a profile: timing noise on a shared machine is
one-sided (other work only slows a step down; a probe on 2 busy cores took 4x a profile measured
minutes before with no change to the engine), so a probe much faster than the profile means the
profile was measured slow (an engine since made faster, or a busy machine), while a slower one
may only mean a busy machine now. An engine made slower, or faster by less than the tolerance,
keeps the profile: the router refits each worker's cost model to the live steps its reports
carry, which replace the profile's within a few dozen steps. The ``KEPT_PROFILES`` most recently used are kept; deleting
the folder clears them. Workers starting together on one machine warm up, measure and probe one
at a time (:func:`measuring_alone`): a profile is a worker's steps alone on its node, with no
other worker's warm-up (a cold engine's first steps) beside it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from statistics import median
from typing import Iterable

import torch

from cluster.engine.engine import EngineStats, LLMEngine, StepRecord
from cluster.engine import node_quiet
from cluster.engine.kernels import native_kernels_enabled
from cluster.engine.kernels.build import cpu_model
from cluster.engine.models.source import resolve_model_source
from cluster.engine.sampling_params import SamplingParams
from cluster.paths import cache_dir, keep_newest, read_cache_file, write_cache_file

PROMPT_TOKENS = (16, 32, 64, 128, 256, 512)
# Each prompt is measured this many times, the rounds one after the other: a step that something
# else slowed is then one sample among its shape's others, which the router's fit drops as an
# outlier. With one round (4 prompts) the fit had nothing to drop: two fresh profiles of the same
# prefill worker put its fixed cost at 43 ms and at 161 ms, and a decode worker's prefill fit,
# kept from its profile, sent one cluster's short prompts all to its prefill worker and another's
# all to be prefilled where they decode (1-stream TTFT 27.9 against 16.0 ms).
PROMPT_ROUNDS = 2
DECODE_BATCH = 32  # the widest decode batch measured (less where max_num_seqs or the cache says)
PROMPTS_TIME_LIMIT_S = 10.0
DECODE_TIME_LIMIT_S = 20.0
WARM_UP_TOKENS = 16  # the warm-up's prompt: the profile's first prompt shape, so the probe has its kept twin
# A probe under a quarter of the kept steps' time has the profile measured again. On this project's
# 2 shared cores, at a load of 10, profiles were measured 2.3x and 3.1x slower than the next start's
# probe found, and measured again for 18 to 28 s; a profile off by less only misleads the router
# until the live steps its worker reports replace the profile's in its fit (a few dozen steps).
PROBE_TOLERANCE = 4.0
PROFILE_FORMAT = 3  # 3: kept in parts (2 kept a worker's whole profile; 1 was keyed by the engine's code)
PARTS = ("prompts", "decode")  # a profile's parts, each kept on its own (``parts_of``)
KEPT_PROFILES = 64  # the most recently used are kept
ALONE_WAIT_S = 2 * (PROMPTS_TIME_LIMIT_S + DECODE_TIME_LIMIT_S) + 30  # another worker's profile, and its start


def parts_of(role: str) -> tuple[str, ...]:
    """The parts of the profile a worker of ``role`` needs: the prompts, and the decode batch
    where it generates."""
    return ("prompts",) if role == "prefill" else PARTS


def start_up(engine: LLMEngine, role: str) -> bool:
    """Gives the engine its start-up profile in ``engine.stats.steps`` (its prompts' steps, then
    its decode batch's): each part the one kept for its key while a probe confirms what is kept,
    or measured now (then kept). True when any part was measured."""
    keys = {part: profile_key(engine, part) for part in parts_of(role)}
    # Alone: a cold engine's first steps would slow another worker's profile. The kept parts are
    # read once the lock is held: a worker beside this one may have just measured a part they share.
    with measuring_alone():
        kept = {part: kept_steps(key) for part, key in keys.items()}
        _warm_up(engine, role)
        held = [step for steps in kept.values() if steps is not None for step in steps]
        if held:
            probed = probe(engine, role)
            if not profile_holds(held, probed):
                _log(f"{engine.config.engine_name or role}: the kept step profile does not hold here any more "
                     f"({_probe_summary(held, probed)}); measuring it again")
                kept = dict.fromkeys(keys)
        _forget_requests(engine, ())
        missing = tuple(part for part, steps in kept.items() if steps is None)
        measured = measure_parts(engine, missing) if missing else {}
        for part, steps in measured.items():  # under the lock: the next worker to take it reads them
            keep_steps(keys[part], steps)
    _forget_requests(engine, [step for part in keys
                              for step in (kept[part] if kept[part] is not None else measured[part])])
    return bool(missing)


def probe(engine, role: str) -> list[StepRecord]:
    """The warm-up request run once more, timed: a 16-token prompt, and a one-sequence decode
    step where the worker generates. Once is enough: noise only slows a step, and a slower probe
    never contradicts a profile (:func:`profile_holds`)."""
    _warm_up(engine, role)
    steps = list(engine.stats.steps)
    _forget_requests(engine, ())
    return steps


def profile_holds(kept: list[StepRecord], probed: list[StepRecord], tolerance: float | None = None) -> bool:
    """Whether the probe's steps take at least 1/``tolerance`` (default ``PROBE_TOLERANCE``) of
    the kept steps of the same shapes (their median per shape), summed over the shapes both have.
    A probe that shares no shape with the profile cannot confirm it."""
    ratio = probe_ratio(kept, probed)
    tolerance = PROBE_TOLERANCE if tolerance is None else tolerance
    return ratio is not None and ratio >= 1 / tolerance


def probe_ratio(kept: list[StepRecord], probed: list[StepRecord]) -> float | None:
    """The probe's time over the kept profile's for the shapes both have (None: no shared shape)."""
    by_shape: dict[tuple[int, int], list[float]] = {}
    for step in kept:
        by_shape.setdefault(_shape(step), []).append(step.seconds)
    pairs = [(step.seconds, median(by_shape[_shape(step)])) for step in probed if _shape(step) in by_shape]
    kept_s = sum(k for _, k in pairs)
    return sum(p for p, _ in pairs) / kept_s if pairs and kept_s > 0 else None


def _shape(step: StepRecord) -> tuple[int, int]:
    return step.num_prefill_tokens, step.num_decode_tokens


def _probe_summary(kept: list[StepRecord], probed: list[StepRecord]) -> str:
    ratio = probe_ratio(kept, probed)
    if ratio is None:
        return "its probe shares no step shape with it"
    return f"a probe's steps took {ratio:.2f}x the kept ones"


def _log(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


@contextmanager
def measuring_alone(wait_s: float = ALONE_WAIT_S):
    """Holds this machine's profiling lock while a profile is measured, so that workers starting
    together on one node measure one after the other: measured side by side on 2 cores, the quick
    start's two workers put a 16-token prompt at 82 ms against 20 alone, and the router then
    predicted a 4-token local prefill at 105 ms and never chose it. While it is held, every
    engine's KV cache fault-in on the machine pauses (``cluster/engine/node_quiet.py``). Waits at
    most ``wait_s`` for the lock (a profile is bounded by its time limits; a holder that died let
    go with its process), then measures anyway."""
    descriptor = node_quiet.open_lock()
    if descriptor is None:
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                time.sleep(0.05)
        yield
    finally:
        os.close(descriptor)  # closing it lets go of the lock


def measure(engine, role: str) -> None:
    """Runs the profile of a worker of ``role`` on ``engine`` (an LLMEngine, or the planner's
    simulated one): its steps stay in ``engine.stats.steps``; its requests' blocks and every
    other counter are dropped."""
    measure_parts(engine, parts_of(role))


def measure_parts(engine, parts: tuple[str, ...]) -> dict[str, list[StepRecord]]:
    """Measures ``parts`` of the profile, in order: each part's steps, also left in
    ``engine.stats.steps``, with every other trace of its requests dropped."""
    rng = random.Random(0)
    limit = min(engine.max_model_len - 16, engine.block_manager.num_blocks * engine.config.block_size // 2)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(min(n, limit))]

    spans = {}  # part -> (first, end) of its steps in engine.stats.steps
    if "prompts" in parts:
        first = len(engine.stats.steps)
        deadline = time.monotonic() + PROMPTS_TIME_LIMIT_S
        for i, n in enumerate(PROMPT_TOKENS * PROMPT_ROUNDS):
            if time.monotonic() >= deadline:
                break
            engine.block_manager.reset_prefix_cache()  # every token computed: no hit, not even a partial one
            engine.add_request(f"profile-prefill-{i}", prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            _step_until_done(engine, deadline)
        spans["prompts"] = (first, len(engine.stats.steps))
    if "decode" in parts:
        first = len(engine.stats.steps)
        # Prompt lengths vary so that context and batch size are not one measurement.
        lengths = [16 + (37 * i) % 112 for i in range(DECODE_BATCH)]
        width = min(DECODE_BATCH, engine.config.max_num_seqs)
        while width > 1 and sum(lengths[i] + n + 1 for i, n in enumerate(decode_steps_of(width))) > limit:
            width -= 1
        steps = decode_steps_of(width)
        engine.block_manager.reset_prefix_cache()
        # Each joins the batch as a transferred prompt does on a decode worker (see the module's docstring).
        for i in range(width):
            request_id = f"profile-decode-{i}"
            params = SamplingParams(max_tokens=steps[i] + 1, ignore_eos=True)  # its first token, then its steps
            if engine.reserve_transfer(request_id, prompt(lengths[i]), params) is None:
                break
            engine.admit_transfer(request_id, rng.randrange(vocab))
        _step_until_done(engine, time.monotonic() + DECODE_TIME_LIMIT_S)
        spans["decode"] = (first, len(engine.stats.steps))
    steps = list(engine.stats.steps)
    _forget_requests(engine, steps)
    return {part: steps[first:end] for part, (first, end) in spans.items()}


def decode_steps_of(width: int) -> list[int]:
    """The decode steps each of a batch of ``width`` sequences takes part in, so that the batch
    is ``width`` wide at its first step, two fewer at each next one down to two (or one), then
    one: sequence i stays while i is below the step's width."""
    widths = list(range(width, 0, -2)) + ([1] if width % 2 == 0 else [])
    return [sum(w > i for w in widths) for i in range(width)]


def _step_until_done(engine, deadline: float) -> None:
    """Steps until every request is done, or aborts what is left once ``deadline`` has passed."""
    while engine.has_unfinished_requests():
        if time.monotonic() >= deadline:
            for request_id in list(engine.scheduler.requests):
                engine.abort_request(request_id)
            return
        engine.step()


def _warm_up(engine: LLMEngine, role: str) -> None:
    """One short request (a prompt, and a decode step where the worker generates), so that
    neither the profile nor the first real request pays the model's first steps. Its steps are
    left in ``engine.stats.steps`` (for :func:`probe`), its blocks and other counters dropped."""
    prompt = [random.Random(0).randrange(engine.model_config.vocab_size) for _ in range(WARM_UP_TOKENS)]
    _forget_requests(engine, ())
    engine.add_request("warm-up", prompt, SamplingParams(max_tokens=1 if role == "prefill" else 2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    _forget_requests(engine, list(engine.stats.steps))


def _forget_requests(engine, steps: Iterable[StepRecord]) -> None:
    """Drops what the start-up requests left (cached blocks, their events, counters), keeping ``steps``."""
    engine.block_manager.reset_prefix_cache()
    engine.block_manager.drain_events()
    engine.stats = EngineStats()
    for step in steps:
        engine.stats.record(step)


# -- keeping profiles -------------------------------------------------------------------------

def profile_key(engine: LLMEngine, part: str) -> dict:
    """Everything a step's time depends on (see the module's docstring), as plain values, and
    the part of the profile (``prompts`` or ``decode``) with its recipe."""
    config, model = engine.config, engine.model_config
    device = torch.device(config.device)
    recipe = ({"prompt_tokens": list(PROMPT_TOKENS), "rounds": PROMPT_ROUNDS, "prompts_s": PROMPTS_TIME_LIMIT_S}
              if part == "prompts" else {"decode_batch": DECODE_BATCH, "decode_s": DECODE_TIME_LIMIT_S})
    return {
        "format": PROFILE_FORMAT,
        "part": part,
        "model": _checkpoint_identity(config.model),
        "engine": {"dtype": str(model.dtype), "quantization": model.quantization, "device": str(device),
                   "cpu_matmul_dtype": model.cpu_matmul_dtype,
                   "block_size": config.block_size, "max_num_batched_tokens": config.max_num_batched_tokens,
                   "max_num_seqs": config.max_num_seqs, "max_model_len": engine.max_model_len,
                   "num_blocks": engine.block_manager.num_blocks, "tp": config.tensor_parallel_size,
                   "threads": torch.get_num_threads(), "attention_backend": config.attention_backend,
                   "enforce_eager": config.enforce_eager, "chunked_prefill": config.enable_chunked_prefill,
                   "load_format": config.load_format, "native_kernels": native_kernels_enabled()},
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "software": {"torch": torch.__version__},  # the engine's own code is checked by the probe
        "recipe": recipe,
    }


def profile_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "step-profiles" / f"{key['model']['name'][:40]}-{key['part']}-{digest}.json"


def kept_steps(key: dict) -> list[StepRecord] | None:
    """The steps kept for ``key``, or None (none kept, or unreadable)."""
    try:
        data = json.loads(read_cache_file(profile_path(key)))
        if data["key"] != key:
            return None
        return [StepRecord(**step) for step in data["steps"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_steps(key: dict, steps: list[StepRecord]) -> None:
    path = profile_path(key)
    if write_cache_file(path, json.dumps({"key": key, "steps": [asdict(s) for s in steps]})):
        keep_newest(path.parent, KEPT_PROFILES)


def _checkpoint_identity(model: str) -> dict:
    """The checkpoint's name, and [resolved path, size, modification time] of each file it is read from."""
    source = resolve_model_source(model)
    files = [source.gguf_file] if source.is_gguf else sorted(p for p in source.path.iterdir() if p.is_file())
    identity = []
    for path in files:
        stat = path.resolve().stat()
        identity.append([str(path.resolve()), stat.st_size, stat.st_mtime_ns])
    return {"name": source.name, "files": identity}
