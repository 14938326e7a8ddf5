"""KV tiers on the engines alone, in one process: multi-turn conversations whose KV is ~4x the
workers' device caches, on 2 engines, tiers off against a host tier against host + peer pulls,
side by side in one run (``benchmarks/kv_tiers.py`` measures them through the whole cluster).

Each conversation's turn is its whole history plus a new user message; turns go round the
conversations, so a conversation comes back after the others have evicted it from the device
cache. Two engines (the benchmark's random Llama) serve in this process, stepped in turn; each
publishes its KV events (with their tier) to a real Redis (bundled binary, loopback), and each
turn is placed by the registry's prefix lookup by tier and the router's cost model
(``StepTimeModel.tiered_prefill_seconds`` fitted to each engine's steps, plus the prefill queued
on it): the registry and cost-model half of the router, not its admission or queue. Measured:
prefix hit rate (cached prompt tokens over cacheable ones), TTFT p50/p90, goodput (turns per
second meeting the TTFT and TPOT objectives). With host + peer, a turn may also be placed on a
worker that pulls the prefix the other worker caches (either tier) before computing the rest,
where ``router/peer_pull.py``'s ``best_pull`` predicts it sooner: the engines' pull path
(``reserve_pull``, ``pin_prefix``, ``send_blocks``, ``admit_pull``) over the in-process KV transport
(both engines share this process; between processes the same path runs over gloo), timed in the
turn's TTFT.

    .venv/bin/python benchmarks/kv_tiers_engine.py
"""

from __future__ import annotations

import argparse
import random
import time

from common import ensure_checkpoint, fmt_ms, machine_rows, percentile, print_table, use_all_cores


