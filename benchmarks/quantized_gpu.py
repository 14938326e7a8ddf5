"""Quantized weights on one GPU: a decode step's linear layers in bf16, FP8, INT8 and INT4, side by side.

The Llama-3-8B shape (``gpu_decode.LLAMA3_8B``): 32 layers, each a fused q/k/v (6144 x 4096), o
(4096 x 4096), fused gate/up (28672 x 4096) and down (4096 x 14336) projection, then the output
head (128256 x 4096). Every layer has weights of its own (random; 32 copies of one layer would be
served partly from L2), in the engine's forms:

- bf16: ``F.linear`` on bfloat16 weights (cuBLAS);
- fp8: the f8 layout (e4m3 codes, a float32 scale per row, as ``model.quantization: fp8`` makes
  it), through the Triton kernel with FP8 activations where the GPU has FP8 tensor cores
  (compute capability >= 8.9); ``fp8 w-only``: the same weights through the Triton kernel,
  activations kept bf16; ``fp8 _scaled_mm``: the same weights through ``torch._scaled_mm``
  (activations quantized per row to e4m3); ``fp8 (engine)``: what the engine runs, each batch
  through the kernel ``kernels/torch_quantized_matmul.py`` gives it;
- int8: q8, a byte and a float32 scale per 32 weights, through the Triton kernel;
- int4: q4, half a byte and a float32 scale and min per 32 (``cluster/engine/quantization/quantize.py``),
  through the Triton kernel; ``int4 tinygemm``: the same weights through ``torch._weight_int4pack_mm``
  (scale and zero in bf16); ``int4 (engine)``: the engine's choice per batch.

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
# Formats by the weights they share: (name, kernel) with kernel one of dense, triton, triton-fp8 (FP8
# activations), torch (the torch kernel's form at every batch) and engine (the engine's rule).
WEIGHTS = {
    "bf16": (("bf16", "dense"),),
    "fp8": (("fp8", "triton-fp8"), ("fp8 w-only", "triton"), ("fp8 _scaled_mm", "torch"), ("fp8 (engine)", "engine")),
    "int8": (("int8", "triton"),),
    "int4": (("int4", "triton"), ("int4 tinygemm", "torch"), ("int4 (engine)", "engine")),
}
FORMATS = tuple(name for formats in WEIGHTS.values() for name, _ in formats)
QUANTIZE_AS = {name: quantization for quantization, formats in WEIGHTS.items() for name, _ in formats}
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


def make_weights(quantization: str, generator: torch.Generator) -> list:
    """Every layer's four weights and the head, quantized as ``quantization`` (bf16: tensors; else
    PackedWeights carrying the torch kernel's form where one applies, as the engine loads them)."""
    from cluster.engine.kernels.quantized_matmul import with_kernel_form
    from cluster.engine.quantization.quantize import quantize

    shapes = [shape for _ in range(LLAMA3_8B["num_hidden_layers"]) for shape in layer_shapes()]
    shapes.append(("lm_head", LLAMA3_8B["vocab_size"], LLAMA3_8B["hidden_size"]))
    weights = []
    for _, rows, cols in shapes:
        w = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda").uniform_(-0.05, 0.05, generator=generator)
        weights.append(w if quantization == "bf16" else with_kernel_form(quantize(w, quantization), torch.bfloat16))
        del w
    return weights


def weight_bytes(weights: list, kernel: str = "triton", batch: int = 1) -> int:
    """Bytes a step reads of the weights: the tensor, the packed codes, scales and mins, or the
    torch kernel's form where ``kernel`` takes it at ``batch`` (f8: the codes and a scale a row)."""
    def form_bytes(form) -> int:
        return sum(t.numel() * t.element_size() for t in vars(form).values())

    total = 0
    for w in weights:
        if isinstance(w, torch.Tensor):
            total += w.numel() * w.element_size()
        elif w.kernel_form is not None and (kernel == "torch" or (kernel == "engine" and w.kernel_form.takes(batch))):
            total += form_bytes(w.kernel_form)
        else:
            total += w.nbytes
    return total


