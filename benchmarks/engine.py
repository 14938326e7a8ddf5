"""Engine throughput against ``transformers`` ``generate()`` on the same checkpoint and workload.

Both get the same requests (seeded: prompts of 16..512 tokens, outputs of 16..256, ignore_eos,
greedy). Ours receives them all at once and batches continuously; Hugging Face receives them in
arrival order in static batches (left-padded, generating until the batch's longest request is
done; only each request's own requested tokens count as useful output). Ours runs before and
after HF, each time on a fresh engine, so that a change in the machine's load weighs on both.
Prints output tokens per second of both and their ratio (goal: ours >= 3x), decode-step time against its memory floor
(weight bytes + KV bytes) / measured bandwidth, and writes a latency CDF as a PNG.

    .venv/bin/python benchmarks/engine.py             # full run (several minutes: HF is slow)
    .venv/bin/python benchmarks/engine.py --skip-hf   # ours only
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from common import (
    REPO_ROOT,
    ensure_checkpoint,
    fmt_ms,
    machine_rows,
    median,
    memory_bandwidth,
    print_table,
    use_all_cores,
)

import torch


def make_workload(num_requests: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, in arrival order."""
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(16, 512), rng.randint(16, 256)
        workload.append(([rng.randrange(3, vocab) for _ in range(prompt_len)], output_len))
    return workload


