"""Resize without losing a request: `tandem scale` on a running cluster (2 prefill workers, 1 decode
worker, the tiny random checkpoint) while streams run: a decode worker added, the first decode
worker drained and removed, a prefill worker moved to decode. Every one of at least 200 greedy
streams completes with `tandem run`'s tokens (none failed, repeated or lost), each resize step
overlaps streams in flight, the added workers serve, and afterwards no worker holds a KV block,
the registry holds no worker, key or block of the removed ones, the survivors hold no transfer
group with them, and `tandem status` shows the steps."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import redis

from cluster.deployment.scale_client import scale_cluster
from cluster.protocol.messages import ScaleRequest
from conftest import random_prompts, wait_for
from e2e_cluster import Cluster, tandem, topology
from tandem.client import TandemClient

pytestmark = pytest.mark.e2e

PROMPTS = random_prompts([20, 48, 90, 150], seed=26)  # past 32 tokens a prefill worker computes the KV
MAX_TOKENS = 32
CLIENTS = 6  # streams at once
AT_LEAST = 200  # streams in all (more while a resize step is still running, and a few after the last)
HANG_GUARD = 3000  # streams at most, whatever happens


@pytest.fixture(scope="module")
def model_dir(checkpoint) -> Path:
    return checkpoint("llama")


def reference_tokens(model_dir: Path, tmp: Path) -> list[list[int]]:
    """`tandem run`'s greedy tokens for each prompt (one engine, nothing disturbed)."""
    source, out = tmp / "in.jsonl", tmp / "out.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": p, "max_tokens": MAX_TOKENS,
                                          "temperature": 0, "ignore_eos": True}) + "\n" for i, p in enumerate(PROMPTS)))
    result = tandem("run", "--model", str(model_dir), "--input", str(source), "--output", str(out), "--quiet",
                    "--num-kv-blocks", "64")
    assert result.returncode == 0, result.stderr
    rows = {row["id"]: row["token_ids"] for row in map(json.loads, out.read_text().splitlines())}
    return [rows[str(i)] for i in range(len(PROMPTS))]


class Traffic:
    """``CLIENTS`` threads streaming the prompts in turn until told to stop (and at least
    ``AT_LEAST`` streams have ended); each stream's prompt, tokens, workers and times are kept."""

    def __init__(self, api: str):
        self.api = api
        self.done: list[dict] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CLIENTS)]

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= HANG_GUARD or (self.stop.is_set() and self._next >= AT_LEAST):
                return None
            self._next += 1
            return self._next - 1

    def _client(self) -> None:
        with TandemClient(self.api, timeout_s=300) as client:
            while (n := self._take()) is not None:
                which = n % len(PROMPTS)
                started = time.monotonic()
                try:
                    messages = list(client.generate(PROMPTS[which], max_tokens=MAX_TOKENS, temperature=0,
                                                    ignore_eos=True, slo_class="batch"))
                except Exception as exc:  # noqa: BLE001 - every failure is kept and fails the test
                    with self._lock:
                        self.errors.append(f"stream {n}: {exc}")
                    continue
                with self._lock:
                    self.done.append({"prompt": which, "tokens": [t for m in messages for t in m.token_ids],
                                      "decode": messages[-1].decode_worker, "prefill": messages[-1].prefill_worker,
                                      "started": started, "ended": time.monotonic()})

    def in_flight_during(self, start: float, end: float) -> int:
        """Streams that were running at some moment of [start, end]."""
        with self._lock:
            return sum(1 for r in self.done if r["started"] < end and r["ended"] > start)


def scale(cluster: Cluster, *args: str) -> tuple[float, float, str]:
    """One `tandem scale` step: (when it started, when it ended, what it printed)."""
    started = time.monotonic()
    result = tandem("scale", "--cluster", cluster.name, *args, env=cluster.env, timeout=600)
    assert result.returncode == 0, f"tandem scale {' '.join(args)}: {result.stderr}\n{cluster.log_tail()}"
    return started, time.monotonic(), result.stdout


