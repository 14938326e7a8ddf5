"""Quantized weights on one GPU: a decode step's linear layers in bf16, FP8, INT8 and INT4, side by side.

The Llama-3-8B shape (``gpu_decode.LLAMA3_8B``): 32 layers, each a fused q/k/v (6144 x 4096), o
(4096 x 4096), fused gate/up (28672 x 4096) and down (4096 x 14336) projection, then the output
head (128256 x 4096). Every layer has weights of its own (random; 32 copies of one layer would be
served partly from L2), in the engine's forms:

- bf16: ``F.linear`` on bfloat16 weights (cuBLAS);
- fp8: the f8 layout (e4m3 codes, a float32 scale per 32 weights, as ``model.quantization: fp8``
  makes it), through the Triton kernel with FP8 activations where the GPU has FP8 tensor cores
  (compute capability >= 8.9); ``fp8 w-only``: the same weights, activations kept bf16 (what the
  engine runs: FP8 activations measured slower);
- int8: q8, a byte and a float32 scale per 32 weights; int4: q4, half a byte and a float32 scale
  and min per 32 (``cluster/engine/quantization/quantize.py``).

For each batch (rows of activations, bf16), the step's matmuls, in the order a decode step runs
them, are captured in one CUDA graph (as the engine's decode steps are) and replayed; the step
time is the median replay time, by CUDA events. MBU: the bytes the step reads (every weight's
codes, scales and mins, and the activations) over the step time, as a fraction of the device's
nominal memory bandwidth (``NOMINAL_BANDWIDTH``, by device name; the measured device-to-device
copy bandwidth where the name is not listed, and the table says which). Tokens/s is batch over
step time: the linear layers alone (attention, norms and sampling excluded), the bound these
kernels set. ``--engine`` also runs the whole engine on the same shape with random weights
(``gpu_decode.run_ours``, quantized at load), its decode step timed as gpu_decode.py times it.

Goals (issue 23): INT4 batch-1 step <= 0.4x bf16's (the roofline is ~0.27x), FP8 <= 0.6x; MBU of
the quantized bytes >= 60%; FP8 at batch 64 >= 1.3x bf16's tokens/s.

Needs a CUDA GPU with about 20 GiB free; without one it prints a line saying so and stops.

    python benchmarks/quantized_gpu.py
    python benchmarks/quantized_gpu.py --batches 1,64 --repeats 50 --engine
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from common import median, positive_ints, print_table  # (importing common puts the repository on sys.path)

import torch
import torch.nn.functional as F

from gpu_decode import LLAMA3_8B, copy_bandwidth, log, machine_rows, run_ours

# Bytes per second a device's memory is sold for, by a substring of its name (first match).
NOMINAL_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5 (HBM3)
    ("H800", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB
    ("L40S", 0.864e12),
    ("L40", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
    ("A10", 0.6e12),
    ("RTX 4090", 1.008e12),
)
FORMATS = ("bf16", "fp8", "fp8 w-only", "int8", "int4")
QUANTIZE_AS = {"fp8": "fp8", "fp8 w-only": "fp8", "int8": "int8", "int4": "int4"}
ENGINE_FORMATS = {"bf16": "none", "fp8": "fp8", "int8": "int8", "int4": "int4"}


def layer_shapes() -> list[tuple[str, int, int]]:
    """(name, output rows, input columns) of one decoder layer's matmuls, in a step's order."""
    c = LLAMA3_8B
    head_dim = c["head_dim"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    hidden, mlp = c["hidden_size"], c["intermediate_size"]
    return [("qkv", qkv, hidden), ("o", hidden, c["num_attention_heads"] * head_dim),
            ("gate_up", 2 * mlp, hidden), ("down", hidden, mlp)]


def nominal_bandwidth(name: str) -> float | None:
    return next((bandwidth for key, bandwidth in NOMINAL_BANDWIDTH if key in name), None)


def make_weights(fmt: str, generator: torch.Generator) -> list:
    """Every layer's four weights and the head, in the format: bf16 tensors or PackedWeights."""
    from cluster.engine.quantization.quantize import quantize

    shapes = [shape for _ in range(LLAMA3_8B["num_hidden_layers"]) for shape in layer_shapes()]
    shapes.append(("lm_head", LLAMA3_8B["vocab_size"], LLAMA3_8B["hidden_size"]))
    weights = []
    for _, rows, cols in shapes:
        w = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda").uniform_(-0.05, 0.05, generator=generator)
        weights.append(w if fmt == "bf16" else quantize(w, QUANTIZE_AS[fmt]))
        del w
    return weights


