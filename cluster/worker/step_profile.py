"""A worker's start-up profile: measured step times for the router's cost model before the
first request, measured once per model, settings and machine and then kept.

The profile (:func:`measure`) runs a few prompts of growing length, then (for a worker that
generates) a decode batch that shrinks by one sequence a step, from up to ``DECODE_BATCH``
sequences down to one, so the cost model sees the batch sizes it will predict rather than a
handful to extrapolate from (a fit from batches of 1 to 4 put 16 sequences at 111 ms a step
where they took about 30). A fresh profile is bounded by time: prompts stop being added after
``PROMPTS_TIME_LIMIT_S``, and the decode batch is cut after ``DECODE_TIME_LIMIT_S`` (its widest
batches measured first); the router gets what was measured by then.

Its steps are kept as JSON under ``<tandem cache>/step-profiles/``, keyed by everything that
sets a step's time (:func:`profile_key`): the checkpoint's files (path, size, modification
time), the engine settings that shape a step (dtype, quantization, device, block size, token
budget, batch limit, context length, KV blocks, TP degree, threads, attention backend, native
kernels), the machine (CPU model and count, the GPU's name), the software (torch and Tandem's
versions and a digest of the engine's sources) and the profile's own recipe. A later start of
the same worker reuses them (:func:`start_up`) and only runs one short request to warm the
model up; a changed key measures afresh. The ``KEPT_PROFILES`` most recently used are kept;
deleting the folder clears them. Workers starting together on one machine measure one at a time
(:func:`measuring_alone`): a profile is a worker's steps alone on its node.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import socket
import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterable

import torch

import cluster.engine
from cluster.engine.engine import EngineStats, LLMEngine, StepRecord
from cluster.engine.kernels import native_kernels_enabled
from cluster.engine.kernels.build import cpu_model
from cluster.engine.models.source import resolve_model_source
from cluster.engine.sampling_params import SamplingParams
from cluster.paths import cache_dir, keep_newest, read_cache_file, write_cache_file

PROMPT_TOKENS = (16, 64, 256, 512)
DECODE_BATCH = 32  # the widest decode batch measured (less where max_num_seqs or the cache says)
PROMPTS_TIME_LIMIT_S = 10.0
DECODE_TIME_LIMIT_S = 20.0
WARM_UP_TOKENS = 16
PROFILE_FORMAT = 1
KEPT_PROFILES = 64  # the most recently used are kept
ALONE_WAIT_S = 2 * (PROMPTS_TIME_LIMIT_S + DECODE_TIME_LIMIT_S) + 30  # another worker's profile, and its start


def start_up(engine: LLMEngine, role: str) -> bool:
    """Gives the engine its start-up profile in ``engine.stats.steps``: the kept one for this
    key, or one measured now (then kept). True when it was measured."""
    key = profile_key(engine, role)
    kept = kept_steps(key)
    if kept is not None:
        _warm_up(engine, role)
        _forget_requests(engine, kept)
        return False
    wait = getattr(engine.runner, "wait_for_kv_memory", None)
    if wait is not None:  # measured alone, not beside the KV cache's pages being faulted in
        wait()
    with measuring_alone():
        measure(engine, role)
    keep_steps(key, list(engine.stats.steps))
    return True


@contextmanager
def measuring_alone(wait_s: float = ALONE_WAIT_S):
    """Holds this machine's profiling lock while a profile is measured, so that workers starting
    together on one node measure one after the other: measured side by side on 2 cores, the quick
    start's two workers put a 16-token prompt at 82 ms against 20 alone, and the router then
    predicted a 4-token local prefill at 105 ms and never chose it. Waits at most ``wait_s`` for
    the lock (a profile is bounded by its time limits; a holder that died let go with its
    process), then measures anyway."""
    path = cache_dir() / "step-profiles" / f".measuring-{socket.gethostname()}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:  # closing it lets go of the lock
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                time.sleep(0.05)
        yield


def measure(engine, role: str) -> None:
    """Runs the profile on ``engine`` (an LLMEngine, or the planner's simulated one): its steps
    stay in ``engine.stats.steps``; its requests' blocks and every other counter are dropped."""
    rng = random.Random(0)
    limit = min(engine.max_model_len - 16, engine.block_manager.num_blocks * engine.config.block_size // 2)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(min(n, limit))]

    deadline = time.monotonic() + PROMPTS_TIME_LIMIT_S
    for i, n in enumerate(PROMPT_TOKENS):
        if time.monotonic() >= deadline:
            break
        engine.add_request(f"profile-prefill-{i}", prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
        _step_until_done(engine, deadline)
    if role != "prefill":
        # Request i asks for i + 2 tokens, so the batch loses one sequence a step; prompt
        # lengths vary so that context and batch size are not one measurement.
        lengths = [16 + (37 * i) % 112 for i in range(DECODE_BATCH)]
        width = min(DECODE_BATCH, engine.config.max_num_seqs)
        while width > 1 and sum(lengths[i] + i + 2 for i in range(width)) > limit:
            width -= 1
        for i in range(width):
            engine.add_request(f"profile-decode-{i}", prompt(lengths[i]),
                               SamplingParams(max_tokens=i + 2, ignore_eos=True))
        _step_until_done(engine, time.monotonic() + DECODE_TIME_LIMIT_S)
    _forget_requests(engine, list(engine.stats.steps))


def _step_until_done(engine, deadline: float) -> None:
    """Steps until every request is done, or aborts what is left once ``deadline`` has passed."""
    while engine.has_unfinished_requests():
        if time.monotonic() >= deadline:
            for request_id in list(engine.scheduler.requests):
                engine.abort_request(request_id)
            return
        engine.step()


def _warm_up(engine: LLMEngine, role: str) -> None:
    """One short request (a prompt, and a decode step where the worker generates), so the first
    real request does not pay the model's first steps; its steps are not kept."""
    prompt = [random.Random(0).randrange(engine.model_config.vocab_size) for _ in range(WARM_UP_TOKENS)]
    engine.add_request("warm-up", prompt, SamplingParams(max_tokens=1 if role == "prefill" else 2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    _forget_requests(engine, ())


def _forget_requests(engine, steps: Iterable[StepRecord]) -> None:
    """Drops what the start-up requests left (cached blocks, their events, counters), keeping ``steps``."""
    engine.block_manager.reset_prefix_cache()
    engine.block_manager.drain_events()
    engine.stats = EngineStats()
    engine.stats.steps.extend(steps)


# -- keeping profiles -------------------------------------------------------------------------

def profile_key(engine: LLMEngine, role: str) -> dict:
    """Everything a step's time depends on (see the module's docstring), as plain values."""
    config, model = engine.config, engine.model_config
    device = torch.device(config.device)
    return {
        "format": PROFILE_FORMAT,
        "role": role,
        "model": _checkpoint_identity(config.model),
        "engine": {"dtype": str(model.dtype), "quantization": model.quantization, "device": str(device),
                   "block_size": config.block_size, "max_num_batched_tokens": config.max_num_batched_tokens,
                   "max_num_seqs": config.max_num_seqs, "max_model_len": engine.max_model_len,
                   "num_blocks": engine.block_manager.num_blocks, "tp": config.tensor_parallel_size,
                   "threads": torch.get_num_threads(), "attention_backend": config.attention_backend,
                   "enforce_eager": config.enforce_eager, "chunked_prefill": config.enable_chunked_prefill,
                   "load_format": config.load_format, "native_kernels": native_kernels_enabled()},
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "software": {"torch": torch.__version__, "tandem": _tandem_version(), "engine": _engine_digest()},
        "recipe": {"prompt_tokens": list(PROMPT_TOKENS), "decode_batch": DECODE_BATCH,
                   "prompts_s": PROMPTS_TIME_LIMIT_S, "decode_s": DECODE_TIME_LIMIT_S},
    }


def profile_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "step-profiles" / f"{key['model']['name'][:40]}-{key['role']}-{digest}.json"


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


def _tandem_version() -> str:
    try:
        return version("tandem")
    except PackageNotFoundError:
        return "unknown"


@cache
def _engine_digest() -> str:
    """A digest of the engine's sources: a development checkout changes step times (a kernel,
    a layer) without changing the version."""
    root = Path(cluster.engine.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
