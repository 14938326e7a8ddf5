"""Where a decode step's time goes on one GPU, for the model of ``gpu_decode.py``.

For each batch size: the engine's whole decode step (median wall time), the captured graph's
replay alone (device events), the logits and sampling after it, and a torch.profiler summary
of a few decode steps (kernels per step and their device time, grouped by name).

    python benchmarks/gpu_decode_profile.py --batches 1,64
    python benchmarks/gpu_decode_profile.py --batches 1 --enforce-eager
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import positive_ints  # (importing common puts the repository on sys.path)

import torch

from gpu_decode import BLOCK_SIZE, LLAMA3_8B, make_prompts


def event_ms(fn, repeats: int = 30) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=positive_ints, default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25, help="profiler table rows")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-overrides", type=json.loads, default={}, help="JSON: config fields to change")
    args = parser.parse_args()

    from cluster.offline.llm import LLM
    from cluster.engine.sampling_params import SamplingParams

    largest = max(args.batches)
    max_len = args.context + 256
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps({**LLAMA3_8B, **args.model_overrides}))
        llm = LLM(folder, verbose=False, dtype="bfloat16", device=args.device, load_format="dummy",
                  block_size=BLOCK_SIZE, max_num_seqs=largest, max_model_len=max_len,
                  num_kv_blocks=largest * -(-max_len // BLOCK_SIZE) + 16,
                  max_num_batched_tokens=8192, enable_prefix_caching=False, enforce_eager=args.enforce_eager)
    engine, runner = llm.engine, llm.engine.runner
    for batch in args.batches:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        vocab = {**LLAMA3_8B, **args.model_overrides}["vocab_size"]
        for i, prompt in enumerate(make_prompts(batch, args.context, seed=batch)):
            prompt = [t % vocab for t in prompt]
            engine.add_request(f"p{batch}-{i}", prompt, params)
        while True:
            engine.step()
            last = engine.stats.steps[-1]
            if last.num_prefill_tokens == 0 and last.num_decode_tokens == batch:
                break
        for _ in range(5):
            engine.step()
        walls = []
        for _ in range(20):
            started = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - started)
        line = f"batch {batch}: engine step {statistics.median(walls) * 1e3:.3f} ms (median of 20)"
        graphs = runner.graphs
        bucket = graphs.bucket_for(batch) if graphs else None
        if graphs is not None and bucket in graphs.graphs:
            graph = graphs.graphs[bucket]
            replay = event_ms(graph.replay)
            hidden = graphs.outputs[bucket][:batch]
            logits_ms = event_ms(lambda: runner.model.compute_logits(hidden))
            line += f"; graph replay {replay:.3f} ms; lm_head {logits_ms:.3f} ms"
        print(line, flush=True)
        from torch.profiler import ProfilerActivity, profile

        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
        averages = prof.key_averages()
        try:
            table = averages.table(sort_by="self_device_time_total", row_limit=args.rows)
        except (AttributeError, KeyError, ValueError):
            table = averages.table(sort_by="self_cuda_time_total", row_limit=args.rows)
        print(f"--- profile of {args.profile_steps} decode steps at batch {batch} ---")
        print(table, flush=True)
        for i in range(batch):
            engine.abort_request(f"p{batch}-{i}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