def weight_bytes(weights: list) -> int:
    return sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes for w in weights)


def step_fn(fmt: str, weights: list, batch: int):
    """The step's matmuls on persistent inputs (each matmul reads an input of its width)."""
    from cluster.engine.kernels.triton_quantized_matmul import packed_linear

    widths = {w.shape[1] if isinstance(w, torch.Tensor) else w.cols for w in weights}
    device = weights[0].device if isinstance(weights[0], torch.Tensor) else weights[0].codes.device
    inputs = {k: torch.randn(batch, k, dtype=torch.bfloat16, device=device) for k in widths}
    fp8_activations = fmt == "fp8"

    def step() -> None:
        for w in weights:
            if isinstance(w, torch.Tensor):
                F.linear(inputs[w.shape[1]], w)
            else:
                packed_linear(inputs[w.cols], ((0, w),), w.rows, fp8_activations)

    return step, sum(t.numel() * t.element_size() for t in inputs.values())


def time_step(step, repeats: int) -> float:
    """Median seconds of a replay of ``step`` captured in a CUDA graph."""
    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return median(times)


def run_linear(batches: list[int], repeats: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(0)
    results: dict = {}
    for fmt in FORMATS:
        log(f"{fmt}: building the weights")
        weights = make_weights(fmt, generator)
        total = weight_bytes(weights)
        results[fmt] = dict(weight_bytes=total, rows={})
        for batch in batches:
            step, input_bytes = step_fn(fmt, weights, batch)
            seconds = time_step(step, repeats)
            results[fmt]["rows"][batch] = dict(step_s=seconds, bytes=total + input_bytes)
            log(f"{fmt}: batch {batch}: {seconds * 1e3:.3f} ms a step ({total / 1e9:.2f} GB of weights)")
        del weights
        gc.collect()
        torch.cuda.empty_cache()
    return results


@contextmanager
def swept_plans(paths: list[Path]):
    """plan_tiles answers with the sweeps' best plans, by layout, FP8 activations and shape."""
    from cluster.engine.kernels import triton_quantized_matmul as kernel

    best = {}
    for path in paths:
        for by_batch in json.loads(path.read_text())["results"].values():
            for batch, by_shape in by_batch.items():
                for row in by_shape.values():
                    key = (row["layout"], row["fp8_activations"], int(batch), row["n"], row["k"])
                    best[key] = kernel.TilePlan(**row["best"])
    rule = kernel.plan_tiles

    def lookup(m, n, k, num_sms, splits=None, layout="q4", fp8_activations=False):
        return best.get((layout, bool(fp8_activations), m, n, k)) or rule(m, n, k, num_sms, splits, layout,
                                                                          fp8_activations)

    kernel.plan_tiles = lookup
    try:
        yield
    finally:
        kernel.plan_tiles = rule


def linear_table(results: dict, batches: list[int], bandwidth: float) -> list[tuple]:
    rows = []
    for batch in batches:
        base = results["bf16"]["rows"][batch]["step_s"]
        for fmt in ["bf16"] + [f for f in results if f != "bf16"]:
            row = results[fmt]["rows"][batch]
            rows.append((batch, fmt, f"{row['step_s'] * 1e3:.3f}", f"{row['step_s'] / base:.2f}x",
                         f"{results[fmt]['weight_bytes'] / 1e9:.2f}", f"{row['bytes'] / row['step_s'] / bandwidth:.1%}",
                         f"{batch / row['step_s']:.0f}"))
    return rows


def goal_rows(results: dict, bandwidth: float) -> list[tuple[str, str]]:
    def at(fmt: str, batch: int) -> dict:
        return results[fmt]["rows"][batch]

    batches = results["bf16"]["rows"]
    goals = []
    for plans in ("", " (swept)"):
        if f"int4{plans}" not in results:
            continue
        if 1 in batches:
            bf16 = at("bf16", 1)["step_s"]
            goals.append((f"INT4{plans} batch-1 step over bf16's (goal <= 0.4x)",
                          f"{at(f'int4{plans}', 1)['step_s'] / bf16:.2f}x"))
            goals.append((f"FP8{plans} batch-1 step over bf16's (goal <= 0.6x)",
                          f"{min(at(f'fp8{plans}', 1)['step_s'], at(f'fp8 w-only{plans}', 1)['step_s']) / bf16:.2f}x"))
            for fmt in ("fp8", "fp8 w-only", "int8", "int4"):
                row = at(f"{fmt}{plans}", 1)
                goals.append((f"{fmt}{plans} MBU at batch 1 (goal >= 60%)",
                              f"{row['bytes'] / row['step_s'] / bandwidth:.1%}"))
        if 64 in batches:
            fp8 = min(at(f"fp8{plans}", 64)["step_s"], at(f"fp8 w-only{plans}", 64)["step_s"])
            goals.append((f"FP8{plans} tokens/s at batch 64 over bf16's (goal >= 1.3x)",
                          f"{at('bf16', 64)['step_s'] / fp8:.2f}x"))
    return goals


def run_engine(batches: list[int], context: int, new_tokens: int) -> dict:
    results = {}
    with tempfile.TemporaryDirectory(prefix="tandem-llama3-8b-shape-") as folder:
        model_dir = Path(folder)
        (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B, indent=2))
        for fmt, quantization in ENGINE_FORMATS.items():
            log(f"engine, {fmt}")
            results[fmt] = run_ours(model_dir, batches, context, new_tokens, enforce_eager=False,
                                    quantization=quantization)
    return results


