"""Overload drill: ten times more concurrent streams than the cluster serves, half of them
interactive, through the real gRPC API, timed at the client.

A local cluster (``tandem up``: 1 prefill + 1 decode worker, the 30M benchmark model, decode
batches of at most ``--serves`` sequences) is driven by ``--serves x --overload`` concurrent
clients for ``--seconds``; each client sends a request, reads its stream to the end, and sends
the next (after ``--backoff-s`` when it was rejected, as a polite client would). Half the
clients send ``interactive`` requests (TTFT <= 1 s, rejected when the router predicts a miss),
half ``standard`` (queued until they can be placed).

Reported: requests completed and rejected per class, client-side TTFT p50/p90 of admitted
interactive requests and the share that met 1 s, and how soon rejections arrived. Goals:
>= 90% of admitted interactive requests meet 1 s at the client; rejections within 100 ms.

    .venv/bin/python benchmarks/overload.py           # about 2 minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import ensure_checkpoint, machine_rows, percentile, print_table
from local_cluster import LocalCluster, free_port, stop_on_sigterm

import grpc  # noqa: E402

from tandem.v1 import tandem_pb2, tandem_pb2_grpc  # noqa: E402

CLUSTER = "bench-overload"


@dataclass
class Outcome:
    slo_class: str
    sent: float
    first: float | None = None  # first response message at the client
    end: float | None = None
    code: str = "OK"
    message: str = ""


def topology(args, model_dir: Path) -> dict:
    return {
        "model": {"path": str(model_dir)}, "server": {"port": free_port(), "http_port": 0},
        "prefill": {"max_num_seqs": args.serves}, "decode": {"max_num_seqs": args.serves},
        "kv": {"num_blocks": 4096},
    }


async def client(stub, slo_class: str, deadline: float, args, rng: random.Random, out: list[Outcome]) -> None:
    while time.monotonic() < deadline:
        prompt = [rng.randrange(3, 8000) for _ in range(args.prompt_tokens)]
        request = tandem_pb2.GenerateRequest(token_ids=tandem_pb2.TokenIds(ids=prompt), slo_class=slo_class)
        request.sampling.max_tokens = args.output_tokens
        request.sampling.ignore_eos = True
        outcome = Outcome(slo_class, time.monotonic())
        out.append(outcome)
        try:
            async for _ in stub.Generate(request, timeout=120):
                if outcome.first is None:
                    outcome.first = time.monotonic()
        except grpc.aio.AioRpcError as exc:
            outcome.code = exc.code().name
            outcome.message = exc.details() or ""
        outcome.end = time.monotonic()
        if outcome.code == "RESOURCE_EXHAUSTED":
            await asyncio.sleep(args.backoff_s)


async def drive(api: str, args) -> list[Outcome]:
    out: list[Outcome] = []
    streams = args.serves * args.overload
    async with grpc.aio.insecure_channel(api) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        warm = tandem_pb2.GenerateRequest(token_ids=tandem_pb2.TokenIds(ids=[5] * args.prompt_tokens))
        warm.sampling.max_tokens = 2
        async for _ in stub.Generate(warm, timeout=300):
            pass
        deadline = time.monotonic() + args.seconds
        rng = random.Random(args.seed)
        tasks = [client(stub, "interactive" if i % 2 == 0 else "standard", deadline, args,
                        random.Random(rng.random()), out) for i in range(streams)]
        progress = asyncio.create_task(report_progress(out, deadline))
        await asyncio.gather(*tasks)
        progress.cancel()
    print(file=sys.stderr)
    return out


async def report_progress(out: list[Outcome], deadline: float) -> None:
    while True:
        await asyncio.sleep(2)
        done = sum(o.end is not None for o in out)
        left = max(0.0, deadline - time.monotonic())
        print(f"\r[bench] {done} requests answered, {left:.0f}s of sending left   ", end="", file=sys.stderr,
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serves", type=int, default=16, help="decode batch size (sequences the cluster serves)")
    parser.add_argument("--overload", type=int, default=10, help="concurrent streams per sequence it serves")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--backoff-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_dir, params = ensure_checkpoint()
    stop_on_sigterm()
    with LocalCluster(CLUSTER, topology(args, model_dir)) as cluster:
        outcomes = asyncio.run(drive(cluster.api, args))

    print_table("machine", machine_rows() + [("model", f"random Llama, {params / 1e6:.0f}M parameters"),
                                             ("streams", f"{args.serves * args.overload} concurrent "
                                                         f"({args.overload}x the {args.serves} it serves)")])
    rows = []
    for cls in ("interactive", "standard"):
        mine = [o for o in outcomes if o.slo_class == cls and o.end is not None]
        ok = [o for o in mine if o.code == "OK"]
        rejected = [o for o in mine if o.code == "RESOURCE_EXHAUSTED"]
        other = len(mine) - len(ok) - len(rejected)
        ttft = [o.first - o.sent for o in ok if o.first is not None]
        met = sum(t <= 1.0 for t in ttft) / len(ttft) if ttft else float("nan")
        reject_s = [o.end - o.sent for o in rejected]
        rows.append((cls, len(mine), len(ok), len(rejected), other, f"{percentile(ttft, 0.5) * 1e3:.0f}",
                     f"{percentile(ttft, 0.9) * 1e3:.0f}", f"{met:.0%}", f"{percentile(reject_s, 0.5) * 1e3:.1f}",
                     f"{percentile(reject_s, 0.9) * 1e3:.1f}", f"{max(reject_s, default=float('nan')) * 1e3:.1f}"))
    print_table("overload drill (client-side times)", rows,
                ("class", "sent", "completed", "rejected", "failed", "TTFT p50 ms", "TTFT p90 ms", "met 1 s",
                 "reject p50 ms", "reject p90 ms", "reject max ms"))
    failures: dict[str, int] = {}
    for o in outcomes:
        if o.code not in ("OK", "RESOURCE_EXHAUSTED"):
            failures[f"{o.slo_class} {o.code}"] = failures.get(f"{o.slo_class} {o.code}", 0) + 1
    if failures:
        print_table("failed requests by status", sorted(failures.items()), ("class and status", "requests"))
        for o in outcomes:
            if o.code not in ("OK", "RESOURCE_EXHAUSTED") and o.message:
                print(f"e.g. {o.code}: {o.message[:300]}")
                break
    interactive = rows[0]
    print(f"\ngoal: >= 90% of admitted interactive requests meet 1 s at the client: {interactive[7]}")
    print(f"goal: rejections within 100 ms: p90 {interactive[9]} ms")


if __name__ == "__main__":
    main()
