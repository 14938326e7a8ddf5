"""What the benchmarks share: the machine's description, a small seeded checkpoint, a memory
bandwidth measure and plain-text tables.

Every benchmark compares side by side in one run and reports ratios (DESIGN.md, "Measures that
matter"): on a shared CPU an absolute time means little, a ratio measured in one run does.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

# About 30M parameters: 8 layers of hidden 512 (8 heads, 4 KV heads, head dim 64), gated MLP of
# 1536, vocabulary 8192, tied embeddings (so the weights a decode step reads are counted once).
BENCH_MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
BENCH_MODEL_SEED = 0
LOAD_AT_START = os.getloadavg()[0]


def num_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use_all_cores(threads: int | None = None) -> int:
    """Sets torch's thread count (default: every usable core) and returns it."""
    threads = threads or num_cores()
    torch.set_num_threads(threads)
    return threads


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_rows() -> list[tuple[str, str]]:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return [
        ("cpu", cpu_model()),
        ("cores (usable)", f"{num_cores()} (torch threads {torch.get_num_threads()})"),
        ("memory", f"{ram / 2**30:.1f} GiB"),
        ("load average (1 min)", f"{LOAD_AT_START:.1f} at start, {os.getloadavg()[0]:.1f} now (other processes count)"),
        ("python / torch", f"{platform.python_version()} / {torch.__version__}"),
        ("gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU run)"),
    ]


def print_table(title: str, rows: list[tuple], headers: tuple | None = None) -> None:
    """Left-aligned first column, right-aligned others; every cell printed with str(); a row
    shorter than the widest ends in blank cells."""
    cells = [[str(c) for c in row] for row in ([headers] if headers else []) + list(rows)]
    columns = max(len(row) for row in cells)
    cells = [row + [""] * (columns - len(row)) for row in cells]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]

    def line(row: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    print(f"\n{title}")
    print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for index, row in enumerate(cells):
        print(line(row))
        if headers and index == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))
    sys.stdout.flush()


def default_model_dir() -> Path:
    from cluster.paths import cache_dir

    return cache_dir() / "models" / f"bench-llama-30m-s{BENCH_MODEL_SEED}"


def ensure_checkpoint(model_dir: str | Path | None = None) -> tuple[Path, int]:
    """Builds (once) the seeded random Llama checkpoint; returns its folder and parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target = Path(model_dir) if model_dir else default_model_dir()
    config = LlamaConfig(**BENCH_MODEL)
    if not (target / "config.json").is_file() or not (target / "model.safetensors").is_file():
        print(f"[bench] building a random Llama checkpoint into {target}", file=sys.stderr, flush=True)
        torch.manual_seed(BENCH_MODEL_SEED)
        model = LlamaForCausalLM(config).to(torch.float32)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    # Count from the config alone (no weights loaded): the same model, on the meta device.
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig.from_pretrained(target)).parameters())
    return target, params


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy into a buffer already touched, best of
    ``repeats``; a copy reads and writes every byte, so both count."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the destination's pages in before timing
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * src.nbytes / best


def median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def percentile(values, q: float) -> float:
    """The nearest-rank q-quantile (q in [0, 1]) of the values that are not None; NaN for none."""
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def positive_ints(text: str) -> list[int]:
    """An argparse ``type``: positive integers separated by commas (batch sizes, stream counts)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, e.g. 1,8,32; got {text[:100]!r}")
    return values


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