def run_ours(model_dir: Path, workload, threads: int) -> dict:
    """One run on a fresh engine (a reused one would hit its prefix cache on the same prompts)."""
    from cluster.offline.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    blocks = sum(-(-(len(p) + n) // 16) for p, n in workload) + 64  # room for all: no preemption
    llm = LLM(str(model_dir), dtype="float32", verbose=False, max_num_batched_tokens=2048, max_num_seqs=128,
              max_model_len=1024, num_kv_blocks=blocks, enable_prefix_caching=True, num_threads=threads)
    llm.generate([[5] * 64], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    llm.engine.stats.steps.clear()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    print(f"[ours] {len(workload)} requests", file=sys.stderr, flush=True)
    started_mono, started = time.monotonic(), time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params, progress=True)
    return dict(
        wall=time.perf_counter() - started,
        tokens=[o.token_ids for o in outs],
        latencies=[o.finish_time - started_mono for o in outs],
        steps=list(llm.engine.stats.steps),
        weight_bytes=llm.engine.runner.weight_bytes,
        kv_bytes_per_token=llm.engine.model_config.kv_bytes_per_token(),
    )


def run_hf(model_dir: Path, workload, batch_size: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id

    def generate(batch):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(n for _, n in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        return [row[width: width + n].tolist() for row, (_, n) in zip(out, batch)]

    generate([([5] * 64, 8)])  # warm-up
    tokens, latencies = [], []
    started = time.perf_counter()
    for first in range(0, len(workload), batch_size):
        batch = workload[first: first + batch_size]
        tokens += generate(batch)
        now = time.perf_counter() - started
        latencies += [now] * len(batch)
        done = sum(n for _, n in workload[: first + len(batch)])
        print(f"[hf] batch {first // batch_size + 1}/{-(-len(workload) // batch_size)}: {len(batch)} requests, "
              f"{done} useful tokens in {now:.1f}s ({done / now:.1f} tok/s)", file=sys.stderr, flush=True)
    return time.perf_counter() - started, tokens, latencies


def compare_tokens(ours: list[list[int]], hf: list[list[int]], eos: int) -> tuple[int, int, int]:
    """(requests identical, tokens agreeing before the first divergence, tokens compared).

    HF suppresses EOS (min_new_tokens) where ours merely ignores it, so each comparison stops
    at ours' first EOS."""
    same = agree = compared = 0
    for a, b in zip(ours, hf):
        if eos in a:
            a, b = a[: a.index(eos)], b[: a.index(eos)]
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        agree += prefix
        compared += len(a)
    return same, agree, compared


def decode_rows(runs: list[dict], bandwidth: float) -> list[tuple]:
    """Pure decode steps (no prompt tokens) of all our runs, all together and by batch size."""
    weights, per_token = runs[0]["weight_bytes"], runs[0]["kv_bytes_per_token"]
    steps = [s for run in runs for s in run["steps"] if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    groups = [("all", steps)]
    for low, high in ((1, 8), (9, 32), (33, 64), (65, 128)):
        chosen = [s for s in steps if low <= s.num_decode_tokens <= high]
        if chosen:
            groups.append((f"batch {low}-{high}", chosen))
    rows = []
    for name, group in groups:
        measured = median(s.seconds for s in group)
        floor = median((weights + s.context_tokens * per_token) / bandwidth for s in group)
        kv = median(s.context_tokens * per_token for s in group)
        rows.append((name, len(group), f"{kv / 2**20:.0f} MiB", fmt_ms(measured), fmt_ms(floor),
                     f"{measured / floor:.1f}x", f"{floor / measured:.1%}"))
    return rows


def plot_cdf(path: Path, latencies: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in latencies.items():
        xs = [0.0] + sorted(values)
        ax.step(xs, [i / len(values) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("end-to-end latency (s, all requests sent at t=0)")
    ax.set_ylabel("fraction of requests done")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="checkpoint folder to reuse or build (default: Tandem's cache)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="run ours only")
    parser.add_argument("--threads", type=int, help="torch threads for both (default: the usable cores)")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    args = parser.parse_args()

    threads = use_all_cores(args.threads)
    model_dir, num_params = ensure_checkpoint(args.model_dir)
    workload = make_workload(args.num_requests, args.seed, vocab=8192)
    useful = sum(n for _, n in workload)
    bandwidth = memory_bandwidth()

    # Ours runs before and after HF, so that a change in the machine's load during the run
    # weighs on both sides alike; the ratio uses the mean of our two wall times.
    runs = [run_ours(model_dir, workload, threads)]
    if not args.skip_hf:
        hf_wall, hf_tokens, hf_lat = run_hf(model_dir, workload, args.hf_batch_size)
        runs.append(run_ours(model_dir, workload, threads))
    ours_wall = sum(r["wall"] for r in runs) / len(runs)

    print_table("Machine", machine_rows() + [("memory bandwidth (copy, read+write)", f"{bandwidth / 1e9:.1f} GB/s")])
    prompt_tokens = sum(len(p) for p, _ in workload)
    print_table("Workload", [
        ("checkpoint", f"{model_dir} (Llama, {num_params:,} parameters, float32)"),
        ("requests", f"{len(workload)} (seed {args.seed}), all sent at once, greedy, ignore_eos"),
        ("prompt tokens", f"{prompt_tokens:,} (16..512 each)"),
        ("output tokens", f"{useful:,} (16..256 each)"),
    ])
    names = ["tandem, continuous batching"] if args.skip_hf else ["tandem, before HF", "tandem, after HF"]
    rows = [(name, f"{r['wall']:.1f}", f"{useful / r['wall']:.1f}") for name, r in zip(names, runs)]
    if not args.skip_hf:
        rows += [("tandem, mean of both", f"{ours_wall:.1f}", f"{useful / ours_wall:.1f}"),
                 (f"transformers generate, batches of {args.hf_batch_size}", f"{hf_wall:.1f}", f"{useful / hf_wall:.1f}")]
    print_table("Throughput", rows, ("engine", "wall s", "output tok/s"))
    if not args.skip_hf:
        ratio = hf_wall / ours_wall
        print(f"ours / HF output tokens per second: {ratio:.2f}x (goal >= 3x: {'met' if ratio >= 3 else 'NOT met'}; "
              f"{hf_wall / max(r['wall'] for r in runs):.2f}x to {hf_wall / min(r['wall'] for r in runs):.2f}x "
              f"against each of our runs)")
        same, agree, compared = compare_tokens(runs[0]["tokens"], hf_tokens, eos=2)
        print(f"greedy tokens identical to HF for {same}/{len(workload)} requests "
              f"({agree}/{compared} tokens before the first divergence)")
    print_table("Decode steps (pure decode) against the memory floor (weights + KV) / bandwidth",
                decode_rows(runs, bandwidth),
                ("steps", "count", "median KV", "measured", "floor", "measured/floor", "MBU"))
    print(f"weights {runs[0]['weight_bytes'] / 2**20:.1f} MiB; KV {runs[0]['kv_bytes_per_token'] / 2**10:.0f} KiB per token")

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "engine_latency_cdf.png"
    curves = {f"tandem, {name.removeprefix('tandem, ')} ({r['wall']:.0f}s wall)": r["latencies"]
              for name, r in zip(names, runs)}
    if not args.skip_hf:
        curves[f"transformers, batches of {args.hf_batch_size} ({hf_wall:.0f}s wall)"] = hf_lat
    plot_cdf(png, curves, f"{len(workload)} requests, {num_params / 1e6:.1f}M-param Llama fp32, {threads} torch threads")
    print(f"latency CDF: {png}")


if __name__ == "__main__":
    main()
