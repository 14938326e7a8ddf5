"""A disaggregated cluster (1 prefill + 1 decode worker, the small test checkpoint) whose decode
workers draft with a model (the model itself: every greedy guess must be kept) and whose prefill
worker builds the draft's KV of each prompt beside the model's (``decode.speculative.draft_prompt_kv:
prefill``), through ``tandem up`` and the OpenAI HTTP API: the greedy texts are those of
``tandem run`` without speculation, the decode worker's draft is fed no prompt token (no catch-up
forward), every request's draft KV arrived with the model's, and no block stays held.
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import random_prompts, wait_for
from e2e_cluster import Cluster, tandem, topology

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16


def draft_status(cluster: Cluster) -> dict:
    code = ("import json; print(json.dumps({n: ray.get(ray.get_actor(n).status.remote())['draft'] "
            "for n in ('prefill-0', 'decode-0')}))")
    return json.loads(cluster.ray(code).strip().splitlines()[-1])


def test_the_prefill_worker_builds_the_drafts_prompt_kv_and_the_texts_are_those_without_speculation(
        checkpoint, tmp_path):
    model_dir = checkpoint("llama")
    prompts = random_prompts([12, 29, 50], seed=31)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                                          "ignore_eos": True}) + "\n" for i, p in enumerate(prompts)))
    result = tandem("run", "--model", str(model_dir), "--input", str(source), "--output", str(out), "--quiet",
                    "--num-kv-blocks", "64")
    assert result.returncode == 0, result.stderr
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert [(rows[str(i)]["error"], len(rows[str(i)]["token_ids"])) for i in range(3)] == [(None, MAX_TOKENS)] * 3
    expected = {i: row["text"] for i, row in rows.items()}

    speculative = {"method": "draft", "draft_model": str(model_dir), "num_tokens": 3, "adaptive": False,
                   "draft_prompt_kv": "prefill"}
    spec = topology("e2e-draft-kv", model_dir, decode={"speculative": speculative},
                    router={"local_prefill_max_tokens": 0})  # every prompt's KV travels
    cluster = Cluster("e2e-draft-kv", spec, tmp_path)
    try:
        before = draft_status(cluster)  # the workers' start-up profiles ran requests of their own
        with httpx.Client(timeout=120) as http:
            for index, prompt in enumerate(prompts):
                answer = http.post(f"{cluster.state['http']}/completions", json={
                    "model": model_dir.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True})
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["text"] == expected[str(index)]
        after = draft_status(cluster)
        decode = {k: after["decode-0"][k] - before["decode-0"][k] for k in after["decode-0"]}
        assert (decode["prompt_tokens_fed"], decode["prompts_received"]) == (0, len(prompts))
        assert decode["forwards"] > 0  # it guessed: with the prompt's draft KV it had not computed
        assert after["prefill-0"]["prompt_tokens_fed"] - before["prefill-0"]["prompt_tokens_fed"] == sum(
            len(p) for p in prompts)
        status = wait_for(lambda: (s := cluster.status()) and all(
            w["kv_blocks_used"] == 0 and w["running"] == 0 for w in s["workers"]) and s, 60, "every block to be free",
            every_s=0.5)
        speculation = next(w["speculation"] for w in status["workers"] if w["role"] == "decode")
        assert int(speculation["accepted_tokens"]) == int(speculation["proposed_tokens"]) > 0
    finally:
        cluster.down()
