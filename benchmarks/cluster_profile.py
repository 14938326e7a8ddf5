"""Where a local cluster's processes spend their CPU while a benchmark loads them.

The ingress replica, the decode worker and the prefill worker of a cluster that ``tandem up``
started (found in /proc: Ray names its actor processes ``ray::<class>``, and each of this
cluster's processes has the benchmark's private ``TANDEM_CACHE_DIR`` in its environment) are
sampled by py-spy (``py-spy record --format raw --threads --nonblocking``: collapsed stacks
under each thread's OS id; the process is never paused) while the measured cells run. Each
thread's CPU time is read from /proc at the cell's start and end:

- A thread py-spy sampled has its CPU split over buckets (gRPC/asyncio I/O, codec, router
  placement, registry/Redis, engine step, sampling, ...) by the buckets' shares of its own
  samples, so a thread py-spy takes for busy while it waits in C (Ray's task loop) weighs what
  its CPU weighs. A sample goes to the bucket of the leaf-most frame that belongs to one; the
  standard library's plumbing (asyncio, threading, ...) and torch are transparent, so a Redis
  write through asyncio counts as Redis and a torch call in the sampler as sampling.
- A thread with no sample runs no Python (Ray's core worker, gRPC's C core, gloo): its CPU is
  listed by thread name.

py-spy must be installed (``pip install py-spy``, in the ``bench`` extra) and allowed to read the
processes' memory (same user, or CAP_SYS_PTRACE); otherwise the report says why and is skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_RATE_HZ = 100
STOP_TIMEOUT_S = 30.0
# Process titles Ray gives the actors this report follows.
PROCESSES = {
    "ingress": re.compile(r"^ray::ServeReplica:[^:]+:grpc-ingress"),
    "decode worker": re.compile(r"^ray::DecodeWorker\b"),
    "prefill worker": re.compile(r"^ray::PrefillWorker\b"),
}
OTHER = "other"
IO = "gRPC / asyncio I/O"
ENGINE = "engine step / model forward"
# (bucket, path or function fragments), tried in this order on each frame, leaf first.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("registry / Redis", ("redis/", "/registry/", "registry/", "registry_view", "local_redis")),
    ("router placement", ("router/",)),
    ("tracing / metrics / logging", ("opentelemetry", "prometheus_client", "observability/", "ingress/tracing",
                                     "ray/util/metrics", "logging/")),
    ("msgpack / protobuf / stream codec", ("msgpack", "protocol/", "google/protobuf", "_pb2")),
    ("KV transfer", ("kv_transfer/", "torch/distributed", "gloo")),
    ("detokenize / tokenize", ("tokeniz", "transformers/")),
    ("sampling", ("engine/sampler", "sampling_params")),
    (ENGINE, ("engine/", "model_runner", "/models/", "parallel/")),
    (IO, ("grpc/", "grpc_", "_cygrpc", "aiohttp/")),
    ("ingress / worker request path", ("ingress/", "decode_worker/", "prefill_worker/", "cluster/worker/",
                                       "worker/")),
    ("Ray / Serve runtime", ("ray/",)),
]
# Plumbing that does the work of whoever called it; only when a stack has nothing else does
# its leaf-most frame say which bucket (torch: the engine's; the event loop and sockets: I/O).
TRANSPARENT: list[tuple[str, tuple[str, ...]]] = [
    (ENGINE, ("torch/", "numpy/")),
    (IO, ("asyncio/", "selectors", "socket", "ssl", "uvloop")),
    (OTHER, ("threading", "concurrent/", "queue", "functools", "contextlib", "<frozen", "typing", "dataclasses",
             "enum", "abc", "copy", "weakref", "collections/")),
]


def bucket(stack: list[str]) -> str:
    """The bucket of one sample's stack (root first, as py-spy writes it)."""
    fallback = None
    for frame in reversed(stack):
        for name, fragments in BUCKETS:
            if any(f in frame for f in fragments):
                return name
        if fallback is None:
            fallback = next((name for name, fragments in TRANSPARENT if any(f in frame for f in fragments)), None)
    return fallback or OTHER


def find_py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def cluster_processes(cache: Path) -> dict[str, int]:
    """The pids of this cluster's followed actors (by process title and ``TANDEM_CACHE_DIR``)."""
    marker = f"TANDEM_CACHE_DIR={cache}".encode()
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith("ray::"):
                continue
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        for name, pattern in PROCESSES.items():
            if pattern.match(title) and name not in found:
                found[name] = int(entry.name)
    return found


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread's name and CPU seconds (user + system) so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    threads = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        threads[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / ticks)
    return threads


