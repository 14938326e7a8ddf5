"""``tandem bench`` and ``tandem plan`` against a real cluster: a handful of requests measured
through the gRPC API and through the OpenAI-compatible HTTP API (bounded), the registry's steps fitted into a profile, a plan searched
from it whose topology ``tandem validate`` accepts, and the plan's record of how far its last
prediction was from what was measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e_cluster import cache_sharing_builds

pytestmark = pytest.mark.e2e

_SCRIPT = Path(sys.executable).parent / "tandem"
TANDEM = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "cluster.cli.main"]
NAME = "t-bench-plan"
WORKLOAD = ["--num-requests", "6", "--input-len", "20-60", "--output-len", "4-8", "--goodput", "ttft_ms:60000",
            "tpot_ms:60000", "--duration", "120"]


def tandem(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


@pytest.fixture(scope="module")
def cluster(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-plan")
    env = {"TANDEM_CACHE_DIR": str(cache_sharing_builds(tmp / "cache"))}
    topology = {"cluster": {"name": NAME}, "model": {"path": str(checkpoint("llama"))},
                "server": {"port": 0, "http_port": 0},
                "kv": {"num_blocks": 256}, "prefill": {"max_num_seqs": 8}, "decode": {"max_num_seqs": 8},
                "ray": {"num_cpus": 2}}
    path = tmp / "topology.yaml"
    path.write_text(yaml.safe_dump(topology))
    result = tandem("up", "--topology", str(path), "--detach", env=env, timeout=600)
    assert result.returncode == 0, result.stderr
    try:
        yield tmp, env
    finally:
        tandem("down", "--cluster", NAME, env=env)


def test_bench_measures_a_running_cluster(cluster):
    tmp, env = cluster
    out = tmp / "bench.json"
    result = tandem("bench", "--cluster", NAME, "--rate", "4", "--json", str(out), "--plot-dir", str(tmp / "plots"),
                    *WORKLOAD, env=env)
    assert result.returncode == 0, result.stderr
    assert "goodput:" in result.stdout and "TTFT" in result.stdout
    run = json.loads(out.read_text())["rates"][0]
    summary = run["summary"]
    assert summary["requests"] == 6 and summary["completed"] == 6, summary["errors"]
    assert summary["goodput"]["attainment"] == 1.0  # objectives of a minute: every request meets them
    assert summary["ttft"]["count"] == 6 and summary["tpot"]["count"] <= 6  # TPOT: see the OpenAI test below
    requests = run["requests"]
    assert all(4 <= r["completion_tokens"] <= 8 and r["placement"][1] == "decode-0" for r in requests)
    assert (tmp / "plots" / "latency_cdf.png").stat().st_size > 0


def test_bench_measures_the_clusters_openai_api(cluster):
    tmp, env = cluster
    out = tmp / "bench-openai.json"
    result = tandem("bench", "--cluster", NAME, "--api", "openai", "--vocab-size", "500", "--rate", "4",
                    "--json", str(out), *WORKLOAD, env=env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(out.read_text())["rates"][0]["summary"]
    assert summary["completed"] == 6, summary["errors"]
    # TPOT needs two chunks with tokens: a stream whose tokens all came in one (a lagging reader gets
    # them batched) has none, so how many have one is the machine's business.
    assert summary["tpot"]["count"] <= 6 and summary["prefix_cache_hit_rate"] is not None  # usage from the last chunk
    assert summary["output_token_throughput"] > 0


def test_plan_from_the_cluster_writes_a_topology_that_validates(cluster):
    tmp, env = cluster
    profile, plan = tmp / "profile.json", tmp / "plan.yaml"
    result = tandem("plan", "--from-cluster", NAME, "--save-profile", str(profile), "--rate", "4", "--max-ranks", "2",
                    "--output", str(plan), "--quiet", *WORKLOAD, env=env)
    assert result.returncode == 0, result.stderr
    assert "simulated topologies" in result.stdout and "predicted" in result.stdout
    saved = json.loads(profile.read_text())
    assert set(saved["roles"]) == {"prefill", "decode"} and saved["roles"]["decode"]["steps"]
    text = plan.read_text()
    assert text.startswith("# tandem plan (cluster t-bench-plan")
    validated = tandem("validate", str(plan), env=env)
    assert validated.returncode == 0, validated.stderr


def test_plan_says_how_far_its_last_prediction_was(cluster):
    tmp, env = cluster
    profile = tmp / "profile.json"
    if not profile.exists():  # run on its own: fit the profile as the test before does
        saved = tandem("plan", "--from-cluster", NAME, "--save-profile", str(profile), "--rate", "4",
                       "--max-ranks", "2", "--quiet", *WORKLOAD, env=env)
        assert saved.returncode == 0, saved.stderr
    base = tmp / "topology.yaml"
    first = tandem("plan", "--profile", str(profile), "--topology", str(base), "--evaluate", "--rate", "3",
                   *WORKLOAD, env=env)
    assert first.returncode == 0, first.stderr
    measured = tandem("bench", "--cluster", NAME, "--rate", "3", "--quiet", *WORKLOAD, env=env)
    assert measured.returncode == 0, measured.stderr
    again = tandem("plan", "--profile", str(profile), "--topology", str(base), "--evaluate", "--rate", "3",
                   *WORKLOAD, env=env)
    assert again.returncode == 0, again.stderr
    assert "1P+1D: last time at 3 req/s" in again.stdout and "measured" in again.stdout


def test_bench_usage_errors_name_the_flag(cluster):
    _, env = cluster
    for args, flag in ((["--cluster", NAME], "--rate"), (["--cluster", NAME, "--rate", "1", "--goodput", "ttft:1"],
                                                          "--goodput"),
                       (["--rate", "1"], "one target"), (["--cluster", NAME, "--rate", "1", "--input-len", "0"],
                                                         "--input-len")):
        result = tandem("bench", *args, env=env)
        assert result.returncode == 2 and flag in result.stderr and len(result.stderr.strip().splitlines()) == 1
