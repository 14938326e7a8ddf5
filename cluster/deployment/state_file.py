"""Where a cluster that ``tandem up`` started says how to reach it: ``<cache>/clusters/<name>.json``
(pid, Ray address, API, dashboard, the actors' names, the registry's URL without its password,
the topology, the API's certificate and where its token is, never the token). ``tandem down``,
``status``, ``top``, ``bench`` and ``plan`` read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cluster.paths import cache_dir


def state_file(cluster: str) -> Path:
    return cache_dir() / "clusters" / f"{cluster}.json"


def read_state(cluster: str) -> dict | None:
    try:
        return json.loads(state_file(cluster).read_text())
    except (OSError, ValueError):
        return None


def process_alive(pid: int) -> bool:
    """Whether a process of this pid exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
