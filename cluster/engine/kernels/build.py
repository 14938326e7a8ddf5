"""Compiles a kernel's C source once per machine and loads it with ctypes.

The shared library is cached under ``<tandem cache>/kernels/<name>-<key>.so``, where the key
hashes the source, the compiler's version, the flags and the CPU model (the code is built for
the CPU it runs on). A build writes a temporary file and renames it into place, so concurrent
processes never load a half-written library, and under a lock file, so processes starting
together (a node's workers) compile it once between them. ``python -m
cluster.engine.kernels.prebuild`` compiles every kernel ahead of a first start
(``scripts/bootstrap.sh`` does, when it installs). The source is compiled with fast-math but
linked without it, so loading the library does not change the process's floating-point mode.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from cluster.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-pthread", "-fPIC", "-std=c11", "-D_GNU_SOURCE")
LINK_FLAGS = ("-shared", "-pthread")


class NativeKernelError(RuntimeError):
    pass


def native_kernels_enabled() -> bool:
    return os.environ.get("TANDEM_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cpu_model() -> str:
    """The CPU's model name (or its flags line), from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_key(compiler: str, source: bytes) -> str:
    """Hashes the source with every C file of the folder (a kernel may include another)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256()
    included = b"".join(path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.c")))
    for part in (source, included, version.encode(), " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(), cpu_model().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _compile(compiler: str, source_path: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as scratch:
        obj, lib = Path(scratch) / "kernel.o", Path(scratch) / "kernel.so"
        for command in (
            [compiler, *COMPILE_FLAGS, "-c", str(source_path), "-o", str(obj)],
            [compiler, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"],
        ):
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise NativeKernelError(f"{' '.join(command)} failed:\n{result.stderr.strip()}")
        os.replace(lib, target)


def _compile_once(compiler: str, source_path: Path, target: Path) -> None:
    """Compiles ``target`` unless another process, holding the lock first, has meanwhile."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f".{target.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes (or its process ends)
        if not target.is_file():
            logger.info("compiling native kernel %s", source_path.stem)
            _compile(compiler, source_path, target)


LIBRARIES = ("decode_step",)  # every CPU kernel is in one library (one thread pool: thread_pool.c)


_loaded: list[ctypes.CDLL] = []  # every library this process loaded, in order


def loaded_libraries() -> tuple[ctypes.CDLL, ...]:
    """The kernel libraries this process has loaded so far (none is loaded by asking)."""
    return tuple(_loaded)


@cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled ``<name>.c`` of this folder, or None (with one warning) when it cannot be
    built or loaded; callers then use their plain-torch path."""
    if not native_kernels_enabled():
        return None
    compiler = c_compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC): native kernel %s unavailable, using plain torch", name)
        return None
    source_path = SOURCE_DIR / f"{name}.c"
    try:
        target = cache_dir() / "kernels" / f"{name}-{_build_key(compiler, source_path.read_bytes())}.so"
        if not target.is_file():
            _compile_once(compiler, source_path, target)
        library = ctypes.CDLL(str(target))
        _loaded.append(library)
        return library
    except (OSError, NativeKernelError) as exc:
        logger.warning("native kernel %s unavailable, using plain torch: %s", name, exc)
        return None
