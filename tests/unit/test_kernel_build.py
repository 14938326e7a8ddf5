"""The native kernels' build: processes starting together compile a library once between them,
and the prebuild entry compiles (or finds) every library ahead of a first start."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cluster.engine.kernels import build, prebuild

pytestmark = pytest.mark.unit


def test_takers_starting_together_compile_once(tmp_path, monkeypatch):
    compiled = []

    def slow_compile(compiler: str, source_path: Path, target: Path) -> None:
        compiled.append(target)
        time.sleep(0.3)  # the second taker arrives while this one compiles
        target.write_bytes(b"library")

    monkeypatch.setattr(build, "_compile", slow_compile)
    target = tmp_path / "kernels" / "decode_step-0123.so"
    takers = [threading.Thread(target=build._compile_once, args=("cc", Path("decode_step.c"), target))
              for _ in range(3)]
    for taker in takers:
        taker.start()
    for taker in takers:
        taker.join()
    assert compiled == [target] and target.read_bytes() == b"library"


def test_prebuild_readies_every_library(capsys):
    assert prebuild.main() == 0
    assert capsys.readouterr().err.splitlines() == [f"[tandem] native kernel {name}: ready" for name in build.LIBRARIES]
