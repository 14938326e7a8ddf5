"""float32 FMAs against bfloat16 dot products for the CPU's q4 matmul, side by side in one run.

Why: a decode step of one row reads the weights and widens them (memory and widening bound), but
each row past the first (a prompt's tokens, a speculative verify's guesses) is float32 FMAs on
the widened weight: on this project's 2-core AVX-512 machine a prompt token costs 1.0-1.3 ms and
each verify row 9-33% of a one-row step (``docs/speculative_cpu.txt``). CPUs with AVX512_BF16
take 32 products a vector with ``vdpbf16ps`` where an FMA takes 16. This measures what that buys
per q4 weight of the default model (``cpu_dot_products.c``: one thread, the tile kernels on the
same codes) and what bfloat16's rounding costs in the outputs. Two bfloat16 kernels: one rounds
the float32-widened weights, one (the engine's, ``cpu_matmul_dtype: bfloat16``) makes the same
bfloat16 weights from a 16-entry table per group; the run checks that their outputs are equal.

Beside them, int8 dot products (AVX512_VNNI's vpdpbusd), as llama.cpp multiplies these weights:
each activation row quantized to int8 per group of 32, two groups of codes a vector. And the
default model's q8 output layer (49,152 x 576), which the engine's ``cpu_matmul_dtype: auto``
multiplies in float32: float32, int16 activations (vpmaddwd: the weight exact, the activations
rounded to 1/32767 of their group's largest) and int8 activations. A decode step of one stream
spent 49% of its worker's CPU in the q4 kernel and 24% in that layer (``perf``, 2026-11-28).

The kernels here compare arithmetic, not memory traffic: they do not prefetch, and the engine's
kernel has prefetched the next tile's rows since 5df14eb. Its output layer, read from memory, takes
about half the float32 time shown here (one thread, 2026-11-28: 2.05 against 4.55 ms at one row).

Needs a C compiler and a CPU with AVX512_BF16 and AVX512_VNNI; without them it says so in one line.

    .venv/bin/python benchmarks/cpu_dot_products.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine_rows, print_table

from cluster.engine.kernels.build import c_compiler

SOURCE = Path(__file__).with_name("cpu_dot_products.c")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def main() -> int:
    compiler = c_compiler()
    missing = {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"} - cpu_flags()
    if compiler is None or missing:
        why = ("no C compiler (cc, gcc or clang; or set CC)" if compiler is None
               else f"this CPU lacks {', '.join(sorted(missing))}")
        print(f"cpu_dot_products.py: skipped, {why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="tandem-dot-") as folder:
        binary = Path(folder) / "dot"
        subprocess.run([compiler, "-O3", "-march=native", "-o", str(binary), str(SOURCE), "-lm"], check=True)
        print("[bench] one thread, best of 30 calls per kernel and shape", file=sys.stderr, flush=True)
        lines = subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split("\n")
    rows, head = [], []
    for line in filter(None, lines):
        if line.startswith("head "):
            n, k, m, f32_ms, int16_ms, int8_ms, int16_diff, int8_diff = line.split()[1:]
            head.append((f"{n} x {k}", m, f32_ms, int16_ms, int8_ms, f"{float(f32_ms) / float(int16_ms):.2f}x",
                         f"{float(f32_ms) / float(int8_ms):.2f}x", int16_diff, int8_diff))
            continue
        n, k, m, f32_ms, bf16_ms, table_ms, diff, same, int8_ms, int8_diff = line.split()
        rows.append((f"{n} x {k}", m, f32_ms, bf16_ms, table_ms, int8_ms, f"{float(f32_ms) / float(table_ms):.2f}x",
                     f"{float(table_ms) / float(int8_ms):.2f}x", diff, int8_diff, "yes" if same == "1" else "NO"))
    print_table("machine", machine_rows())
    print_table("a q4 weight times activation rows (the min term left out), one thread",
                rows, ("weight", "rows", "f32 FMA ms", "bf16 dot ms", "bf16 table ms", "int8 dot ms", "f32 / table",
                       "table / int8", "bf16 |diff| / |out|", "int8 |diff| / |out|", "table = bf16"))
    print_table("the q8 output layer times activation rows, one thread (differences against float32)",
                head, ("weight", "rows", "f32 FMA ms", "int16 act. ms", "int8 act. ms", "f32 / int16",
                       "f32 / int8", "int16 |diff| / |out|", "int8 |diff| / |out|"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
