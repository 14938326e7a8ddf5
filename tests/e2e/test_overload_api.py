"""Overload through the real APIs: a request the router predicts would wait past its bound is
answered at once with HTTP 429 (``Retry-After``, ``retry-after-ms``, OpenAI's one-line error
body) or gRPC RESOURCE_EXHAUSTED (``retry-after`` and ``grpc-retry-pushback-ms`` trailing
metadata); the requests it keeps complete; the rejections are counted per class in ``tandem
status``; and no KV block is left in use.

One cluster (1 prefill + 1 decode worker of the small test checkpoint) whose decode worker takes
at most 2 sequences: two long streams fill it, and a ``standard`` request with a 300 ms TTFT
objective (so a 300 ms bound) would wait for one of them to end, thousands of steps away.
"""

from __future__ import annotations

import json
import re
import threading

import grpc
import httpx
import pytest

from conftest import random_prompts, wait_for
from e2e_cluster import Cluster, topology
from tandem import TandemClient, TandemError
from tandem.v1 import tandem_pb2, tandem_pb2_grpc

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    spec = topology("e2e-overload", checkpoint("llama", max_position_embeddings=8192),
                    decode={"max_num_seqs": 2}, kv={"num_blocks": 1200})
    cluster = Cluster("e2e-overload", spec, tmp)
    yield cluster
    if (cluster.cache / "clusters" / "e2e-overload.json").exists():
        cluster.down()


def completion(prompt: list[int], max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def test_a_request_that_would_wait_past_its_bound_is_refused_at_once_with_retry_after(cluster):
    url = cluster.state["http"]
    model = httpx.get(f"{url}/models", timeout=30).json()["data"][0]["id"]
    long_prompts = random_prompts([20, 20], seed=5)
    started = [threading.Event() for _ in long_prompts]  # 50 tokens in: the router has decode steps to go by
    stop = threading.Event()

    def long_stream(i: int) -> None:  # holds a decode slot until told to hang up
        body = {**completion(long_prompts[i], 8000), "model": model, "stream": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/completions", json=body) as events:
            tokens = 0
            for line in events.iter_lines():
                tokens += line.startswith("data: {")
                if tokens >= 50:
                    started[i].set()
                if stop.is_set():
                    return

    streams = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(len(long_prompts))]
    for thread in streams:
        thread.start()
    try:
        for event in started:
            assert event.wait(120), "a long stream never started"
        probe = random_prompts([12], seed=6)[0]
        refused = httpx.post(f"{url}/completions", timeout=60, json={
            **completion(probe, 8), "model": model, "slo_class": "standard", "ttft_ms": 300})
        assert refused.status_code == 429, f"placed, the router's view: {cluster.status()['router']}"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "\n" not in error["message"]
        assert error["message"].startswith("rejected by admission control: predicted to wait ")
        assert "past its bound of 300 ms" in error["message"]
        retry_ms = int(refused.headers["retry-after-ms"])
        predicted = re.search(r"predicted to wait (\d+) ms more", error["message"])
        if predicted is not None:
            assert abs(retry_ms - int(predicted.group(1))) <= 1  # the wait it predicted (the message rounds it)
        else:  # the router's latest report predates the streams' decode steps: no pace to go by
            assert error["message"].startswith("rejected by admission control: predicted to wait with no end in sight")
            assert retry_ms == 300  # the class's bound
        assert int(refused.headers["Retry-After"]) == -(-retry_ms // 1000)

        with grpc.insecure_channel(cluster.api) as channel:
            request = tandem_pb2.GenerateRequest(token_ids=tandem_pb2.TokenIds(ids=probe), slo_class="standard",
                                                 objectives=tandem_pb2.Objectives(ttft_ms=300))
            request.sampling.max_tokens = 8
            with pytest.raises(grpc.RpcError) as exhausted:
                list(tandem_pb2_grpc.TandemStub(channel).Generate(request, timeout=60))
        assert exhausted.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(exhausted.value.trailing_metadata())
        assert "predicted to wait" in exhausted.value.details()
        with TandemClient(cluster.api, timeout_s=60) as client, pytest.raises(TandemError) as told:
            list(client.generate(probe, max_tokens=8, slo_class="standard", ttft_ms=300))
        assert told.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and told.value.retry_after_s > 0
        assert int(trailers["retry-after"]) == -(-int(trailers["grpc-retry-pushback-ms"]) // 1000)
    finally:
        stop.set()
        for thread in streams:
            thread.join(60)

    kept = [None] * 3

    def keep(i: int) -> None:  # 3 requests for 2 slots: one waits for a slot within its 5 s, then runs
        kept[i] = httpx.post(f"{url}/completions", timeout=120, json={
            **completion(random_prompts([10], seed=10 + i)[0], 16), "model": model, "slo_class": "standard"})

    wait_for(lambda: cluster.status()["workers"] and all(w["running"] == 0 for w in cluster.status()["workers"]),
             60, "the long streams to end", every_s=0.2)
    threads = [threading.Thread(target=keep, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert [r.status_code for r in kept] == [200, 200, 200], [r.text for r in kept if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in kept)

    status = wait_for(lambda: (s := cluster.status()) and all(
        w["kv_blocks_used"] == 0 and w["running"] == 0 for w in s["workers"]) and s["in_flight"] == 0 and s,
        60, "every block to be free", every_s=0.5)
    assert status["router"]["rejected_by_class"] == {"standard": 3}
    assert json.loads(json.dumps(status))["queued"] == 0
