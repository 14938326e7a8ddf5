"""Where Tandem keeps what it builds on a machine (the default model, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Tandem's cache root: ``$TANDEM_CACHE_DIR`` if set, else ``~/.cache/tandem``."""
    configured = os.environ.get("TANDEM_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "tandem"