def engine_table(results: dict, bandwidth: float) -> list[tuple]:
    rows = []
    for fmt, ours in results.items():
        for batch, row in ours["rows"].items():
            step_bytes = ours["weight_bytes_read"] + row["kv_bytes"]
            base = results["bf16"]["rows"][batch]
            rows.append((batch, fmt, f"{row['step_s'] * 1e3:.2f}", f"{row['step_s'] / base['step_s']:.2f}x",
                         f"{ours['weight_bytes_read'] / 1e9:.2f}", f"{row['kv_bytes'] / 1e9:.2f}",
                         f"{step_bytes / row['step_s'] / bandwidth:.1%}", f"{row['tokens_per_s']:.0f}"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=positive_ints, default=[1, 8, 64], help="default: 1,8,64")
    parser.add_argument("--repeats", type=int, default=30, help="replays timed per format and batch (default: 30)")
    parser.add_argument("--engine", action="store_true", help="also the whole engine's decode step per format")
    parser.add_argument("--context", type=int, default=512, help="--engine: prompt tokens per request (default: 512)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="--engine: tokens per request (default: 64)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--plans", type=Path, nargs="*", default=[],
                        help="quantized_gpu_tiles.py --json files: also time each format with the best plans found "
                             "there (shapes and batches not swept keep plan_tiles' plan)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("quantized_gpu.py: skipped, no CUDA device here (torch.cuda.is_available() is False)")
        return 0

    from cluster.engine.kernels.triton_quantized_matmul import fp8_activations_run_on

    name = torch.cuda.get_device_name()
    log("measuring copy bandwidth")
    measured = copy_bandwidth()
    nominal = nominal_bandwidth(name)
    bandwidth = nominal or measured
    linear = run_linear(args.batches, args.repeats)
    if args.plans:
        with swept_plans(args.plans):
            tuned = run_linear(args.batches, args.repeats)
        linear.update({f"{fmt} (swept)": row for fmt, row in tuned.items() if fmt != "bf16"})
    engine = run_engine(args.batches, args.context, args.decode_tokens) if args.engine else None

    machine = machine_rows(measured)
    machine.append(("bandwidth MBU is taken against", f"{bandwidth / 1e12:.2f} TB/s ("
                    + (f"nominal for {name})" if nominal else "measured copy: no nominal figure for this name)")))
    machine.append(("fp8 activations", "e4m3 (FP8 tensor cores)" if fp8_activations_run_on(torch.device("cuda"))
                    else "none here: fp8 runs weight-only (compute capability < 8.9)"))
    print_table("machine", machine)
    print_table("Llama-3-8B shape: 32 layers' linear layers and the output head, one decode step (CUDA graph, "
                f"median of {args.repeats} replays)", linear_table(linear, args.batches, bandwidth),
                ("batch", "weights", "step ms", "over bf16", "weights GB", "MBU", "tok/s (linear only)"))
    print_table("goals (linear layers)", goal_rows(linear, bandwidth))
    if engine:
        print_table(f"the engine, whole decode step ({args.context}-token prompts, {args.decode_tokens} new tokens; "
                    "weights quantized at load)", engine_table(engine, bandwidth),
                    ("batch", "weights", "step ms", "over bf16", "weights GB", "KV GB", "MBU", "tok/s"))
    if args.json:
        args.json.write_text(json.dumps(dict(device=name, bandwidth=bandwidth, measured_bandwidth=measured,
                                             linear=linear, engine=engine), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
