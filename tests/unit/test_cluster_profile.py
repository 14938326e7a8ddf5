"""benchmarks/cluster_profile.py: how a sample's stack is bucketed, and how a thread's CPU is
split over its own samples (a thread py-spy takes for busy while it waits weighs its CPU)."""

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import cluster_profile  # noqa: E402
from cluster_profile import Profile, bucket  # noqa: E402


def stack(*frames: str) -> list[str]:
    return list(frames)


def test_plumbing_is_transparent_so_the_caller_names_the_bucket():
    redis_write = stack("serve (cluster/ingress/request_path.py:1)", "place (router/router.py:2)",
                        "execute (redis/asyncio/client.py:3)", "write (asyncio/selector_events.py:4)")
    assert bucket(redis_write) == "registry / Redis"
    sampler = stack("step (cluster/engine/engine.py:1)", "sample (cluster/engine/sampler.py:2)",
                    "softmax (torch/nn/functional.py:3)")
    assert bucket(sampler) == "sampling"
    forward = stack("step (cluster/engine/engine.py:1)", "forward (torch/nn/modules/linear.py:2)")
    assert bucket(forward) == cluster_profile.ENGINE


def test_a_stack_of_plumbing_alone_falls_back_on_its_leaf():
    assert bucket(stack("run_forever (asyncio/base_events.py:1)", "select (selectors.py:2)")) == cluster_profile.IO
    assert bucket(stack("mm (torch/functional.py:1)")) == cluster_profile.ENGINE
    assert bucket(stack("run (threading.py:1)")) == cluster_profile.OTHER


def test_each_thread_s_cpu_is_split_over_its_own_samples():
    profile = Profile()
    cpu = {1: ("ray::IDLE", 2.0), 2: ("worker.io", 0.5), 3: ("ray::Main", 0.0)}
    samples = Counter({"thread (1): ray::IDLE;a (asyncio/base_events.py:1);b (router/router.py:2)": 3,
                       "thread (1): ray::IDLE;c (selectors.py:3)": 1,
                       "thread (3): ray::Main;main_loop (ray/_private/worker.py:1)": 50})
    profile.add_cell(cpu, samples)
    assert profile.bucket_s["router placement"] == 1.5
    assert profile.bucket_s[cluster_profile.IO] == 0.5
    assert profile.bucket_s["Ray / Serve runtime"] == 0.0  # sampled often, but it spent no CPU
    assert profile.unsampled_s == Counter({"worker.io": 0.5})
    assert profile.cpu_s == 2.5
