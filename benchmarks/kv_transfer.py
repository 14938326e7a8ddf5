"""KV transfer throughput: our layer-by-layer transport against a bare torch.distributed send.

Two processes on this machine (this one sends, a Ray actor receives into its own paged
cache). For each prompt length, the KV of one request (the 30M benchmark model's shape:
8 layers, 4 KV heads of 64, float32, blocks of 16 tokens, scattered block ids on both sides)
goes over in two ways, alternating, several times each:

* ours: per layer, the request's blocks are packed out of the sender's cache, sent as one
  message, received and written into the receiver's (different) block ids;
* bare: one ``send`` of the same number of bytes from one tensor into one tensor.

Prints MB/s of both and their ratio (goal: ours >= 0.8x of bare).

    .venv/bin/python benchmarks/kv_transfer.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from common import machine_rows, median, print_table

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 64, 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prompts", type=int, nargs="+", default=[512, 2048, 8192])
    args = parser.parse_args()

    from cluster.kv_transfer.endpoint import KVEndpoint
    from cluster.kv_transfer.kv_blocks import pack_layer
    from cluster.kv_transfer.transport import create_transport
    from cluster.parallel.group import GroupSpec
    from cluster.ray_runtime import ensure_ray

    torch.set_num_threads(1)
    ray = ensure_ray("tandem-bench-kv")
    num_blocks = max(args.prompts) // BLOCK * 2 + 8
    shape = (LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    spec = GroupSpec("tandem-bench-kv", "transfer", 2, timeout_s=60)
    receiver = ray.remote(KVEndpoint).options(num_cpus=0.5).remote("torch_distributed", spec, 1, shape)
    sender = create_transport("torch_distributed", spec=spec, rank=0)
    cache = torch.randn(shape)
    rng = random.Random(0)
    rows = []
    tag = 0
    for prompt in args.prompts:
        n = prompt // BLOCK
        nbytes = LAYERS * 2 * n * BLOCK * KV_HEADS * HEAD_DIM * 4
        ours, bare = [], []
        for repeat in range(args.repeats):
            src = rng.sample(range(num_blocks), n)
            dst = rng.sample(range(num_blocks), n)
            started = time.perf_counter()
            done = receiver.receive_layers.remote(0, dst, 0, KV_HEADS, 60, tag)
            ids = torch.tensor(src)
            sends = [sender.send(pack_layer(cache, layer, ids, 0, KV_HEADS), 1, tag + layer) for layer in range(LAYERS)]
            for work in sends:
                work.wait(60)
            ray.get(done)
            ours.append(time.perf_counter() - started)
            tag += LAYERS

            flat = torch.randn(nbytes // 4)
            started = time.perf_counter()
            done = receiver.receive_raw.remote(0, flat.numel(), 60, tag)
            sender.send(flat, 1, tag).wait(60)
            ray.get(done)
            bare.append(time.perf_counter() - started)
            tag += 1
            print(f"[kv_transfer] {prompt} tokens: repeat {repeat + 1}/{args.repeats}", file=sys.stderr, flush=True)
        t_ours, t_bare = median(ours), median(bare)
        rows.append((f"{prompt} tokens", f"{nbytes / 2**20:.1f} MiB", f"{nbytes / t_ours / 1e6:,.0f}",
                     f"{nbytes / t_bare / 1e6:,.0f}", f"{t_bare / t_ours:.2f}x"))

    print_table("Machine", machine_rows())
    print_table(
        "KV transfer, prefill process -> decode process (gloo over loopback), median of "
        f"{args.repeats}; each includes a Ray call to post the receive",
        rows, ("request", "KV bytes", "ours MB/s", "bare send MB/s", "ours / bare"),
    )
    worst = min(float(r[-1].rstrip("x")) for r in rows)
    print(f"\nworst ratio ours / bare: {worst:.2f}x (goal >= 0.8x: {'met' if worst >= 0.8 else 'NOT met'})")
    ray.kill(receiver)
    return 0


if __name__ == "__main__":
    sys.exit(main())