def test_streams_survive_a_worker_added_one_drained_and_one_moved(model_dir, tmp_path, monkeypatch):
    reference = reference_tokens(model_dir, tmp_path)
    cluster = Cluster("e2e-scale", topology("e2e-scale", model_dir, prefill={"replicas": 2}, kv={"num_blocks": 160},
                                            router={"local_prefill_max_tokens": 32, "policy": "round_robin"}), tmp_path)
    try:
        traffic = Traffic(cluster.api)
        for thread in traffic.threads:
            thread.start()
        wait_for(lambda: len(traffic.done) >= 10 or traffic.errors, 120, "the first streams")
        steps = {"add": scale(cluster, "add", "decode"),
                 "remove": scale(cluster, "remove", "decode-0"),
                 "move": scale(cluster, "move", "prefill-1", "decode")}
        settled = len(traffic.done)  # then streams on the pools as they are now
        wait_for(lambda: len(traffic.done) >= settled + 4 * CLIENTS or traffic.errors, 300, "streams after the steps")
        traffic.stop.set()
        for thread in traffic.threads:
            thread.join(timeout=600)

        print(f"{len(traffic.done)} streams; " + ", ".join(f"{name} {end - start:.1f}s with "
                                                           f"{traffic.in_flight_during(start, end)} streams in flight"
                                                           for name, (start, end, _) in steps.items()))
        assert traffic.errors == []
        assert len(traffic.done) >= AT_LEAST
        wrong = [(r["prompt"], r["decode"]) for r in traffic.done if r["tokens"] != reference[r["prompt"]]]
        assert wrong == [], f"{len(wrong)} streams differ from `tandem run` (repeated or lost tokens)"
        for name, (start, end, _) in steps.items():
            assert traffic.in_flight_during(start, end) > 0, f"no stream ran while `scale {name}` did"
        assert "decode-1 added" in steps["add"][2]
        assert "decode-0 draining" in steps["remove"][2] and "decode-0 removed" in steps["remove"][2]
        assert "prefill-1 removed" in steps["move"][2] and "decode-2 added" in steps["move"][2]
        assert "pools now: prefill: prefill-0; decode: decode-1, decode-2" in steps["move"][2]
        served = {r["decode"] for r in traffic.done}
        assert {"decode-0", "decode-1", "decode-2"} <= served
        assert not [r for r in traffic.done if r["decode"] == "decode-0" and r["started"] > steps["remove"][1]]
        assert not [r for r in traffic.done if r["prefill"] == "prefill-1" and r["started"] > steps["move"][1]]

        live = ["prefill-0", "decode-1", "decode-2"]

        def every_block_free() -> bool:
            workers = cluster.status()["workers"]
            return [(w["name"], w["state"], w["drain"], w["kv_blocks_used"]) for w in workers] == [
                (name, "alive", "serving", 0) for name in live]

        wait_for(every_block_free, 60, "every live worker serving with no KV block in use")
        status = cluster.status()
        # the survivors left their transfer groups with the removed workers (and closed their ports)
        assert {w["name"]: w["transfer_groups"] for w in status["workers"]} == {
            "prefill-0": ["p0-d1", "p0-d2"], "decode-1": ["p0-d1"], "decode-2": ["p0-d2"]}
        events = [(e["event"], e["worker"]) for e in reversed(status["worker_events"])]
        # the move added first (there was room for both): the prefill pool never ran short
        assert events == [("added", "decode-1"), ("draining", "decode-0"), ("removed", "decode-0"),
                          ("added", "decode-2"), ("draining", "prefill-1"), ("removed", "prefill-1")]

        # What cannot be done is one line, and changes nothing: on the command line ...
        refused = tandem("scale", "--cluster", cluster.name, "remove", "prefill-0", env=cluster.env)
        assert (refused.returncode, refused.stderr) == (1, "tandem scale: worker: prefill-0 is the last prefill worker "
                                                           "of the decode workers; add another first (`tandem scale add "
                                                           "prefill`)\n")
        # ... and from Python
        monkeypatch.setenv("TANDEM_CACHE_DIR", str(cluster.cache))
        result = scale_cluster(cluster.name, ScaleRequest("remove", worker="decode-0"))
        assert (result.ok, result.message) == (False, "worker: 'decode-0' is not a worker of this cluster; its "
                                                      "workers: prefill-0, decode-1, decode-2")
        assert result.members == {"prefill": ["prefill-0"], "decode": ["decode-1", "decode-2"]}

        client = redis.Redis.from_url(cluster.state["registry_url"])
        try:
            prefix = "tandem:e2e-scale:"
            membership = json.loads(client.get(prefix + "membership"))
            assert (membership["prefill"], membership["decode"], membership["draining"]) == (
                ["prefill-0"], ["decode-1", "decode-2"], [])
            assert sorted(w.decode() for w in client.smembers(prefix + "workers")) == sorted(live)
            for gone in ("decode-0", "prefill-1"):
                assert not client.keys(f"{prefix}worker:{gone}:*")
            holders = set()
            for key in client.scan_iter(prefix + "block:*"):
                holders |= {w.decode() for w in client.hkeys(key)}
            assert holders <= set(live)
        finally:
            client.close()
    finally:
        cluster.down()
