"""A Tandem cluster for end-to-end tests: `tandem up --detach` on a topology, its state file,
`tandem status`, a Ray driver in a process of its own, and `tandem down`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from cluster.paths import cache_dir
from cluster.runtime.ports import free_port  # noqa: F401 - the tests' ports, as the launcher picks them

_SCRIPT = Path(sys.executable).parent / "tandem"
TANDEM = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "cluster.cli.main"]


def tandem(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    # Without what ``ray_environment`` put into this process (an earlier test's ``ensure_ray``):
    # the command must set it for the Ray it starts.
    inherited = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=timeout,
                          env={**inherited, "PYTHONUNBUFFERED": "1", **(env or {})})


def cache_sharing_builds(cache: Path) -> Path:
    """A cluster's own Tandem cache folder (its state file, its log), whose compiled kernels and
    start-up profiles are the test session's. A fresh cache compiles the CPU kernels again
    (22-24 s on this project's 2 cores) and measures the workers' profiles again; shared, only
    the first cluster of a session pays. The session's kernels start as those already built in
    the user's cache (``scripts/bootstrap.sh`` builds them), copied, so a test never writes there.
    Both are keyed as in any user's cache (the source, compiler and CPU; the checkpoint's files
    and settings) and checked at start as there. The session's folder is the pytest base
    temp directory: every test's ``tmp_path`` (and ``mktemp`` folder) is a child of it."""
    shared = cache.parent.parent / "tandem-shared-cache"
    kernels = shared / "kernels"
    if not kernels.is_dir():
        kernels.mkdir(parents=True)
        built = cache_dir() / "kernels"
        for library in built.glob("*.so") if built.is_dir() else ():
            shutil.copy2(library, kernels / library.name)
    cache.mkdir(parents=True, exist_ok=True)
    for name in ("kernels", "step-profiles"):
        (shared / name).mkdir(parents=True, exist_ok=True)
        if not (cache / name).exists():
            (cache / name).symlink_to(shared / name, target_is_directory=True)
    return cache


class Cluster:
    def __init__(self, name: str, topology: dict, tmp: Path, env: dict | None = None):
        self.name, self.env = name, env or {}
        self.path = tmp / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(topology))
        self.cache = cache_sharing_builds(tmp / "cache")
        self.env["TANDEM_CACHE_DIR"] = str(self.cache)
        result = tandem("up", "--topology", str(self.path), "--detach", env=self.env, timeout=600)
        assert result.returncode == 0, result.stderr
        self.state = json.loads((self.cache / "clusters" / f"{name}.json").read_text())
        self.api = self.state["api"]

    def status(self) -> dict:
        result = tandem("status", "--cluster", self.name, "--json", env=self.env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def ray(self, code: str) -> str:
        """Runs Python with Ray connected to the cluster (to kill a worker, say); its stdout."""
        script = (f"import os; os.environ.setdefault('RAY_AUTH_MODE', {self.state['ray_auth_mode']!r}); "
                  "os.environ.setdefault('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', '0'); import ray; "
                  f"ray.init(address={self.state['ray_address']!r}, namespace={self.name!r}); {code}")
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    @contextlib.contextmanager
    def driver(self):
        """A Ray driver of the cluster in a process of its own (Ray, once imported in this
        process, would not join another cluster's auth), answering one Python expression per
        line at once: to watch and kill actors while a stream is running."""
        script = (f"import os, sys, json; os.environ.setdefault('RAY_AUTH_MODE', {self.state['ray_auth_mode']!r}); "
                  "os.environ.setdefault('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', '0'); import ray; "
                  f"ray.init(address={self.state['ray_address']!r}, namespace={self.name!r}, log_to_driver=False, "
                  "logging_level='ERROR'); print('ready', flush=True)\n"
                  "for line in sys.stdin: print(json.dumps(eval(line)), flush=True)")
        process = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
        try:
            assert process.stdout.readline().strip() == "ready"

            def ask(expression: str):
                process.stdin.write(expression + "\n")
                process.stdin.flush()
                return json.loads(process.stdout.readline())

            yield ask
        finally:
            process.stdin.close()
            process.wait(timeout=60)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the cluster's own log, for a failure's message."""
        log = self.cache / "clusters" / f"{self.name}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"

    def down(self) -> None:
        """``tandem down``, which says one line; the cluster's own log gets one line for the stop,
        and nothing of Ray's (no Serve controller's calls failing as it is killed)."""
        log = self.cache / "clusters" / f"{self.name}.log"
        before = log.stat().st_size if log.exists() else 0
        result = tandem("down", "--cluster", self.name, env=self.env)
        assert result.returncode == 0, result.stderr
        assert result.stderr == f"[tandem] cluster {self.name!r} is down\n"
        if log.exists():
            with open(log, errors="replace") as text:
                text.seek(before)
                stop = text.read().splitlines()
            assert stop and stop[-1].startswith(f"[tandem] cluster {self.name!r} stopped in "), stop
            # (lines the cluster logged before the stop may land here too: a test's killed worker, say)
            assert not [line for line in stop if "Task ServeController" in line or "Deleting app" in line], stop


def topology(name: str, model_dir: Path, **overrides) -> dict:
    spec = {"cluster": {"name": name}, "model": {"path": str(model_dir)}, "server": {"port": 0, "http_port": 0},
            "kv": {"num_blocks": 64}, "prefill": {"threads": 1}, "decode": {"threads": 1}}
    for key, value in overrides.items():
        spec.setdefault(key, {}).update(value)
    return spec
