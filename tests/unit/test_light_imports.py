"""What a process that moves no tensors imports: an ingress replica (its module, and the worker
classes it loads to hold the workers' Ray handles) and a topology check load no torch, which
takes a second or more of each such process's start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys
import cluster.ingress.replica, decode_worker.worker, decode_worker.colocated, prefill_worker.worker
from cluster.topology import parse_topology
from cluster.topology.checks import transport
transport("torch_distributed")
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_the_ingress_and_the_worker_classes_load_without_torch():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
