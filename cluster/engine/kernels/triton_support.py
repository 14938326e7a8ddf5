"""Whether and how the Triton attention backend runs here; imports nothing of Triton itself.

The backend is chosen once per engine: ``"auto"`` takes Triton on a CUDA device when Triton is
installed (every CUDA build of torch brings it) and the plain-torch path elsewhere. On a CPU
Triton runs only under its interpreter (``TRITON_INTERPRET=1``), which is how the kernels and
the engine's fused path are tested without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

BACKENDS = ("auto", "torch", "triton")


class BackendUnavailableError(ValueError):
    """The attention backend asked for cannot run on this machine; the message says why."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:
        return False


def resolve_attention_backend(requested: str, device: torch.device) -> str:
    """"torch" or "triton" for ``requested`` (one of BACKENDS) on ``device``."""
    if requested not in BACKENDS:
        raise BackendUnavailableError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    if requested == "torch":
        return "torch"
    runs_here = device.type == "cuda" or (device.type == "cpu" and interpreting())
    if requested == "auto":
        return "triton" if device.type == "cuda" and triton_installed() else "torch"
    if not triton_installed():
        raise BackendUnavailableError("attention_backend 'triton' needs the triton package (pip install triton)")
    if not runs_here:
        raise BackendUnavailableError(
            f"attention_backend 'triton' runs on CUDA devices (or on the CPU under TRITON_INTERPRET=1), not on {device}"
        )
    return "triton"


FP8_TENSOR_CORES = (8, 9)  # compute capability: Ada and Hopper onward have FP8 tensor cores


@cache
def device_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def capability_at_least(device: torch.device, capability: tuple[int, int]) -> bool:
    """A CUDA device of at least this compute capability (False off CUDA)."""
    return device.type == "cuda" and device_capability(device) >= capability


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


MAX_DECODE_SPLITS = 16


def decode_split_choices(max_splits: int = MAX_DECODE_SPLITS) -> tuple[int, ...]:
    """Every split count :func:`choose_decode_splits` can return: 1, 2, 4, ... up to ``max_splits``."""
    choices = [1]
    while choices[-1] * 2 <= max_splits:
        choices.append(choices[-1] * 2)
    return tuple(choices)


def choose_decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int, longest: int | None = None,
                         max_splits: int = MAX_DECODE_SPLITS, min_keys_per_split: int = 256) -> int:
    """How many parts each request's context is split into for decode attention.

    A decode program handles one request and one KV head; with few requests there are too few
    programs to keep every SM reading memory, so each context is split until there are about
    two programs per SM. ``longest`` (the longest context, when known) caps the split so each
    part holds at least ``min_keys_per_split`` keys; a CUDA graph, which must fix the split for
    any context, passes None. A power of two, so few kernel variants are compiled.
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = max(1, -(-2 * num_sms // programs))
    if longest is not None:
        wanted = min(wanted, max(1, longest // min_keys_per_split))
    splits = 1
    while splits * 2 <= min(wanted, max_splits):
        splits *= 2
    return splits