def native_group(thread_name: str) -> str:
    """Native threads named alike (``client.poll0``, ``client.poll1``) counted together."""
    return re.sub(r"\d+$", "", thread_name) or thread_name


THREAD = re.compile(r"^thread \((\d+)\)")  # py-spy --threads: the OS thread id, then the name


@dataclass
class Profile:
    """One process over some cells: its CPU seconds by bucket (each thread's CPU split over
    the buckets of its own samples), by thread name for the threads py-spy has no sample of
    (native ones), and by leaf frame; the samples themselves."""

    bucket_s: Counter = field(default_factory=Counter)
    unsampled_s: Counter = field(default_factory=Counter)  # by thread name
    frame_s: Counter = field(default_factory=Counter)  # by leaf frame
    stacks: Counter = field(default_factory=Counter)  # collapsed stack (thread first) -> samples
    requests: int = 0
    tokens: int = 0

    @property
    def cpu_s(self) -> float:
        return sum(self.bucket_s.values()) + sum(self.unsampled_s.values())

    def add_cell(self, cpu: dict[int, tuple[str, float]], stacks: Counter) -> None:
        """One cell: each thread's CPU seconds (by OS thread id) and py-spy's samples."""
        by_thread: dict[int, Counter] = {}
        for stack, count in stacks.items():
            first, _, rest = stack.partition(";")
            match = THREAD.match(first)
            if match and rest:
                by_thread.setdefault(int(match.group(1)), Counter())[rest] += count
        for tid, (name, seconds) in cpu.items():
            samples = by_thread.get(tid)
            if not samples:
                self.unsampled_s[native_group(name)] += seconds
                continue
            total = sum(samples.values())
            for stack, count in samples.items():
                frames = stack.split(";")
                self.bucket_s[bucket(frames)] += seconds * count / total
                self.frame_s[frames[-1]] += seconds * count / total
        self.stacks.update(stacks)


def read_collapsed(path: Path) -> Counter:
    stacks = Counter()
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return stacks
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[stack] += int(count)
    return stacks


class ClusterProfiler:
    """Profiles the cluster's followed processes over cells; ``cell(label, requests, tokens)``
    wraps each one. ``profiles[process][label]`` adds up the cells of one label."""

    def __init__(self, cache: Path, scratch: Path):
        self.py_spy = find_py_spy()
        self.pids = cluster_processes(cache)
        self.scratch = scratch
        self.profiles: dict[str, dict[str, Profile]] = {name: {} for name in self.pids}
        self.problem = (None if self.py_spy and self.pids else
                        "py-spy is not installed (pip install py-spy; it is in the bench extra)" if not self.py_spy
                        else "none of the cluster's actor processes was found in /proc")
        self._cells = 0

    def cell(self, label: str) -> "_Cell":
        self._cells += 1
        return _Cell(self, label, self._cells)

    def report_problem(self, problem: str) -> None:
        if not self.problem:
            self.problem = problem
            print(f"\n[bench] profile: {problem}", file=sys.stderr, flush=True)


