"""Tandem's default model, trained by Tandem itself so the quick start needs no download.

:func:`default_model_dir` returns a folder that ``transformers`` (and Tandem's engine) can load
as a Llama checkpoint. The first call on a machine builds it (a few minutes on a laptop CPU,
from the documentation shipped with Python; see :mod:`cluster.default_model.train`); later
calls find it in the cache.

The cache is ``$TANDEM_CACHE_DIR/models/tandem-default-v1``, or ``~/.cache/tandem/...`` when
the variable is unset. A build writes into a temporary folder beside that one and renames it
into place when complete, so the model folder either does not exist or is whole; a lock file
makes concurrent callers wait for one build rather than racing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cluster.paths import cache_dir

DEFAULT_MODEL_NAME = "tandem-default-v1"

# Files a finished build always has; a folder without them is not a model.
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

__all__ = ["DEFAULT_MODEL_NAME", "cache_dir", "default_model_config", "default_model_dir"]


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def default_model_config(dtype: str | None = None):
    """The default model's :class:`~cluster.engine.models.config.ModelConfig` without building
    it: the cached build's, or else the fixed architecture every build has (its heads, MLP and
    context; the vocabulary is the tokenizer trainer's target size), so a topology can be
    checked against it before the first build."""
    from cluster.engine.models.config import load_model_config, parse_model_config

    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return load_model_config(target, dtype)
    from cluster.default_model.train import ModelConfig, TrainConfig

    raw = ModelConfig(vocab_size=TrainConfig().vocab_size).to_hf_config(eos_token_id=0)
    return parse_model_config(raw, {}, Path(f"<{DEFAULT_MODEL_NAME}>/config.json"), dtype)


def default_model_dir() -> Path:
    """The default model's folder, built first (progress on stderr) if it is not cached yet."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent / f".{DEFAULT_MODEL_NAME}.lock"
    with open(lock_path, "a") as lock:
        # The lock is released when the file closes, even if this process dies.
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("Tandem: waiting for another process to build the default model",
                  file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target):  # another process built it while we waited
            return target
        _remove_leftovers(target)
        _build_into(target)
    return target


def _remove_leftovers(target: Path) -> None:
    """Delete temp folders of builds that were killed, and any incomplete model folder.

    Safe because the caller holds the lock: no other build can be running.
    """
    for stale in target.parent.glob(f".{DEFAULT_MODEL_NAME}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)


# Extra command-line arguments for the build (tests shrink it with --max-steps).
_BUILD_ARGS: tuple[str, ...] = ()


def _build_into(target: Path) -> None:
    """Run the build in a child process, into a temp folder, then rename it into place.

    A child process leaves this one's torch thread pool, RNG and memory untouched, and lets
    the trainer choose OpenMP settings that only take effect before torch is loaded.
    """
    print(
        f"Tandem: building the default model {DEFAULT_MODEL_NAME} into {target} "
        "(first run only; about five minutes on a laptop CPU)",
        file=sys.stderr,
        flush=True,
    )
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", suffix=".tmp", dir=target.parent))
    # The folder holding the ``cluster`` package, so the child imports this same code.
    source_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "cluster.default_model.train", "--out", str(tmp), *_BUILD_ARGS]
    try:
        subprocess.run(cmd, env=env, check=True)
        if not _is_complete(tmp):
            raise RuntimeError(f"the default model build left an incomplete folder {tmp}")
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"Tandem: default model ready at {target}", file=sys.stderr, flush=True)
