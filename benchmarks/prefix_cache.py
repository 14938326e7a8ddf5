"""Prefix-cache benchmark: TTFT of a prompt whose first tokens are cached, against the same
size of prompt uncached, measured in one run and printed as a ratio (goal: under 0.2).

Each repetition measures both, back to back: a fresh random prompt (nothing to hit), then the
cached prefix followed by a new random tail (only the prefix can hit). TTFT is the first token's
time minus the request's arrival, with max_tokens=1.

    .venv/bin/python benchmarks/prefix_cache.py
"""

from __future__ import annotations

import argparse
import random

from common import ensure_checkpoint, fmt_ms, machine_rows, median, print_table, use_all_cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="checkpoint folder to reuse or build (default: Tandem's cache)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--cached-len", type=int, default=1792, help="prefix length; a multiple of the block size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: the usable cores)")
    args = parser.parse_args()

    from cluster.offline.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    threads = use_all_cores(args.threads)
    model_dir, num_params = ensure_checkpoint(args.model_dir)
    llm = LLM(str(model_dir), dtype="float32", verbose=False, max_num_batched_tokens=args.prompt_len,
              max_model_len=4096, num_kv_blocks=4096, enable_prefix_caching=True, num_threads=threads)
    rng = random.Random(args.seed)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 8192) for _ in range(n)]

    def ttft(prompt: list[int]) -> tuple[float, int]:
        out = llm.generate([prompt], one_token)[0]
        return out.first_token_time - out.arrival_time, out.usage.cached_tokens

    prefix = tokens(args.cached_len)
    tail = args.prompt_len - args.cached_len
    ttft(tokens(args.prompt_len))  # warm-up: a full prompt
    ttft(prefix)  # populates the cache with the prefix
    ttft(prefix + tokens(tail))  # warm-up: the cached path

    rows, uncached, cached = [], [], []
    for rep in range(args.repeats):
        cold, cold_hits = ttft(tokens(args.prompt_len))
        warm, warm_hits = ttft(prefix + tokens(tail))
        if cold_hits != 0 or warm_hits != args.cached_len:
            print(f"WARNING: repetition {rep + 1}: cached_tokens {cold_hits} (uncached, want 0) and "
                  f"{warm_hits} (cached, want {args.cached_len})")
        uncached.append(cold)
        cached.append(warm)
        rows.append((rep + 1, fmt_ms(cold), fmt_ms(warm), warm_hits, f"{warm / cold:.3f}"))
        print(f"[bench] repetition {rep + 1}/{args.repeats}: uncached {fmt_ms(cold)}, cached {fmt_ms(warm)}", flush=True)

    print_table("Machine", machine_rows())
    print_table("Setup", [
        ("checkpoint", f"{model_dir} (Llama, {num_params:,} parameters, float32)"),
        ("prompt", f"{args.prompt_len} tokens; cached case shares the first {args.cached_len} ({tail} new)"),
        ("new tokens / prompt tokens", f"{tail / args.prompt_len:.3f} (the ratio if cost were linear in new tokens)"),
    ])
    print_table("TTFT per repetition", rows, ("rep", "uncached", "cached", "cached tokens", "cached/uncached"))
    ratio = median(cached) / median(uncached)
    print_table("TTFT", [
        ("uncached", fmt_ms(median(uncached)), fmt_ms(min(uncached))),
        ("prefix cached", fmt_ms(median(cached)), fmt_ms(min(cached))),
        ("ratio cached/uncached", f"{ratio:.3f}", f"{min(cached) / min(uncached):.3f}"),
    ], ("", "median", "best"))
    print(f"TTFT ratio (medians): {ratio:.3f} (goal < 0.2: {'met' if ratio < 0.2 else 'NOT met'})")


if __name__ == "__main__":
    main()