class _Cell:
    def __init__(self, profiler: ClusterProfiler, label: str, index: int):
        self.profiler, self.label, self.index = profiler, label, index
        self.requests = self.tokens = 0  # set by the caller before the cell ends

    def __enter__(self) -> "_Cell":
        p = self.profiler
        self._spies: dict[str, tuple[subprocess.Popen, Path]] = {}
        self._before = {name: thread_cpu(pid) for name, pid in p.pids.items()}
        if p.problem:
            return self
        p.scratch.mkdir(parents=True, exist_ok=True)
        for name, pid in p.pids.items():
            out = p.scratch / f"{name.replace(' ', '_')}-{self.index}.txt"
            with open(out.with_suffix(".log"), "w") as log:  # not a pipe: nobody reads it while it runs
                spy = subprocess.Popen([p.py_spy, "record", "--format", "raw", "--threads", "--nonblocking", "--rate",
                                        str(SAMPLE_RATE_HZ), "--pid", str(pid), "--output", str(out)],
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self._spies[name] = (spy, out)
        return self

    def __exit__(self, *exc) -> None:
        p = self.profiler
        for name, (spy, _) in self._spies.items():
            if spy.poll() is None:
                spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled, then exits
        spent = {}
        for name, pid in p.pids.items():
            before = self._before[name]
            spent[name] = {tid: (thread, seconds - before.get(tid, (thread, 0.0))[1])
                           for tid, (thread, seconds) in thread_cpu(pid).items()}
        samples = {}
        for name, (spy, out) in self._spies.items():
            try:
                spy.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
            stacks = read_collapsed(out)
            if not stacks:
                log = out.with_suffix(".log").read_text(errors="replace").strip().splitlines()
                p.report_problem(f"py-spy recorded nothing from the {name} (pid {p.pids[name]}): "
                                 + (log[0][:300] if log else "no output"))
            samples[name] = stacks
        for name in p.pids:
            profile = p.profiles[name].setdefault(self.label, Profile())
            profile.add_cell(spent[name], samples.get(name, Counter()))
            profile.requests += self.requests
            profile.tokens += self.tokens


# -- the report ---------------------------------------------------------------------------------

def write_profiles(profiler: ClusterProfiler, folder: Path, prefix: str) -> list[Path]:
    """One collapsed-stack file per process and label (flamegraph.pl or speedscope read them)."""
    written = []
    folder.mkdir(parents=True, exist_ok=True)
    for name, labels in profiler.profiles.items():
        for label, profile in labels.items():
            path = folder / f"{prefix}_{name.replace(' ', '_')}_{label}.txt"
            path.write_text("".join(f"{stack} {count}\n" for stack, count in profile.stacks.most_common()))
            written.append(path)
    return written


def bucket_rows(labels: dict[str, Profile], native_shown: int = 4) -> list[tuple]:
    """Rows: each bucket, the busiest native threads, the rest of them, the total; per label,
    CPU ms per request, ms per output token and the share of the process's CPU."""
    totals = Counter()
    natives = Counter()
    for p in labels.values():
        totals.update(p.bucket_s)
        natives.update(p.unsampled_s)
    order = [name for name, seconds in totals.most_common() if seconds > 0]
    shown = [n for n, seconds in natives.most_common(native_shown) if seconds > 0]

    def cells(label: str, seconds: float) -> tuple:
        p = labels[label]
        return (f"{seconds * 1e3 / p.requests:.2f}" if p.requests else "-",
                f"{seconds * 1e3 / p.tokens:.3f}" if p.tokens else "-",
                f"{seconds / p.cpu_s:.0%}" if p.cpu_s else "-")

    rows = []
    for name in order:
        rows.append((name, *(c for label in labels for c in cells(label, labels[label].bucket_s[name]))))
    for thread in shown:
        rows.append((f"unsampled thread {thread}", *(c for label in labels for c in
                                                     cells(label, labels[label].unsampled_s[thread]))))
    rest = {label: sum(s for t, s in p.unsampled_s.items() if t not in shown) for label, p in labels.items()}
    if any(rest.values()):
        rows.append(("other unsampled threads", *(c for label in labels for c in cells(label, rest[label]))))
    rows.append(("total (process CPU)", *(c for label in labels for c in cells(label, labels[label].cpu_s))))
    return rows


def bucket_headers(labels: dict[str, Profile]) -> tuple:
    return ("where", *(h for label in labels for h in (f"{label}: ms/request", "ms/token", "share")))


def self_frame_rows(labels: dict[str, Profile], top: int = 8) -> list[tuple]:
    """The leaf frames that took the most CPU (every label together), with their bucket as
    their whole stack gave it."""
    frames, buckets = Counter(), {}
    for p in labels.values():
        frames.update(p.frame_s)
        for stack in p.stacks:
            buckets.setdefault(stack.rsplit(";", 1)[-1], bucket(stack.split(";")[1:]))
    total = sum(p.cpu_s for p in labels.values())
    return [(frame[:110], buckets.get(frame, "?"), f"{s / total:.1%}" if total else "-")
            for frame, s in frames.most_common(top) if s > 0]


def summary(profiler: ClusterProfiler) -> dict:
    """The profile's numbers for the JSON report."""
    return {name: {label: {"requests": p.requests, "tokens": p.tokens, "cpu_s": p.cpu_s,
                           "samples": sum(p.stacks.values()), "buckets_cpu_s": dict(p.bucket_s.most_common()),
                           "unsampled_threads_cpu_s": dict(p.unsampled_s.most_common())}
                   for label, p in labels.items()}
            for name, labels in profiler.profiles.items()}
