"""Decode on one GPU: step time and model-bandwidth utilisation against ``transformers`` ``generate``.

The model is Llama-3-8B-shaped (32 layers, hidden 4096, 32 heads with 8 KV heads of 128, MLP
14336, vocabulary 128256) with random bfloat16 weights: no checkpoint is read or written (our
engine fills its weights with the ``dummy`` load format; transformers initialises its own).
For each batch size, that many requests with prompts of ``--context`` random tokens each
generate ``--decode-tokens`` tokens (greedy, ignore_eos):

- ours: the Tandem engine (Triton attention, CUDA graphs for decode unless --enforce-eager).
  Decode step time is the median wall time of the engine's pure decode steps (scheduling,
  inputs, forward, sampling: all of it). Model-bandwidth utilisation (MBU) is the bytes a
  step must read (every weight but the input embedding table, of which a step reads only its
  tokens' rows, plus every request's KV) over the step time, against the device's measured
  copy bandwidth (a device-to-device copy reads and writes each byte; both count);
- transformers: ``generate`` on the same requests in one batch, on the same GPU, after ours
  has released its memory.

Tokens per second counts generated tokens over the whole call, prompt processing included,
for both. Goals: MBU >= 70% at batch 1; ours >= 5x transformers' tokens/s at batch 64.

Prompt processing is reported apart, as is transformers' decode step: its prefill time is a
``generate`` of one token on the same prompts, and its decode step is the rest of the full
call over the other ``--decode-tokens - 1`` tokens. Ours is the time of the engine's steps that
processed prompt tokens.

Needs a CUDA GPU with about 60 GiB free for batch 256 (weights 15 GiB, KV cache 36 GiB) and
only torch, triton, safetensors, tokenizers and transformers (no Ray, Redis or gRPC):

    python benchmarks/gpu_decode.py                        # batches 1, 8, 64, 256; transformers at 1, 8, 64
    python benchmarks/gpu_decode.py --batches 1,64 --hf-batches 64 --decode-tokens 64
    python benchmarks/gpu_decode.py --skip-hf --enforce-eager
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

from common import median, positive_ints, print_table  # (importing common puts the repository on sys.path)

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
    torch_dtype="bfloat16",
)
BLOCK_SIZE = 16


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def log(message: str) -> None:
    print(f"[gpu_decode] {message}", file=sys.stderr, flush=True)


def copy_bandwidth(gib: float = 1.0, repeats: int = 20) -> float:
    """Bytes per second of a device-to-device copy (read + write), best of ``repeats``."""
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * int(gib * 2**30) / best


def make_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, LLAMA3_8B["vocab_size"] - 1000, (batch, length), generator=generator).tolist()


def run_ours(model_dir: Path, batches: list[int], context: int, new_tokens: int, enforce_eager: bool,
             device: str = "cuda", quantization: str = "none") -> dict:
    """``quantization``: the engine's (``none``, or ``int8``/``int4``/``fp8``: the random weights
    quantized at load; see benchmarks/quantized_gpu.py)."""
    from cluster.offline.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    largest = max(batches)
    max_len = context + new_tokens + BLOCK_SIZE
    blocks = largest * -(-max_len // BLOCK_SIZE) + 16
    log(f"ours: building the engine ({blocks} KV blocks, decode graphs {'off' if enforce_eager else 'on'})")
    started = time.perf_counter()
    llm = LLM(str(model_dir), verbose=False, dtype="bfloat16", device=device, load_format="dummy",
              block_size=BLOCK_SIZE, max_num_seqs=largest, max_model_len=max_len, num_kv_blocks=blocks,
              max_num_batched_tokens=8192, enable_prefix_caching=False, enforce_eager=enforce_eager,
              quantization=quantization)
    engine = llm.engine
    runner = engine.runner
    log(f"ours: ready in {time.perf_counter() - started:.1f}s; backend {runner.attention_backend}, "
        f"{len(runner.graphs.graphs) if runner.graphs else 0} decode graphs captured")
    config = engine.model_config
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * 2
    results = dict(
        weight_bytes=runner.weight_bytes, weight_bytes_read=runner.weight_bytes - embedding,
        kv_bytes_per_token=config.kv_bytes_per_token(), backend=runner.attention_backend,
        graphs=len(runner.graphs.graphs) if runner.graphs else 0, rows={},
    )
    warm_up = SamplingParams(temperature=0, max_tokens=min(8, new_tokens), ignore_eos=True)
    llm.generate(make_prompts(2, min(64, context), seed=1), warm_up)
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        prompts = make_prompts(batch, context, seed=batch)
        engine.stats.steps.clear()
        synchronize(device)
        started = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - started
        decode_steps = [s for s in engine.stats.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch]
        prefill_s = sum(s.seconds for s in engine.stats.steps if s.num_prefill_tokens)
        step_s = median(s.seconds for s in decode_steps)
        kv_tokens = median(s.context_tokens for s in decode_steps)  # keys the step's decodes attended to
        results["rows"][batch] = dict(
            wall_s=wall, tokens_per_s=batch * new_tokens / wall, step_s=step_s, decode_steps=len(decode_steps),
            kv_bytes=kv_tokens * results["kv_bytes_per_token"], prefill_s=prefill_s,
        )
        log(f"ours: batch {batch}: {batch * new_tokens / wall:.1f} tok/s, decode step {step_s * 1e3:.2f} ms "
            f"(median of {len(decode_steps)})")
    del llm, engine, runner
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return results


def run_transformers(batches: list[int], context: int, new_tokens: int, device: str = "cuda") -> dict:
    import transformers

    log("transformers: building the model on the GPU (random bfloat16 weights)")
    fields = {k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "torch_dtype")}
    config = transformers.LlamaConfig(**fields)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)

    def generate(prompts: list[list[int]], tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)
        synchronize(device)
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                           min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        synchronize(device)
        return time.perf_counter() - started

    generate(make_prompts(2, 64, seed=1), 8)  # warm-up
    rows = {}
    for batch in batches:
        prompts = make_prompts(batch, context, seed=batch)
        wall = generate(prompts, new_tokens)
        prefill = generate(prompts, 1)
        step = (wall - prefill) / max(1, new_tokens - 1)
        rows[batch] = dict(wall_s=wall, tokens_per_s=batch * new_tokens / wall, prefill_s=prefill, step_s=step)
        log(f"transformers: batch {batch}: {batch * new_tokens / wall:.1f} tok/s, prefill {prefill:.2f}s, "
            f"decode step {step * 1e3:.2f} ms")
    return dict(version=transformers.__version__, rows=rows)


def machine_rows(bandwidth: float) -> list[tuple[str, str]]:
    import triton

    props = torch.cuda.get_device_properties(0)
    return [
        ("gpu", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"),
        ("measured copy bandwidth", f"{bandwidth / 1e12:.2f} TB/s (device-to-device copy, read + write)"),
        ("cuda (torch build)", str(torch.version.cuda)),
        ("python / torch / triton", f"{platform.python_version()} / {torch.__version__} / {triton.__version__}"),
        ("cpu", platform.processor() or platform.machine()),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=positive_ints, default=[1, 8, 64, 256], help="default: 1,8,64,256")
    parser.add_argument("--hf-batches", type=positive_ints, default=[1, 8, 64], help="default: 1,8,64")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request (default: 1024)")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per request (default: 128)")
    parser.add_argument("--skip-hf", action="store_true", help="ours only")
    parser.add_argument("--enforce-eager", action="store_true", help="our decode steps without CUDA graphs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine", file=sys.stderr)
        return 2

    log("measuring copy bandwidth")
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory(prefix="tandem-llama3-8b-shape-") as folder:
        model_dir = Path(folder)
        (model_dir / "config.json").write_text(json.dumps(LLAMA3_8B, indent=2))
        ours = run_ours(model_dir, args.batches, args.context, args.decode_tokens, args.enforce_eager)
    hf = None if args.skip_hf else run_transformers(args.hf_batches, args.context, args.decode_tokens)

    print_table("machine", machine_rows(bandwidth))
    rows = []
    for batch, row in ours["rows"].items():
        step_bytes = ours["weight_bytes_read"] + row["kv_bytes"]
        mbu = step_bytes / row["step_s"] / bandwidth
        row["mbu"] = mbu
        theirs = hf["rows"].get(batch) if hf else None
        rows.append((
            batch, args.context, f"{row['step_s'] * 1e3:.2f}", f"{ours['weight_bytes_read'] / 1e9:.2f}",
            f"{row['kv_bytes'] / 1e9:.2f}", f"{mbu:.1%}", f"{row['tokens_per_s']:.0f}",
            f"{theirs['tokens_per_s']:.0f}" if theirs else "-",
            f"{row['tokens_per_s'] / theirs['tokens_per_s']:.2f}x" if theirs else "-",
            f"{theirs['step_s'] * 1e3:.2f}" if theirs else "-",
            f"{row['prefill_s']:.2f}", f"{theirs['prefill_s']:.2f}" if theirs else "-",
        ))
    print_table(
        f"Llama-3-8B shape, bf16, {args.decode_tokens} new tokens per request (ours: {ours['backend']} attention, "
        f"{ours['graphs']} decode graphs; transformers {hf['version'] if hf else 'skipped'})",
        rows,
        ("batch", "context", "step ms", "weights GB", "KV GB", "MBU", "ours tok/s", "hf tok/s", "ours / hf",
         "hf step ms", "prefill s", "hf prefill s"),
    )
    goals = []
    if 1 in ours["rows"]:
        goals.append(("MBU at batch 1 (goal >= 70%)", f"{ours['rows'][1]['mbu']:.1%}"))
    if hf and 64 in ours["rows"] and 64 in hf["rows"]:
        ratio = ours["rows"][64]["tokens_per_s"] / hf["rows"][64]["tokens_per_s"]
        goals.append(("tokens/s over transformers at batch 64 (goal >= 5x)", f"{ratio:.2f}x"))
    if goals:
        print_table("goals", goals)
    if args.json:
        args.json.write_text(json.dumps(dict(bandwidth=bandwidth, ours=ours, transformers=hf), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
