"""The Triton quantized matmul's tile plans on one GPU: the plan ``plan_tiles`` picks against the
best of a sweep, per format, batch and Llama-3-8B matmul shape.

``triton_quantized_matmul.plan_tiles`` fixes the decode tiles (rows <= 64) by rule. This times each
candidate plan (weight rows per tile, columns per step, warps, pipeline stages, K splits) on
``--layers`` distinct copies of each shape (more bytes than the L2 holds, as a step reads them),
the copies' matmuls captured in one CUDA graph and replayed (median of ``--repeats``), and prints,
per shape, the rule's time, the best plan's, and the estimated whole step (32 layers and the head)
with each. ``fp8`` takes FP8 activations (on FP8 tensor cores), ``fp8 w-only`` keeps them 16-bit (the
engine's default): the sweep also says which of the two a batch should use.

    python benchmarks/quantized_gpu_tiles.py
    python benchmarks/quantized_gpu_tiles.py --formats int4 --batches 1 --json tiles.json
    TRITON_INTERPRET=1 python benchmarks/quantized_gpu_tiles.py --smoke   # the logic, on a CPU
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from pathlib import Path

from common import positive_ints, print_table  # (importing common puts the repository on sys.path)

import torch

from gpu_decode import LLAMA3_8B, log
from quantized_gpu import QUANTIZE_AS, layer_shapes, time_step

FORMATS = ("int4", "int8", "fp8", "fp8 w-only")
LAYOUT = {"int4": ("q4", False), "int8": ("q8", False), "fp8": ("f8", True), "fp8 w-only": ("f8", False)}
# Tensor-core tiles (rows of x in one tile) and GEMV tiles (one row a program).
DOT = dict(block_n=(32, 64, 128), block_k=(128, 256), warps_stages=((4, 3), (4, 4), (8, 3)))
GEMV = dict(block_n=(16, 32, 64), block_k=(128, 256), warps_stages=((4, 2), (4, 3), (8, 2)))
GEMV_UP_TO = 8  # rows swept with the GEMV kernel (more take the tensor-core tiles)
SPLITS = (1, 2, 4, 8, 16)


def shapes(smoke: bool) -> list[tuple[str, int, int]]:
    if smoke:
        return [("a", 96, 256), ("b", 64, 512)]
    return layer_shapes() + [("lm_head", LLAMA3_8B["vocab_size"], LLAMA3_8B["hidden_size"])]


def candidates(kernel, m: int, k: int, fp8_activations: bool) -> list:
    """Every swept plan for ``m`` rows and ``k`` columns: GEMV plans up to GEMV_UP_TO rows
    (not for FP8 activations, which take tensor cores), tensor-core tiles beyond."""
    gemv = m <= GEMV_UP_TO and not fp8_activations
    space = GEMV if gemv else DOT
    block_m = 1 if gemv else max(16, 1 << (m - 1).bit_length())
    plans = []
    for block_n, block_k, (warps, stages), splits in itertools.product(
            space["block_n"], space["block_k"], space["warps_stages"], SPLITS):
        k_tiles = -(-k // block_k)
        if k_tiles // splits < 2:
            continue
        per_split = -(-k_tiles // splits)
        plans.append(kernel.TilePlan(block_m, block_n, block_k, -(-k_tiles // per_split), per_split * block_k,
                                     warps, stages, gemv))
    return plans


def time_calls(calls, repeats: int, device: torch.device) -> float:
    """Median seconds of one run of ``calls`` (a CUDA graph replay; eager on a CPU)."""
    def run_all() -> None:
        for call in calls:
            call()

    if device.type == "cuda":
        return time_step(run_all, repeats)
    run_all()  # compiles (interprets) once outside the timing
    start = time.perf_counter()
    run_all()
    return time.perf_counter() - start


def sweep_shape(kernel, fmt: str, weights: list, batch: int, repeats: int, device: torch.device, dtype) -> dict:
    rows, cols = weights[0].rows, weights[0].cols
    x = torch.randn(batch, cols, dtype=dtype, device=device)
    out = torch.empty(batch, rows, dtype=dtype, device=device)
    fp8 = fmt == "fp8"

    def calls(plan):
        return [lambda w=w: kernel.quantized_matmul_into(x, w, out, fp8, plan=plan) for w in weights]

    layout, fp8_activations = LAYOUT[fmt]
    fp8_activations = fp8_activations and kernel.fp8_activations_run_on(device)
    rule = kernel.plan_tiles(batch, rows, cols, kernel._sm_count(device), layout=layout,
                             fp8_activations=fp8_activations)
    rule_s = best_s = float("inf")
    best = rule
    for plan in [None] + candidates(kernel, batch, cols, fp8_activations):
        try:
            seconds = time_calls(calls(plan), repeats, device) / len(weights)
        except Exception as error:  # a plan the compiler refuses (shared memory, registers): not a candidate
            log(f"{fmt} batch {batch} {rows}x{cols}: {plan} refused: {str(error).splitlines()[0][:120]}")
            continue
        if plan is None:
            rule_s = seconds
        if seconds < best_s:
            best_s, best = seconds, plan or rule
    if best_s == float("inf"):
        raise RuntimeError(f"{fmt} batch {batch} {rows}x{cols}: no plan ran")
    return dict(rule_s=rule_s, rule=vars(rule), best_s=best_s, best=vars(best), layout=layout,
                fp8_activations=fp8_activations, n=rows, k=cols)


def run(formats, batches, layers: int, repeats: int, smoke: bool, save=None) -> dict:
    from cluster.engine.kernels import triton_quantized_matmul as kernel
    from cluster.engine.quantization.quantize import quantize

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    results: dict = {}
    for fmt in formats:
        results[fmt] = {}
        for name, rows, cols in shapes(smoke):
            copies = 1 if name == "lm_head" else layers
            weights = []
            for _ in range(copies):
                w = torch.empty(rows, cols, dtype=dtype, device=device).uniform_(-0.05, 0.05, generator=generator)
                weights.append(quantize(w, QUANTIZE_AS[fmt]))
                del w
            for batch in batches:
                started = time.perf_counter()
                row = sweep_shape(kernel, fmt, weights, batch, repeats, device, dtype)
                results[fmt].setdefault(batch, {})[name] = row
                if save:
                    save(results)  # a run cut short keeps what it measured
                log(f"{fmt} batch {batch} {name}: rule {row['rule_s'] * 1e6:.1f} us, best {row['best_s'] * 1e6:.1f} us "
                    f"{row['best']} ({time.perf_counter() - started:.0f} s)")
            del weights
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return results


def step_seconds(rows: dict, key: str, smoke: bool) -> float:
    layers = 1 if smoke else LLAMA3_8B["num_hidden_layers"]
    return sum(row[key] * (1 if name == "lm_head" else layers) for name, row in rows.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", type=lambda s: [f.strip() for f in s.split(",")], default=list(FORMATS),
                        help=f"default: {','.join(FORMATS)}")
    parser.add_argument("--batches", type=positive_ints, default=[1, 8, 64], help="default: 1,8,64")
    parser.add_argument("--layers", type=int, default=8, help="distinct copies of each layer shape (default: 8)")
    parser.add_argument("--repeats", type=int, default=10, help="replays timed per plan (default: 10)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (under TRITON_INTERPRET=1)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("quantized_gpu_tiles.py: skipped, no CUDA device here (torch.cuda.is_available() is False)")
        return 0
    unknown = sorted(set(args.formats) - set(FORMATS))
    if unknown:
        parser.error(f"unknown format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}")
    device = "CPU (interpreter)" if args.smoke else torch.cuda.get_device_name()

    def save(results: dict) -> None:
        if args.json:
            args.json.write_text(json.dumps(dict(device=device, results=results), indent=2, default=str))

    results = run(args.formats, args.batches, args.layers, args.repeats, args.smoke, save)
    rows, steps = [], []
    for fmt, by_batch in results.items():
        for batch, by_shape in by_batch.items():
            for name, row in by_shape.items():
                best = row["best"]
                rows.append((fmt, batch, name, f"{row['rule_s'] * 1e6:.1f}", f"{row['best_s'] * 1e6:.1f}",
                             f"{row['rule_s'] / row['best_s']:.2f}x",
                             ("gemv" if best["gemv"] else f"m{best['block_m']}")
                             + f" n{best['block_n']} k{best['block_k']} w{best['num_warps']} s{best['num_stages']} "
                             f"splits {best['splits']}"))
            rule, best = step_seconds(by_shape, "rule_s", args.smoke), step_seconds(by_shape, "best_s", args.smoke)
            steps.append((fmt, batch, f"{rule * 1e3:.3f}", f"{best * 1e3:.3f}", f"{rule / best:.2f}x"))
    print_table("machine", [("device", device), ("torch", torch.__version__)])
    print_table("per matmul (us, median of replays over the copies)", rows,
                ("format", "batch", "shape", "rule us", "best us", "gain", "best plan"))
    print_table("whole step's linear layers (32 layers and the head), ms", steps,
                ("format", "batch", "rule ms", "best ms", "gain"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