def step_fn(kernel: str, weights: list, batch: int):
    """The step's matmuls on persistent inputs (each matmul reads an input of its width), through
    ``kernel`` (see WEIGHTS); None where the torch kernel has no form for these weights."""
    from cluster.engine.kernels.torch_quantized_matmul import torch_matmul
    from cluster.engine.kernels.triton_quantized_matmul import packed_linear

    if kernel == "torch" and any(w.kernel_form is None for w in weights):
        return None, 0
    widths = {w.shape[1] if isinstance(w, torch.Tensor) else w.cols for w in weights}
    device = weights[0].device if isinstance(weights[0], torch.Tensor) else weights[0].codes.device
    inputs = {k: torch.randn(batch, k, dtype=torch.bfloat16, device=device) for k in widths}

    def step() -> None:
        for w in weights:
            if isinstance(w, torch.Tensor):
                F.linear(inputs[w.shape[1]], w)
            elif kernel == "torch":
                torch_matmul(inputs[w.cols], w.kernel_form)
            else:
                packed_linear(inputs[w.cols], ((0, w),), w.rows, kernel == "triton-fp8", kernel == "engine")

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
    for quantization, formats in WEIGHTS.items():
        log(f"{quantization}: building the weights")
        weights = make_weights(quantization, generator)
        for fmt, kernel in formats:
            rows = {}
            for batch in batches:
                step, input_bytes = step_fn(kernel, weights, batch)
                if step is None:
                    log(f"{fmt}: no form for these weights on this GPU; left out")
                    break
                seconds = time_step(step, repeats)
                total = weight_bytes(weights, kernel, batch)
                rows[batch] = dict(step_s=seconds, bytes=total + input_bytes, weight_bytes=total)
                log(f"{fmt}: batch {batch}: {seconds * 1e3:.3f} ms a step ({total / 1e9:.2f} GB of weights read)")
            if rows:
                results[fmt] = dict(rows=rows)
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
                         f"{row['weight_bytes'] / 1e9:.2f}", f"{row['bytes'] / row['step_s'] / bandwidth:.1%}",
                         f"{batch / row['step_s']:.0f}"))
    return rows


def goal_rows(results: dict, bandwidth: float) -> list[tuple[str, str]]:
    """The issue's goals for what the engine runs (its rule's rows where there are any)."""
    def at(fmt: str, batch: int) -> dict:
        return results[fmt]["rows"][batch]

    batches = results["bf16"]["rows"]
    goals = []
    for plans in ("", " (swept)"):
        if f"int4{plans}" not in results:
            continue
        served = {kind: next(f for f in (f"{kind} (engine){plans}", f"{kind}{plans}") if f in results)
                  for kind in ("fp8", "int8", "int4")}
        if 1 in batches:
            bf16 = at("bf16", 1)["step_s"]
            goals.append((f"{served['int4']}: batch-1 step over bf16's (goal <= 0.4x)",
                          f"{at(served['int4'], 1)['step_s'] / bf16:.2f}x"))
            goals.append((f"{served['fp8']}: batch-1 step over bf16's (goal <= 0.6x)",
                          f"{at(served['fp8'], 1)['step_s'] / bf16:.2f}x"))
            for fmt in served.values():
                row = at(fmt, 1)
                goals.append((f"{fmt}: MBU at batch 1 (goal >= 60%)", f"{row['bytes'] / row['step_s'] / bandwidth:.1%}"))
        if 64 in batches:
            goals.append((f"{served['fp8']}: tokens/s at batch 64 over bf16's (goal >= 1.3x)",
                          f"{at('bf16', 64)['step_s'] / at(served['fp8'], 64)['step_s']:.2f}x"))
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
    parser.add_argument("--engine-only", action="store_true", help="only the whole engine's decode step per format")
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
    linear = {} if args.engine_only else run_linear(args.batches, args.repeats)
    if args.plans:
        with swept_plans(args.plans):
            tuned = run_linear(args.batches, args.repeats)
        linear.update({f"{fmt} (swept)": row for fmt, row in tuned.items() if fmt != "bf16"})
    engine = run_engine(args.batches, args.context, args.decode_tokens) if args.engine or args.engine_only else None

    machine = machine_rows(measured)
    machine.append(("bandwidth MBU is taken against", f"{bandwidth / 1e12:.2f} TB/s ("
                    + (f"nominal for {name})" if nominal else "measured copy: no nominal figure for this name)")))
    machine.append(("fp8 activations", "e4m3 (FP8 tensor cores)" if fp8_activations_run_on(torch.device("cuda"))
                    else "none here: fp8 runs weight-only (compute capability < 8.9)"))
    print_table("machine", machine)
    if linear:
        print_table("Llama-3-8B shape: 32 layers' linear layers and the output head, one decode step (CUDA graph, "
                    f"median of {args.repeats} replays)", linear_table(linear, args.batches, bandwidth),
                    ("batch", "weights", "step ms", "over bf16", "weights GB read", "MBU", "tok/s (linear only)"))
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
