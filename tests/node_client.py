"""Runs the Node.js client (``clients/node/generate.js``) from tests.

Its dependencies are installed once per machine into ``<cache>/node-client/node_modules``
(``cluster.paths.cache_dir()``, ``~/.cache/tandem`` by default) and installed again only when
``clients/node/package.json`` changes; the script finds them through ``NODE_PATH``. Without
``node`` or ``npm`` (or with no way to reach the npm registry for the first install) the calling
test is skipped with the reason.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cluster.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
NODE_CLIENT = ROOT / "clients" / "node"
GENERATE_JS = NODE_CLIENT / "generate.js"
REQUIRED_MODULES = ("@grpc/grpc-js", "@grpc/proto-loader")
_NETWORK_ERRORS = ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ECONNRESET", "ETIMEDOUT", "ENETUNREACH",
                   "network request", "getaddrinfo")

_ready: Path | None = None


def _tools() -> tuple[str, str]:
    node, npm = shutil.which("node"), shutil.which("npm")
    missing = [name for name, path in (("node", node), ("npm", npm)) if path is None]
    if missing:
        pytest.skip(f"the Node.js client needs {' and '.join(missing)} on PATH (install Node.js 18 or newer)")
    return node, npm


def node_client_dir() -> Path:
    """The cache directory holding the Node client's ``node_modules`` (installed when missing or
    when ``clients/node/package.json`` changed since the last install)."""
    global _ready
    _, npm = _tools()
    if _ready is not None:
        return _ready
    target = cache_dir() / "node-client"
    target.mkdir(parents=True, exist_ok=True)
    manifest = (NODE_CLIENT / "package.json").read_bytes()
    digest = hashlib.sha256(manifest).hexdigest()
    stamp = target / ".installed-package-json.sha256"
    with open(target / ".lock", "w") as lock:  # one install at a time across processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        installed = all((target / "node_modules" / m / "package.json").is_file() for m in REQUIRED_MODULES)
        if not (installed and stamp.is_file() and stamp.read_text().strip() == digest):
            stamp.unlink(missing_ok=True)
            (target / "package.json").write_bytes(manifest)
            (target / "package-lock.json").unlink(missing_ok=True)
            try:
                result = subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=target,
                                        capture_output=True, text=True, timeout=600)
            except subprocess.TimeoutExpired:
                pytest.skip(f"npm install in {target} took more than 10 minutes (no access to the npm registry?)")
            if result.returncode != 0:
                output = (result.stdout + result.stderr)[-3000:]
                if any(e in output for e in _NETWORK_ERRORS):
                    pytest.skip(f"npm install in {target} could not reach the npm registry:\n{output}")
                raise RuntimeError(f"npm install in {target} failed ({result.returncode}):\n{output}")
            stamp.write_text(digest + "\n")
    _ready = target
    return target


def run_node_generate(address: str, request: dict, token: str | None = None,
                      timeout_s: float = 60) -> tuple[int, list[dict]]:
    """Runs ``node clients/node/generate.js REQUEST_JSON`` against ``address``; returns its exit
    status and its stdout parsed as one JSON object per line."""
    node, _ = _tools()
    modules = node_client_dir() / "node_modules"
    env = {k: v for k, v in os.environ.items() if k not in ("TANDEM_TOKEN", "TANDEM_TLS_CA")}
    env.update(NODE_PATH=str(modules), TANDEM_ADDR=address)
    if token is not None:
        env["TANDEM_TOKEN"] = token
    result = subprocess.run([node, str(GENERATE_JS), json.dumps(request)], env=env, capture_output=True,
                            text=True, timeout=timeout_s)
    lines = []
    for line in result.stdout.splitlines():
        if not line.strip():
            continue
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"generate.js printed a line that is not JSON: {line!r}\n"
                                 f"stderr:\n{result.stderr}") from None
    if result.returncode not in (0, 2):
        raise AssertionError(f"generate.js exited {result.returncode}\nstdout:\n{result.stdout}\n"
                             f"stderr:\n{result.stderr}")
    return result.returncode, lines