def run_mode(model_dir: str, host_cache: int | None, args, threads: int, redis_url: str, peer: bool = False) -> dict:
    import redis

    from cluster.engine.block_hash import cacheable_prefix_blocks, hash_token_blocks, request_hash_keys
    from cluster.engine.config import EngineConfig
    from cluster.engine.engine import LLMEngine
    from cluster.engine.sampling_params import SamplingParams
    from cluster.registry.kv_index import KVIndexPublisher, KVIndexReader
    from cluster.kv_transfer.agent import PairLayout, TransferAgent
    from cluster.kv_transfer.in_process_transport import InProcessTransport
    from cluster.kv_transfer.transports import register_transport
    from cluster.parallel.group import GroupSpec
    from cluster.parallel.tp_runner import engine_runner
    from cluster.registry.load import StepSample
    from router.candidates import Prompt
    from router.cost_model import StepTimeModel
    from router.peer_pull import best_pull

    cluster = f"kvtiers-{host_cache or 0}-{int(peer)}"
    client = redis.Redis.from_url(redis_url)
    names = [f"decode-{i}" for i in range(args.workers)]
    engines = {w: LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=args.device_blocks,
                                         block_size=args.block_size, max_num_seqs=args.concurrency,
                                         max_num_batched_tokens=1024, host_cache=host_cache,
                                         num_threads=threads, engine_name=w), verbose=False,
                            make_runner=engine_runner(kv_port=TransferAgent) if peer else None) for w in names}
    pairs = {}  # (sender, receiver) -> the pair's name
    if peer:
        register_transport(InProcessTransport)
        for sender in names:
            for receiver in names:
                if sender != receiver:
                    name = pairs[sender, receiver] = f"{cluster}-{sender}-to-{receiver}"
                    layout = PairLayout(name, 1, 1, engines[sender].model_config.num_kv_heads, InProcessTransport.name)
                    spec = GroupSpec(cluster, name, 2)
                    engines[sender].runner.join_transfer(layout, spec, True)
                    engines[receiver].runner.join_transfer(layout, spec, False)
    pulls = {"pulls": 0, "blocks": 0, "seconds": 0.0, "failed": 0, "no_room": 0}

    def pull_and_add(receiver: str, sender: str, rid: str, prompt: list[int], blocks: int) -> None:
        """The turn's prefix pulled from ``sender``'s cache into ``receiver``, which computes the rest."""
        started = time.perf_counter()
        reserved = engines[receiver].reserve_pull(rid, prompt, params, blocks)
        if reserved is None:  # its blocks are short now (this wave's reserves hold them): computed there
            engines[receiver].add_request(rid, prompt, params)
            pulls["no_room"] += 1
            return
        first, dst = reserved
        pinned = engines[sender].pin_prefix(prompt, first, blocks)
        error = engines[sender].send_blocks(pairs[sender, receiver], rid, pinned, 0, 10.0) if pinned else None
        error = error or (engines[receiver].receive_transfer(pairs[sender, receiver], rid, dst[:len(pinned)], 0, 10.0)
                          if pinned else None)
        engines[sender].unpin(pinned)
        engines[receiver].admit_pull(rid, 0 if error else len(pinned))
        pulls["pulls"] += 1
        pulls["failed"] += error is not None
        pulls["blocks"] += 0 if error else len(pinned)
        pulls["seconds"] += time.perf_counter() - started
    publishers = {w: KVIndexPublisher(client, cluster, w, heartbeat_ttl_s=600) for w in names}
    reader = KVIndexReader(client, cluster)
    rng = random.Random(args.seed)
    histories = [[rng.randrange(3, 8000) for _ in range(args.system_tokens)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    keys = request_hash_keys(engines[names[0]].scheduler.extra_hash_keys, None)

    def model_of(w: str) -> StepTimeModel:
        steps = [StepSample(s.num_prefill_tokens, s.prefill_attention, s.num_decode_tokens, s.context_tokens,
                            s.seconds, host_loaded_blocks=s.host_loaded_blocks, host_load_s=s.host_load_s)
                 for s in list(engines[w].stats.steps)[-64:]]
        return StepTimeModel.fit(steps, 1024)

    results = []  # (ttft, tpot, cached tokens, cacheable tokens)
    turns = [(turn, c) for turn in range(args.turns) for c in range(args.conversations)]
    started = time.perf_counter()
    for wave in range(0, len(turns), args.concurrency * args.workers):
        placed: dict[str, list[int]] = {w: [] for w in names}
        prompts = {}
        for turn, c in turns[wave:wave + args.concurrency * args.workers]:
            prompt = histories[c] + [rng.randrange(3, 8000) for _ in range(args.user_tokens)]
            hashes = hash_token_blocks(prompt, args.block_size, keys)[:cacheable_prefix_blocks(len(prompt),
                                                                                             args.block_size)]
            hits = reader.prefix_tiers(hashes, names)
            models = {w: model_of(w) for w in names}
            shape = Prompt.of(len(prompt), args.answer_tokens, args.block_size)
            pull = {w: best_pull(models[w], shape.hit_blocks(hits, w), [q for q in names if q != w], hits, models, shape)
                    if peer else None for w in names}
            cost = {w: (pull[w].seconds if pull[w] else
                        models[w].tiered_prefill_seconds(len(prompt), args.block_size, hits[w]))
                    + models[w].prefill_seconds(sum(placed[w])) for w in names}
            best = min(names, key=lambda w: (cost[w], len(placed[w]), w))
            rid = f"c{c}-t{turn}"
            if pull[best] is not None:
                pull_and_add(best, pull[best].source, rid, prompt, pull[best].blocks)
            else:
                engines[best].add_request(rid, prompt, params)
            placed[best].append(len(prompt))
            prompts[rid] = (c, prompt)
        while any(e.has_unfinished_requests() for e in engines.values()):
            for w, engine in engines.items():
                if not engine.has_unfinished_requests():
                    continue
                for out in engine.step():
                    if out.finished:
                        c, prompt = prompts[out.request_id]
                        histories[c] = prompt + list(out.token_ids)
                        ttft = out.first_token_time - out.arrival_time
                        tpot = (out.finish_time - out.first_token_time) / max(1, len(out.token_ids) - 1)
                        cacheable = cacheable_prefix_blocks(len(prompt), args.block_size) * args.block_size
                        results.append((ttft, tpot, out.usage.cached_tokens, cacheable))
                publishers[w].publish(engine.block_manager.drain_events())
    wall = time.perf_counter() - started
    for engine in engines.values():
        engine.shutdown()
    ttfts = [r[0] for r in results]
    met = sum(1 for ttft, tpot, _, _ in results if ttft <= args.ttft_ms / 1000 and tpot <= args.tpot_ms / 1000)
    stats = [e.stats for e in engines.values()]
    return {
        "hit_rate": sum(r[2] for r in results) / max(1, sum(r[3] for r in results)),
        "p50": percentile(ttfts, 0.5), "p90": percentile(ttfts, 0.9), "goodput": met / wall, "met": met,
        "turns": len(results), "wall": wall,
        "loaded": sum(s.host_loaded_blocks for s in stats), "offloaded": sum(s.host_offloaded_blocks for s in stats),
        "written_back": sum(s.host_written_back_blocks for s in stats),
        "sync_copy_s": sum(s.host_copy_seconds for s in stats),
        "load_wait_s": sum(s.host_load_seconds for s in stats),
        **pulls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="checkpoint folder to reuse or build (default: Tandem's cache)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=64, help="each conversation's first message")
    parser.add_argument("--user-tokens", type=int, default=48, help="each later message")
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=0,
                        help="KV blocks per worker (default: the conversations' final KV / 4 / workers)")
    parser.add_argument("--host-blocks", type=int, default=0, help="host tier blocks per worker (default: 4x device)")
    parser.add_argument("--concurrency", type=int, default=4, help="turns in flight per worker")
    parser.add_argument("--ttft-ms", type=float, default=500.0)
    parser.add_argument("--tpot-ms", type=float, default=200.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: the usable cores)")
    args = parser.parse_args()

    from cluster.registry.local_redis import LocalRedis

    threads = use_all_cores(args.threads)
    model_dir, num_params = ensure_checkpoint(args.model_dir)
    final_tokens = args.system_tokens + (args.turns - 1) * (args.user_tokens + args.answer_tokens) + args.user_tokens
    total_blocks = args.conversations * -(-final_tokens // args.block_size)
    if not args.device_blocks:
        args.device_blocks = max(final_tokens // args.block_size + 2, total_blocks // 4 // args.workers)
    host_blocks = args.host_blocks or 4 * args.device_blocks
    with LocalRedis() as local:
        off = run_mode(str(model_dir), None, args, threads, local.url)
        host = run_mode(str(model_dir), host_blocks, args, threads, local.url)
        peer = run_mode(str(model_dir), host_blocks, args, threads, local.url, peer=True)

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "n/a"

    print_table("machine", machine_rows() + [("torch threads", str(threads)),
                                             ("model", f"{model_dir.name} ({num_params / 1e6:.0f}M params)")])
    print_table("workload", [
        ("conversations x turns", f"{args.conversations} x {args.turns} on {args.workers} workers"),
        ("final KV / device caches", f"{total_blocks} blocks / {args.workers} x {args.device_blocks} = "
                                     f"{total_blocks / (args.workers * args.device_blocks):.1f}x"),
        ("host tier", f"{host_blocks} blocks per worker"),
        ("objectives", f"TTFT <= {args.ttft_ms:.0f} ms, TPOT <= {args.tpot_ms:.0f} ms"),
    ])
    rows = []
    for label, key, fmt in [("prefix hit rate", "hit_rate", lambda v: f"{v:.1%}"), ("TTFT p50", "p50", fmt_ms),
                            ("TTFT p90", "p90", fmt_ms), ("goodput (turns/s)", "goodput", lambda v: f"{v:.2f}")]:
        rows.append((label, fmt(off[key]), fmt(host[key]), fmt(peer[key]), ratio(host[key], off[key]),
                     ratio(peer[key], off[key])))
    rows.append(("turns meeting both", f"{off['met']}/{off['turns']}", f"{host['met']}/{host['turns']}",
                 f"{peer['met']}/{peer['turns']}", "", ""))
    rows.append(("wall", f"{off['wall']:.1f} s", f"{host['wall']:.1f} s", f"{peer['wall']:.1f} s",
                 ratio(host["wall"], off["wall"]), ratio(peer["wall"], off["wall"])))
    rows.append(("host blocks loaded / offloaded", "-", f"{host['loaded']} / {host['offloaded']}",
                 f"{peer['loaded']} / {peer['offloaded']}", "", ""))
    rows.append(("of which written back ahead", "-", f"{host['written_back']}", f"{peer['written_back']}", "", ""))
    rows.append(("copies on the step's path", "-", f"{host['sync_copy_s'] * 1000:.0f} ms",
                 f"{peer['sync_copy_s'] * 1000:.0f} ms", "", ""))
    rows.append(("loads' waits, queued to made (off it)", "-", f"{host['load_wait_s'] * 1000:.0f} ms",
                 f"{peer['load_wait_s'] * 1000:.0f} ms", "", ""))
    rows.append(("peer pulls (failed, no room) / blocks pulled", "-", "-",
                 f"{peer['pulls']} ({peer['failed']}, {peer['no_room']}) / {peer['blocks']}", "", ""))
    rows.append(("pull time, all pulls", "-", "-", f"{peer['seconds'] * 1000:.0f} ms", "", ""))
    print_table("tiers off vs host tier vs host + peer pulls", rows,
                headers=("", "tiers off", "host", "host + peer", "host / off", "host + peer / off"))
    print("goals (issue 27, with host + peer): hit rate >= 2x, p90 TTFT <= 0.5x, goodput >= 1.5x of tiers off.")


if __name__ == "__main__":
    main()
