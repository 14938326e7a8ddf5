"""Tandem's quick-start cluster against llama.cpp's ``llama-server`` on the same quantized GGUF
file and the same CPU cores, through the same OpenAI-compatible HTTP API, side by side in one run.

llama.cpp is what a user with a GGUF file and a CPU would run instead of Tandem, so it is the
bar a quantized CPU path has to clear. Both servers load the default model (SmolLM2-135M-Instruct,
Q4_1, ``cluster/default_model``) from the same file; they run one at a time, never together,
each stopped before the other starts, in ``--rounds`` rounds (default 2): each round starts and
measures both, the first server of a round being the second of the round before (Tandem first in
the first round unless ``--first llama.cpp``). This machine's speed drifts by 10-15% from minute
to minute, so one server measured after the other is measured at another speed; with the order
reversed each round (A B, B A), a drift that holds through the run weighs on both alike. Figures
are given per round, and pooled over the rounds (medians over every request of every round; the
aggregate: every token over every round's seconds) for the goals.

- Tandem: ``tandem up --detach`` of the quick-start topology (the embedded default: 1 prefill +
  1 decode worker, each with the torch threads a worker takes by default, a private Redis), in a
  private cache folder, on free ports; only the model path is given, so the cached file is used.
  The folder starts as the quick start's first run finds the user's: no step profile yet, the
  native kernels compiled (by ``scripts/bootstrap.sh``). Later rounds start it on the same folder
  (its step profiles kept; with one round, it is started once more for that start-up alone), and
  both start-ups are reported.
- llama.cpp: ``llama-server`` on 127.0.0.1 with ``--threads`` the usable cores, as many slots
  as the most concurrent streams and a context of ``--parallel`` x (``max_tokens`` + 64).

The workload is the same for both: a story prompt of about 20 tokens, greedy, ``ignore_eos`` so
that every request produces exactly ``--max-tokens`` tokens, streamed from ``/v1/completions``
(``stream: true``, usage in the last chunk; httpx, a connection per request). A warm-up request
first, then for each concurrency level c (closed loop: c streams, each sending its next request
when the last one ended) ``--requests-per-stream`` x c requests (at least 10 at one stream: the
goals compare its medians, and a median of 3 swung by 2x between runs). Both servers keep a prefix
cache, and every request has the same prompt, so both serve it from their cache after the first.

Reported per server and level, at the client: TTFT p50 (to the first chunk with text), the
per-stream decode rate (tokens after the first over the time after the first, median over
requests) and the aggregate rate (every token over the level's wall time); then Tandem over
llama.cpp against the goals: one stream >= 1.0x llama.cpp's tokens/s, 32 streams >= 1.2x its
aggregate tokens/s, TTFT p50 <= its. And each server's start-up: ``tandem up`` launched to the
OpenAI API answering, first and again; ``llama-server`` launched to ``/health`` answering (for
reference).

``llama-server`` is ``--llama-server PATH``, else ``<tandem cache>/peers/llama-server/bin/``;
``--build-llama-server`` builds it there first if it is missing (the llama.cpp that the
``llama-cpp-python`` source package vendors: about 20 minutes on 2 cores). Without one, only
Tandem's side runs. Every request and start-up has a timeout, so the run stops by itself; the
servers are stopped at the end, also on Ctrl-C, SIGTERM or an error.

    .venv/bin/python benchmarks/quantized.py                      # 1, 8 and 32 streams, 128 tokens
    .venv/bin/python benchmarks/quantized.py --build-llama-server  # first build llama-server
    .venv/bin/python benchmarks/quantized.py --concurrency 1,2 --max-tokens 16 --requests-per-stream 1  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx

from common import machine_rows, median, num_cores, positive_ints, print_table
from local_cluster import LocalCluster, free_port, stop_on_sigterm

PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived a"
PROMPT_ROOM = 64  # context per llama-server slot beyond max_tokens: the prompt, with room to spare
CLUSTER = "bench-quantized"
TANDEM, LLAMA_CPP = "Tandem", "llama.cpp"
STARTUP_SPANS = {TANDEM: "tandem up launched to the OpenAI API answering",
                 LLAMA_CPP: "llama-server launched to /health answering"}
STARTS = ("first start: its step profiles measured", "started again: the profiles kept")
START_TIMEOUT_S = 600
CONNECT_TIMEOUT_S = 10
STOP_TIMEOUT_S = 30
BUILD_TIMEOUT_S = 3 * 3600
DOWNLOAD_TIMEOUT_S = 900
GOAL_ONE_STREAM = 1.0  # Tandem's per-stream tokens/s over llama.cpp's, one stream
GOAL_AGGREGATE = 1.2  # ... aggregate tokens/s, 32 streams
GOAL_AGGREGATE_STREAMS = 32
GOAL_TTFT = 1.0  # ... TTFT p50, at most
MIN_SINGLE_STREAM_REQUESTS = 10


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- the client -------------------------------------------------------------------------------

@dataclass
class Reply:
    """One streamed request as the client saw it."""
    ok: bool
    ttft_s: float = float("nan")  # sent to the first chunk with text
    decode_s: float = float("nan")  # that chunk to the last chunk with text
    tokens: int = 0
    prompt_tokens: int = 0

    @property
    def decode_rate(self) -> float:
        """Tokens after the first over the time after the first."""
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else float("nan")


@dataclass
class Level:
    concurrency: int
    seconds: float
    replies: list[Reply]

    @property
    def done(self) -> list[Reply]:
        return [r for r in self.replies if r.ok]

    @property
    def failed(self) -> int:
        return len(self.replies) - len(self.done)

    @property
    def ttft_p50(self) -> float:
        return median(r.ttft_s for r in self.done)

    @property
    def decode_rate(self) -> float:
        return median(r.decode_rate for r in self.done)

    @property
    def aggregate_rate(self) -> float:
        return sum(r.tokens for r in self.done) / self.seconds


@dataclass
class ServerRun:
    name: str
    startup_s: float
    threads: str
    levels: list[Level] = field(default_factory=list)
    placements: str = ""  # Tandem: where its router placed the requests (local or remote prefill)
    restart_s: float | None = None  # Tandem: started again on the same cache (its step profiles kept)
    round: int = 1

    def level(self, concurrency: int) -> Level:
        return next(x for x in self.levels if x.concurrency == concurrency)


def pooled(runs: list[ServerRun]) -> ServerRun:
    """One server's rounds as one run: each level's requests of every round together (their
    medians), and its seconds summed (the aggregate: every token over every round's seconds)."""
    first = runs[0]
    levels = [Level(level.concurrency, sum(run.level(level.concurrency).seconds for run in runs),
                    [reply for run in runs for reply in run.level(level.concurrency).replies])
              for level in first.levels]
    return ServerRun(first.name, first.startup_s, first.threads, levels, first.placements, first.restart_s, 0)


def completion_body(model: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, base: str, body: dict, timeout_s: float) -> Reply:
    """Sends one request and reads its stream to the end (at most ``timeout_s``)."""
    try:
        return await asyncio.wait_for(read_stream(client, base, body), timeout_s)
    except (httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
        print(f"\n[bench] request failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        return Reply(False)


async def read_stream(client: httpx.AsyncClient, base: str, body: dict) -> Reply:
    sent = time.perf_counter()
    first = last = None
    reply = Reply(True)
    async with client.stream("POST", f"{base}/completions", json=body) as response:
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                reply.tokens = chunk["usage"]["completion_tokens"]
                reply.prompt_tokens = chunk["usage"]["prompt_tokens"]
    if first is None or not reply.tokens:
        raise ValueError("the stream ended without text or without usage")
    reply.ttft_s, reply.decode_s = first - sent, last - first
    return reply


async def run_level(client: httpx.AsyncClient, base: str, body: dict | list[dict], concurrency: int, requests: int,
                    label: str, timeout_s: float) -> Level:
    """``concurrency`` streams, each sending its next request when the last one ended, until
    ``requests`` were sent; a list of bodies is sent in turn."""
    bodies = body if isinstance(body, list) else [body]
    replies: list[Reply] = []
    sent = 0
    started = time.perf_counter()

    def progress() -> None:
        print(f"\r[bench] {label}: {len(replies)}/{requests} requests, {time.perf_counter() - started:.0f}s   ",
              end="", file=sys.stderr, flush=True)

    async def stream() -> None:
        nonlocal sent
        while sent < requests:
            sent += 1
            replies.append(await one_request(client, base, bodies[sent % len(bodies)], timeout_s))

    async def report() -> None:
        while True:
            await asyncio.sleep(2)
            progress()

    reporter = asyncio.create_task(report())
    try:
        await asyncio.gather(*(stream() for _ in range(concurrency)))
    finally:
        reporter.cancel()
    seconds = time.perf_counter() - started
    progress()
    print(file=sys.stderr)
    return Level(concurrency, seconds, replies)


async def measure(run: ServerRun, base: str, args) -> None:
    """A warm-up request, then every concurrency level, into ``run.levels``."""
    timeout = httpx.Timeout(args.request_timeout, connect=CONNECT_TIMEOUT_S)
    # A connection per request: llama-server sometimes closes a kept-alive connection after a
    # streamed response, and the next request sent on it fails ("Server disconnected without
    # sending a response": 5 of 20 in a row); a loopback connect costs both servers alike.
    limits = httpx.Limits(max_connections=max(args.concurrency), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        models = await client.get(f"{base}/models")
        body = completion_body(models.raise_for_status().json()["data"][0]["id"], args.max_tokens)
        log(f"{run.name}: warm-up request")
        warm = await one_request(client, base, body, args.request_timeout)
        if not warm.ok:
            raise RuntimeError(f"{run.name}: the warm-up request failed")
        for concurrency in args.concurrency:
            requests = max(MIN_SINGLE_STREAM_REQUESTS if concurrency == 1 else 1, args.requests_per_stream * concurrency)
            run.levels.append(await run_level(client, base, body, concurrency, requests,
                                              f"{run.name}, {concurrency} streams", args.request_timeout))


def wait_until_answering(url: str, deadline: float, alive=lambda: True) -> None:
    """Polls ``url`` until it answers 200 (or the deadline passes, or ``alive()`` turns false)."""
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url, timeout=CONNECT_TIMEOUT_S).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer" + ("" if alive() else " (the server exited)"))


# -- Tandem ---------------------------------------------------------------------------------

def tandem_topology(model: Path, cpu_matmul_dtype: str = "auto") -> dict:
    """The quick-start topology (the embedded default), with the cached model and free ports
    (and ``model.cpu_matmul_dtype`` when not the default)."""
    spec = {"model": {"path": str(model)}, "server": {"port": free_port(), "http_port": 0}}
    if cpu_matmul_dtype != "auto":
        spec["model"]["cpu_matmul_dtype"] = cpu_matmul_dtype
    return spec


def tandem_threads() -> str:
    from cluster.parallel.tp_runner import threads_per_rank

    return f"1 prefill + 1 decode worker, {threads_per_rank(1)} torch threads each (topology threads: null)"


@contextmanager
def tandem_server(model: Path, cache: Path, name: str = CLUSTER, placed: dict | None = None,
                  cpu_matmul_dtype: str = "auto") -> Iterator[tuple[str, float]]:
    """The cluster's OpenAI API base and its start-up seconds (launch to the API answering);
    at the end, before the cluster stops, its router's placement counts into ``placed``.
    ``cache``: its Tandem cache folder (kept: a second start there finds its step profiles)."""
    launched = time.monotonic()
    with LocalCluster(name, tandem_topology(model, cpu_matmul_dtype), cache=cache) as cluster:
        if not cluster.http:
            raise RuntimeError("the cluster serves no OpenAI HTTP API")
        wait_until_answering(f"{cluster.http}/models", launched + START_TIMEOUT_S)
        yield cluster.http, time.monotonic() - launched
        if placed is not None:
            router = (cluster.status() or {}).get("router") or {}
            placed.update(placed=router.get("placed"), local=router.get("local_prefills"))


def tandem_cache() -> Path:
    """A private Tandem cache as the quick start's first start finds it: no step profile yet, and
    the native kernels that ``scripts/bootstrap.sh`` compiled (linked from the user's cache, where
    they are compiled now if they are not yet)."""
    from cluster.engine.kernels.prebuild import main as prebuild
    from cluster.paths import cache_dir

    prebuild()
    cache = Path(tempfile.mkdtemp(prefix=f"tandem-{CLUSTER}-"))
    if (cache_dir() / "kernels").is_dir():
        (cache / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
    return cache


def restart_seconds(model: Path, cache: Path, cpu_matmul_dtype: str) -> float:
    """Tandem started once more on ``cache`` (its step profiles kept), to the API answering."""
    with tandem_server(model, cache, cpu_matmul_dtype=cpu_matmul_dtype) as (_, seconds):
        return seconds


def placements_line(placed: dict) -> str:
    """Where the router placed the requests: a short prompt's TTFT depends on it (a remote
    prefill pays the decode worker's call to the prefill worker)."""
    if placed.get("placed") is None:
        return "? (tandem status did not answer)"
    return f"{placed['local']} of {placed['placed']} prefilled on the decode worker, the rest on the prefill worker"


# -- llama.cpp ------------------------------------------------------------------------------

def default_llama_server() -> Path:
    from cluster.paths import cache_dir

    return cache_dir() / "peers" / "llama-server" / "bin" / "llama-server"


def find_llama_server(args) -> Path | None:
    """``--llama-server``, else the cached build (built first with ``--build-llama-server``)."""
    if args.llama_server:
        if not args.llama_server.is_file():
            raise SystemExit(f"--llama-server: no such file: {args.llama_server}")
        return args.llama_server
    binary = default_llama_server()
    if binary.is_file():
        return binary
    if args.build_llama_server:
        return build_llama_server(binary.parent)
    return None


def build_step(command: list[str], cwd: Path, timeout_s: float) -> None:
    """Runs one build command, its output going to our stderr as progress."""
    result = subprocess.run(command, cwd=cwd, stdout=sys.stderr, stderr=sys.stderr, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(f"building llama-server: `{' '.join(command)}` exited with {result.returncode}")


def build_llama_server(bin_dir: Path) -> Path:
    """Builds ``llama-server`` from the llama.cpp that the ``llama-cpp-python`` source package
    vendors; copies its ``build/bin`` (the binary and its shared libraries) to ``bin_dir``."""
    with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
        work = Path(tmp)
        log("building llama-server (about 20 minutes on 2 cores): downloading the llama-cpp-python source")
        build_step([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                    "--disable-pip-version-check", "-d", str(work), "llama-cpp-python"], work, DOWNLOAD_TIMEOUT_S)
        sdist = next(work.glob("*.tar.gz"))
        log(f"unpacking {sdist.name}")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = next(work.glob("*/vendor/llama.cpp"))
        log("configuring llama.cpp (cmake)")
        build_step(["cmake", "-B", "build", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF",
                    "-DCMAKE_BUILD_TYPE=Release"], source, BUILD_TIMEOUT_S)
        log(f"compiling llama-server with {num_cores()} jobs")
        build_step(["cmake", "--build", "build", "--target", "llama-server", f"-j{num_cores()}"], source,
                   BUILD_TIMEOUT_S)
        partial = bin_dir.with_name(f".{bin_dir.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source / "build" / "bin", partial, symlinks=True)
        shutil.rmtree(bin_dir, ignore_errors=True)
        os.replace(partial, bin_dir)
    log(f"llama-server built into {bin_dir}")
    return bin_dir / "llama-server"


def llama_server_command(binary: Path, model: Path, port: int, threads: int, slots: int, max_tokens: int) -> list[str]:
    return [str(binary), "--host", "127.0.0.1", "--port", str(port), "--threads", str(threads),
            "--parallel", str(slots), "--ctx-size", str(slots * (max_tokens + PROMPT_ROOM)), "--model", str(model),
            "--no-webui"]


@contextmanager
def llama_server(binary: Path, model: Path, threads: int, slots: int, max_tokens: int
                 ) -> Iterator[tuple[str, float]]:
    """``llama-server``'s OpenAI API base and its load seconds (launch to ``/health`` answering).
    Its shared libraries are looked for beside it (a build's RUNPATH names its build folder)."""
    port = free_port()
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(binary.parent),
                                                                           os.environ.get("LD_LIBRARY_PATH")]))}
    with tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log") as server_log:
        log(f"starting llama-server ({binary})")
        launched = time.monotonic()
        process = subprocess.Popen(llama_server_command(binary, model, port, threads, slots, max_tokens), env=env,
                                   stdout=server_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            try:
                wait_until_answering(f"http://127.0.0.1:{port}/health", launched + START_TIMEOUT_S,
                                     alive=lambda: process.poll() is None)
            except RuntimeError as exc:
                tail = "\n".join(Path(server_log.name).read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"llama-server did not start: {exc}; its log ends:\n{tail}") from None
            yield f"http://127.0.0.1:{port}/v1", time.monotonic() - launched
        finally:
            log("stopping llama-server")
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# -- the report -------------------------------------------------------------------------------

def round_name(run: ServerRun) -> str:
    return "pooled" if run.round == 0 else str(run.round)


def level_rows(runs: list[ServerRun]) -> list[tuple]:
    return [(run.name, round_name(run), level.concurrency, len(level.done), level.failed, f"{level.seconds:.1f}",
             f"{level.ttft_p50 * 1e3:.1f}", f"{level.decode_rate:.1f}", f"{level.aggregate_rate:.1f}")
            for run in runs for level in run.levels]


def ratio_rows(tandem: ServerRun, llama: ServerRun) -> list[tuple]:
    rows = []
    for ours, theirs in zip(tandem.levels, llama.levels):
        rows.append((round_name(tandem), ours.concurrency, f"{ours.ttft_p50 / theirs.ttft_p50:.2f}x",
                     f"{ours.decode_rate / theirs.decode_rate:.2f}x",
                     f"{ours.aggregate_rate / theirs.aggregate_rate:.2f}x"))
    return rows


def verdict(ratio: float, goal: float, at_least: bool) -> str:
    met = ratio >= goal if at_least else ratio <= goal
    return f"{ratio:.2f}x (goal {'>=' if at_least else '<='} {goal:.1f}x): " + ("met" if met else "NOT met")


def goal_lines(tandem: ServerRun, llama: ServerRun) -> list[str]:
    """The goals: one stream's at the lowest level run, 32 streams' at 32 (else the highest level
    run), TTFT's at every level (the worst ratio)."""
    lowest = min(x.concurrency for x in tandem.levels)
    highest = max(x.concurrency for x in tandem.levels)
    aggregate_at = GOAL_AGGREGATE_STREAMS if any(x.concurrency == GOAL_AGGREGATE_STREAMS for x in tandem.levels) \
        else highest
    ttft = max(ours.ttft_p50 / theirs.ttft_p50 for ours, theirs in zip(tandem.levels, llama.levels))
    return [
        f"per-stream decode tokens/s at {lowest} stream(s), Tandem / llama.cpp: "
        + verdict(tandem.level(lowest).decode_rate / llama.level(lowest).decode_rate, GOAL_ONE_STREAM, True),
        f"aggregate tokens/s at {aggregate_at} streams (the goal's level: {GOAL_AGGREGATE_STREAMS}), "
        "Tandem / llama.cpp: "
        + verdict(tandem.level(aggregate_at).aggregate_rate / llama.level(aggregate_at).aggregate_rate,
                  GOAL_AGGREGATE, True),
        "TTFT p50, Tandem / llama.cpp, worst level: " + verdict(ttft, GOAL_TTFT, False),
    ]


def startup_rows(runs: list[ServerRun]) -> list[tuple[str, str, str, str]]:
    """Each server's start-up in each round; Tandem's on one cache: first (its step profiles
    measured, the quick start's first run after ``scripts/bootstrap.sh``), then again (the
    profiles kept: a later round's start, or with one round a start for that alone)."""
    rows = []
    for run in runs:
        if run.name != TANDEM:
            rows.append((run.name, round_name(run), f"{run.startup_s:.1f}", STARTUP_SPANS[run.name]))
            continue
        rows.append((run.name, round_name(run), f"{run.startup_s:.1f}",
                     f"{STARTUP_SPANS[run.name]} ({STARTS[0] if run.round == 1 else STARTS[1]})"))
        if run.restart_s is not None:
            rows.append((run.name, "after 1", f"{run.restart_s:.1f}", f"{STARTUP_SPANS[run.name]} ({STARTS[1]})"))
    return rows


def report(runs: list[ServerRun], model: Path, args, llama_note: str) -> None:
    firsts = [run for run in runs if run.round == 1]
    prompt_tokens = ", ".join(f"{run.name} {run.levels[0].done[0].prompt_tokens}" for run in firsts
                              if run.levels[0].done)
    rows = machine_rows() + [
        ("model file", f"{model} ({model.stat().st_size / 2**20:.0f} MiB)"),
        ("Tandem's cpu_matmul_dtype", args.cpu_matmul_dtype),
        *((f"threads, {run.name}", run.threads) for run in firsts),
        ("workload", f"prompt tokens: {prompt_tokens or '?'}; {args.max_tokens} tokens out (greedy, ignore_eos), "
                     "streamed /v1/completions"),
        *((f"placements, {run.name}, round {run.round}", run.placements) for run in runs if run.placements),
    ]
    print_table("machine", rows)
    print_table("start-up", startup_rows(runs), ("server", "round", "seconds", "from ... to ..."))
    names = sorted({run.name for run in runs}, key=lambda name: name != TANDEM)
    rounds = {name: [run for run in runs if run.name == name] for name in names}
    together = {name: pooled(rounds[name]) if len(rounds[name]) > 1 else rounds[name][0] for name in names}
    shown = runs + [together[name] for name in names if len(rounds[name]) > 1]
    print_table(f"per server, round and level (closed loop; {args.requests_per_stream} requests per stream, "
                f"at least {MIN_SINGLE_STREAM_REQUESTS} at one; rates in tokens/s at the client)", level_rows(shown),
                ("server", "round", "streams", "requests", "failed", "seconds", "TTFT p50 ms",
                 "per-stream decode tok/s", "aggregate tok/s"))
    if LLAMA_CPP not in rounds:
        print(f"\n{llama_note}")
        return
    pairs = list(zip(rounds[TANDEM], rounds[LLAMA_CPP]))
    if len(pairs) > 1:
        pairs.append((together[TANDEM], together[LLAMA_CPP]))
    print_table("Tandem / llama.cpp (TTFT: lower is better; rates: higher is better)",
                [row for tandem, llama in pairs for row in ratio_rows(tandem, llama)],
                ("round", "streams", "TTFT p50", "per-stream decode tok/s", "aggregate tok/s"))
    print(f"\ngoals{' (pooled over the rounds)' if len(rounds[TANDEM]) > 1 else ''}:\n"
          + "\n".join(goal_lines(together[TANDEM], together[LLAMA_CPP])))


def run_server(name: str, server, threads: str, args, placed: dict | None = None, round_: int = 1) -> ServerRun:
    with server as (base, startup_s):
        log(f"{name} answering at {base} after {startup_s:.1f}s (round {round_})")
        run = ServerRun(name, startup_s, threads, round=round_)
        asyncio.run(measure(run, base, args))
    if placed is not None:
        run.placements = placements_line(placed)
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=positive_ints, default=[1, 8, 32],
                        help="concurrent streams per level, comma-separated (default 1,8,32)")
    parser.add_argument("--requests-per-stream", type=int, default=2,
                        help=f"requests per level: this x its streams (at least {MIN_SINGLE_STREAM_REQUESTS} at one stream)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens out of every request")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--llama-server", type=Path,
                        help="the llama-server binary (default: <tandem cache>/peers/llama-server/bin/llama-server)")
    parser.add_argument("--build-llama-server", action="store_true",
                        help="build llama-server into the tandem cache if it is not there (about 20 minutes on 2 "
                             "cores)")
    parser.add_argument("--llama-threads", type=int, default=num_cores(),
                        help="llama-server's --threads (default: the usable cores)")
    parser.add_argument("--first", choices=[TANDEM, LLAMA_CPP], default=TANDEM,
                        help="which server runs first (in the first round; each round after reverses the order)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds, each starting and measuring both servers, in reversed order each round "
                             "(default 2)")
    parser.add_argument("--cpu-matmul-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="Tandem's model.cpu_matmul_dtype (default auto, the quick start's)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    stop_on_sigterm()

    from cluster.default_model import default_model_path

    model = default_model_path()
    binary = find_llama_server(args)
    llama_note = (f"llama.cpp skipped: no llama-server at {default_llama_server()}; give --llama-server PATH, or add "
                  "--build-llama-server to build it there (about 20 minutes on 2 cores)")
    slots = max(args.concurrency)
    placed: dict = {}
    cache = tandem_cache()

    def run_tandem(round_: int) -> ServerRun:
        placed.clear()
        run = run_server(TANDEM, tandem_server(model, cache, placed=placed, cpu_matmul_dtype=args.cpu_matmul_dtype),
                         tandem_threads(), args, placed, round_)
        if args.rounds == 1:
            log("Tandem: started again on the same cache, for its start-up with the step profiles kept")
            run.restart_s = restart_seconds(model, cache, args.cpu_matmul_dtype)
        return run

    servers = {TANDEM: run_tandem}
    if binary:
        servers[LLAMA_CPP] = lambda round_: run_server(
            LLAMA_CPP, llama_server(binary, model, args.llama_threads, slots, args.max_tokens),
            f"--threads {args.llama_threads} (--threads-batch the same), --parallel {slots}", args, round_=round_)
    else:
        log(llama_note)
    order = sorted(servers, key=lambda name: name != args.first)
    runs = []
    try:
        for round_ in range(1, args.rounds + 1):
            runs += [servers[name](round_) for name in (order if round_ % 2 else order[::-1])]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    report(sorted(runs, key=lambda run: (run.name != TANDEM, run.round)), model, args, llama_note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
