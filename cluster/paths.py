"""Where Tandem keeps what it builds on a machine (the default model, compiled kernels, start-up
profiles, GGUF indexes)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Tandem's cache root: ``$TANDEM_CACHE_DIR`` if set, else ``~/.cache/tandem``."""
    configured = os.environ.get("TANDEM_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tandem"


def write_cache_file(target: Path, text: str) -> bool:
    """Writes ``target`` whole or not at all, so a process reading it never sees half a file;
    False (and nothing left behind) when it cannot be written: a cache that cannot be kept only
    costs the next start the work again."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError:
        return False
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(scratch, target)
        return True
    except OSError:
        Path(scratch).unlink(missing_ok=True)
        return False


def read_cache_file(path: Path) -> str:
    """A cache entry's text, the entry marked as just used (see :func:`keep_newest`); OSError
    when there is none."""
    text = path.read_text(encoding="utf-8")
    try:
        os.utime(path)
    except OSError:
        pass
    return text


def keep_newest(folder: Path, count: int, pattern: str = "*.json") -> None:
    """Removes all but the ``count`` most recently written or read (:func:`read_cache_file`)
    files of ``folder`` matching ``pattern``: a cache of entries keyed by files that come and go
    (test checkpoints, replaced models) stays bounded."""
    try:
        entries = sorted(folder.glob(pattern), key=lambda path: path.stat().st_mtime_ns, reverse=True)
    except OSError:  # one removed meanwhile by another process
        return
    for stale in entries[count:]:
        stale.unlink(missing_ok=True)
