"""A benchmark's own cluster: ``tandem up --detach`` from a topology mapping in a private cache
folder, ``tandem down`` at the end, also when the run is interrupted or fails.

``tandem up --detach`` runs in its own session, so a Ctrl-C meant for the benchmark does not
cut it off half-way (its background cluster would then come up with nobody to stop it): on an
interruption the benchmark waits for it to finish starting, then stops the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

TANDEM = [str(Path(sys.executable).parent / "tandem")]
START_TIMEOUT_S = 900


class ClusterStartError(RuntimeError):
    pass


def free_port() -> int:
    from cluster.runtime.ports import free_port as free

    return free("127.0.0.1")


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt, so ``finally`` blocks stop what the benchmark started."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


class LocalCluster:
    def __init__(self, name: str, topology: dict, cache: Path | None = None):
        self.name = name
        self._own_cache = cache is None  # a private cache made here goes when the cluster stops well
        self.cache = cache or Path(tempfile.mkdtemp(prefix=f"tandem-{name}-"))
        self.env = {**os.environ, "TANDEM_CACHE_DIR": str(self.cache)}
        self.topology = {**topology, "cluster": {"name": name}}
        self.api: str | None = None
        self.http: str | None = None  # the OpenAI-compatible API's base (``.../v1``), if the topology serves it
        self._starting: subprocess.Popen | None = None

    def start(self) -> str:
        """Starts the cluster; returns the API's address."""
        path = self.cache / f"{self.name}.yaml"
        path.write_text(json.dumps(self.topology))
        print(f"[bench] starting the cluster {self.name} (tandem up --detach)", file=sys.stderr, flush=True)
        self._starting = subprocess.Popen([*TANDEM, "up", "--topology", str(path), "--detach"], env=self.env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True)
        _, err = self._starting.communicate(timeout=START_TIMEOUT_S)
        if self._starting.returncode != 0:
            raise ClusterStartError(f"tandem up failed: {err.strip()[-2000:]}")
        state = json.loads((self.cache / "clusters" / f"{self.name}.json").read_text())
        self.api, self.http = state["api"], state.get("http")
        return self.api

    def stop(self) -> None:
        if self._starting is not None and self._starting.poll() is None:
            print("\n[bench] waiting for the cluster to finish starting, to stop it", file=sys.stderr, flush=True)
            try:
                self._starting.wait(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._starting.terminate()
        print(f"[bench] stopping the cluster {self.name} (tandem down)", file=sys.stderr, flush=True)
        subprocess.run([*TANDEM, "down", "--cluster", self.name], env=self.env, capture_output=True, timeout=300)

    def status(self) -> dict | None:
        """``tandem status --json`` of the running cluster (None if it does not answer)."""
        result = subprocess.run([*TANDEM, "status", "--cluster", self.name, "--json"], env=self.env,
                                capture_output=True, text=True, timeout=120)
        try:
            return json.loads(result.stdout) if result.returncode == 0 else None
        except ValueError:
            return None

    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            print(f"[bench] the cluster's logs stay in {self.cache / 'clusters'}", file=sys.stderr, flush=True)
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.stop()
        if self._own_cache and exc_type is None:
            shutil.rmtree(self.cache, ignore_errors=True)
