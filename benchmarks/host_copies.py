"""Host KV tier copies of one model's blocks: the time per block to offload (one gather, one
scatter) and to load back (layer by layer), made in this thread, and the load's wait through the
engine's load copier (a background thread on one torch thread: from queued to made) while this
thread runs a stand-in for other requests' steps (matrix products, one at a time, counted).

Default shape: the default model's (SmolLM2-135M: 30 layers, 3 KV heads of 64, a float32 cache
of 16-token blocks: 720 KiB a block; on a CPU the host tier holds 8-bit rows).

    .venv/bin/python benchmarks/host_copies.py [--blocks 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from common import machine_rows, median, print_table, use_all_cores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks a batch of copies moves")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch threads (default: the usable cores)")
    args = parser.parse_args()

    from cluster.default_model import default_model_config
    from cluster.engine.kv_tiers.copy_queue import CopyQueue
    from cluster.engine.kv_tiers.host_pool import Load, Offload
    from cluster.engine.kv_tiers.host_store import HostKVStore, host_block_bytes, host_format
    from cluster.engine.quantization.kv_format import KVCacheFormat

    threads = use_all_cores(args.threads)
    config = default_model_config("float32")
    device_format = KVCacheFormat("auto", torch.float32)
    fmt = host_format(device_format, "cpu")
    n = args.blocks
    cache = torch.randn(config.num_layers, 2, 2 * n, args.block_size, config.num_kv_heads, config.head_dim)
    store = HostKVStore(cache, device_format, fmt, n, config.head_dim)
    offloads = [Offload(block, block) for block in range(n)]
    loads = [Load(slot, n + slot) for slot in range(n)]

    def timed(fn) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    offload_s = median([timed(lambda: store.offload(offloads)) for _ in range(args.repeats)])
    torch.set_num_threads(1)  # as the engine's load copier: a layer's ops are small, and two threads
    load_s = median([timed(lambda: store.load(loads)) for _ in range(args.repeats)])  # wait on each other
    torch.set_num_threads(threads)
    copier = CopyQueue(store.load, name="kv-host-loads", torch_threads=1)  # as the engine's
    a = torch.randn(256, 256)
    waits, steps = [], []
    for _ in range(args.repeats):
        job = copier.submit(loads)
        count = 0
        while not job.done.is_set():  # other requests' steps, meanwhile
            a @ a
            count += 1
        waits.append(job.wait_seconds)
        steps.append(count)
    copier.close()
    alone = timed(lambda: [a @ a for _ in range(200)]) / 200

    print_table("machine", machine_rows() + [("torch threads", str(threads))])
    block_bytes = host_block_bytes(device_format, config.num_layers, args.block_size, config.num_kv_heads,
                                   config.head_dim)
    print_table("shape", [("model", f"{config.architecture}, {config.num_layers} layers, {config.num_kv_heads} KV heads "
                                    f"of {config.head_dim}"),
                          ("block", f"{args.block_size} tokens, {block_bytes / 2**10:.0f} KiB on the device, "
                                    f"{fmt.name} on the host"),
                          ("batch", f"{n} blocks, median of {args.repeats}")])
    per_block = lambda s: f"{s / n * 1000:.2f} ms"  # noqa: E731
    print_table("per block", [
        (f"offload (this thread, {threads} torch threads)", per_block(offload_s)),
        ("load, layer by layer (this thread, 1 torch thread)", per_block(load_s)),
        ("load through the copier (1 torch thread): queued to made", per_block(median(waits))),
        ("  meanwhile, 256x256 products run here", f"{median(steps):.0f} ({median(steps) * alone * 1000:.0f} ms "
                                                  f"of them alone)"),
    ])


if __name__ == "__main__":
    main()
