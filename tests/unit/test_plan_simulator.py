"""The simulator against hand-computed cases: fixed step times, one worker (or one pair), every
time worked out by hand from the step-time model and the request path's messages."""

import argparse
from dataclasses import replace

import pytest

from cluster.bench.arrivals import Arrivals
from cluster.bench.workloads import Session, Turn, Workload
from cluster.plan.roofline import MODELS, hardware, step_model, worker_spec
from cluster.plan.search import candidates, search, topology_for
from cluster.plan.simulator import REPORT_INTERVAL_S, Pools, SimConfig, WorkerSpec, simulate, step_seconds
from cluster.plan.step_models import Profile, RoleProfile, StepCollector, hop_from_corrections
from cluster.registry.load import StepSample, WorkerLoad
from cluster.topology import default_topology, parse_topology
from router.config import RouterConfig
from router.cost_model import StepTimeModel

pytestmark = pytest.mark.unit

# prefill step: 10 ms + 1 ms per token; decode step: 20 ms whatever the batch
FIXED = StepTimeModel(prefill=(0.01, 0.001, 0.0), decode=(0.02, 0.0, 0.0), transfer_s_per_block=0.0,
                      max_num_batched_tokens=2048)


def workload(*prompts, max_tokens=5, at=None) -> Workload:
    sessions = tuple(Session(f"r{i}", (Turn(tuple(p), max_tokens),), at_s=None if at is None else at[i])
                     for i, p in enumerate(prompts))
    return Workload(sessions, "hand-made", has_timestamps=at is not None)


def tokens(n, start=20):
    return list(range(start, start + n))


def run(pools, w, arrivals=None, **config):
    return simulate(pools, w, arrivals or Arrivals("constant", rate=1.0), SimConfig(**config))


def test_one_colocated_worker_one_request():
    result = run(Pools(colocated=(1, WorkerSpec(FIXED, 1000))), workload(tokens(100)))
    [r] = result.results
    assert r.ttft_s == pytest.approx(0.010 + 0.100)  # one prefill step of 100 tokens
    assert r.tpot_s == pytest.approx(0.020)  # four decode steps
    assert r.e2e_s == pytest.approx(0.110 + 4 * 0.020)
    assert r.completion_tokens == 5 and r.placement == ("", "colocated-0")


def test_workers_report_their_load_as_the_simulation_runs():
    """Three requests a second apart: the workers publish load reports (``EngineWorker._snapshot_held``
    on the simulated workers, every ``REPORT_INTERVAL_S``) all the while, and each request is
    served as on an idle worker. (A snapshot that called a metric the simulated workers lack
    once broke every simulation longer than a report interval: the live planner's and
    ``tandem plan``'s.)"""
    result = run(Pools(colocated=(1, WorkerSpec(FIXED, 1000))), workload(tokens(100), tokens(100, 500),
                                                                          tokens(100, 900)))
    assert [r.ttft_s for r in result.results] == [pytest.approx(0.110)] * 3
    assert result.results[-1].sent_at >= 2.0 > 10 * REPORT_INTERVAL_S


def test_a_request_arriving_mid_step_waits_for_it_then_shares_a_mixed_step():
    both = workload(tokens(100), tokens(100, 500), max_tokens=3, at=[0.0, 0.0])
    a, b = run(Pools(colocated=(1, WorkerSpec(FIXED, 1000))), both, Arrivals("trace")).results
    # step 1: a's prefill (0.11); step 2: b's prefill with a's decode (0.02 + 0.1 = 0.12);
    # step 3: both decode (0.02); step 4: b's last decode (0.02)
    assert a.ttft_s == pytest.approx(0.110) and b.ttft_s == pytest.approx(0.230)
    assert a.e2e_s == pytest.approx(0.250) and b.e2e_s == pytest.approx(0.270)


def test_shared_cores_slow_a_step_by_the_threads_wanting_a_core():
    alone = WorkerSpec(FIXED, 1000, threads=4)  # 4 threads on 2 shared cores: every step twice as long
    [r] = run(Pools(colocated=(1, alone)), workload(tokens(100)), shared_cores=2).results
    assert r.ttft_s == pytest.approx(2 * 0.110) and r.tpot_s == pytest.approx(2 * 0.020)
    # two 2-thread workers on 2 cores, a request each at once: both prefill steps run side by
    # side at half speed (4 threads / 2 cores) and end together; without shared cores, both 1x
    pair = Pools(colocated=(2, WorkerSpec(FIXED, 1000, threads=2)))
    both = workload(tokens(100), tokens(100, 500), max_tokens=1, at=[0.0, 0.0])
    first, second = run(pair, both, Arrivals("trace"), shared_cores=2).results
    assert {first.placement[1], second.placement[1]} == {"colocated-0", "colocated-1"}
    assert [first.ttft_s, second.ttft_s] == pytest.approx([2 * 0.110, 2 * 0.110])
    assert [r.ttft_s for r in run(pair, both, Arrivals("trace")).results] == pytest.approx([0.110, 0.110])


def test_a_long_step_slows_while_a_later_short_one_overlaps_it():
    """Processor sharing: a step's slowdown follows the steps beside it as they come and go, not
    the ones there when it started. Three 1-thread workers on 2 cores: a 1,000-token prefill
    (1.01 s alone) from 0, another from 0, a 90-token one from 0.5 s (0.1 s alone)."""
    spec = WorkerSpec(FIXED, 2000)
    pools = Pools(colocated=(3, spec))
    w = workload(tokens(1000), tokens(1000, 3000), tokens(90, 6000), max_tokens=1, at=[0.0, 0.0, 0.5])
    long_a, long_b, short = run(pools, w, Arrivals("trace"), shared_cores=2).results
    assert {long_a.placement[1], long_b.placement[1], short.placement[1]} == {
        "colocated-0", "colocated-1", "colocated-2"}
    # 0-0.5 s: two steps on two cores, full speed (0.51 s of each long step left). From 0.5 s:
    # three threads on two cores, each at 2/3: the short step's 0.1 s takes 0.15 s (to 0.65 s),
    # the long ones do 0.1 s of work in it (0.41 s left), then full speed again: 0.65 + 0.41.
    assert short.ttft_s == pytest.approx(0.1 / (2 / 3))
    assert [long_a.ttft_s, long_b.ttft_s] == pytest.approx([0.65 + 0.41, 0.65 + 0.41])
    # the rule it replaced (a step's slowdown fixed when it started) had the long steps at 1.01 s


def test_chunked_prefill_splits_the_prompt_by_the_token_budget():
    spec = WorkerSpec(FIXED, 1000, max_num_batched_tokens=64)
    [r] = run(Pools(colocated=(1, spec)), workload(tokens(100))).results
    assert r.ttft_s == pytest.approx((0.010 + 0.064) + (0.010 + 0.036))


def test_disaggregated_pair_pays_the_transfer_tail_and_five_messages():
    model = StepTimeModel(FIXED.prefill, FIXED.decode, transfer_s_per_block=0.001, max_num_batched_tokens=2048)
    spec = WorkerSpec(model, 1000)
    config = {"hop_s": 0.001, "router": RouterConfig(local_prefill_max_tokens=0)}  # always a prefill worker
    [r] = run(Pools(prefill=(1, spec), decode=(1, spec)), workload(tokens(100)), **config).results
    # the call to the ingress (placed there), dispatch, prefill call, prefill (100 tokens, 7 blocks' tail),
    # result back, token to client
    assert r.ttft_s == pytest.approx(5 * 0.001 + 0.110 + 7 * 0.001)
    assert r.tpot_s == pytest.approx(0.020)
    assert r.placement == ("prefill-0", "decode-0")


def test_short_prompts_may_be_prefilled_on_the_decode_worker():
    slow_prefill = WorkerSpec(StepTimeModel((0.01, 0.002, 0.0), None, 0.0, 2048), 1000)
    [r] = run(Pools(prefill=(1, slow_prefill), decode=(1, WorkerSpec(FIXED, 1000))), workload(tokens(40))).results
    # 40 <= local_prefill_max_tokens and faster here: conditional disaggregation, no prefill worker
    assert r.placement == ("", "decode-0")
    assert r.ttft_s == pytest.approx(0.010 + 0.040)
    long = workload(tokens(400))
    [r] = run(Pools(prefill=(1, slow_prefill), decode=(1, WorkerSpec(FIXED, 1000))), long).results
    assert r.placement == ("prefill-0", "decode-0")  # too long to prefill locally
    assert r.ttft_s == pytest.approx(0.010 + 0.800)


def test_a_shared_prefix_hits_the_worker_cache():
    shared = tokens(96)
    w = workload(shared + tokens(4, 900), shared + tokens(4, 950))
    first, second = run(Pools(colocated=(1, WorkerSpec(FIXED, 1000))), w).results
    assert first.cached_tokens == 0 and second.cached_tokens == 96  # six full blocks of 16
    assert second.ttft_s == pytest.approx(0.010 + 0.004)


def test_admission_rejects_what_no_idle_worker_can_meet():
    slow = StepTimeModel((0.01, 0.02, 0.0), FIXED.decode, 0.0, 2048)  # 100 tokens: 2 s of prefill
    w = Workload((Session("r0", (Turn(tuple(tokens(100)), 5),), slo_class="interactive"),), "hand-made")
    [r] = run(Pools(colocated=(1, WorkerSpec(slow, 1000))), w).results
    assert r.error.startswith("RESOURCE_EXHAUSTED") and "even an idle cluster cannot meet" in r.error


def test_a_later_turn_carries_the_answer_and_hits_the_cache():
    session = Session("c", (Turn(tuple(tokens(64)), 17), Turn(tuple(tokens(8, 700)), 2)), think_s=0.5)
    first, second = run(Pools(colocated=(1, WorkerSpec(FIXED, 1000))), Workload((session,), "chat")).results
    assert second.prompt_tokens == 64 + 17 + 8
    assert second.cached_tokens == 80  # the prompt and 16 of the answer: five full blocks
    assert second.sent_at == pytest.approx(first.finished_at + 0.5)


def test_step_seconds_adds_both_sides_of_a_mixed_step():
    assert step_seconds(FIXED, 10, 0, 3, 100) == pytest.approx(0.02 + 0.010)
    assert step_seconds(FIXED, 0, 0, 3, 100) == pytest.approx(0.02)


def test_search_sizes_the_smallest_topology_meeting_attainment_and_writes_a_valid_topology():
    spec = WorkerSpec(FIXED, 1000)
    w = workload(*[tokens(100, 20 + i) for i in range(20)], max_tokens=8)
    pools = candidates(lambda role, tp: spec, max_ranks=3)
    assert {p.label() for p in pools} == {"1P+1D", "1P+2D", "2P+1D", "1C", "2C", "3C"}
    best, ranked = search(pools, w, Arrivals("poisson", rate=2.0), None, SimConfig())
    assert best.pools.label() == "1C" and best.attainment == 1.0
    topology = topology_for(default_topology(), best.pools)
    parsed = parse_topology(topology.to_yaml(), model_elsewhere=True)
    assert (parsed.colocated.replicas, parsed.prefill.replicas, parsed.decode.replicas) == (1, 0, 0)


def test_profiles_fit_the_routers_model_and_round_trip(tmp_path):
    steps = tuple(StepSample(n, n * n, 0, 0, 0.01 + 0.001 * n) for n in (16, 64, 256, 512)) + \
        tuple(StepSample(0, 0, b, ctx, 0.02 + 0.002 * b + 0.00001 * ctx) for b, ctx in ((1, 50), (2, 400), (4, 100),
                                                                                      (8, 900)))
    profile = Profile("test", {"decode": RoleProfile("decode", 1, 500, 16, 2048, 32, 4096, steps)}, hop_s=0.002)
    loaded = Profile.load(profile.save(tmp_path / "p.json"))
    assert loaded == profile
    spec = loaded.spec("colocated")  # a decode worker's engine stands for a colocated one
    assert spec.model.prefill_seconds(100) == pytest.approx(0.01 + 0.1, rel=1e-6)
    assert spec.model.decode_step_seconds(3, 100) == pytest.approx(0.02 + 0.006 + 0.001, rel=1e-6)
    assert spec.num_blocks == 500 and spec.max_num_seqs == 32


def test_step_collector_keeps_only_new_steps_of_overlapping_reports():
    def load(steps):
        return WorkerLoad("d", "decode", 0, 0, 0, 0, 0, 10, 10, 16, 2048, 8, tuple(steps))

    s = [StepSample(0, 0, i, i, 0.01) for i in range(6)]
    collector = StepCollector()
    collector.add({"d": load(s[:4])})
    collector.add({"d": load(s[2:6])})
    assert collector.steps["d"] == s


def test_hop_from_the_routers_corrections():
    assert hop_from_corrections({"remote": 0.008, "local": 0.004}) == pytest.approx(0.002)
    assert hop_from_corrections({"remote": -0.01, "local": 0.0}) == 0.0


def test_roofline_decode_reads_weights_and_kv():
    shape = MODELS["llama-3-8b"]
    model = step_model(hardware("h100"), shape, tp=1)
    idle = model.decode_step_seconds(1, 0)
    assert idle == pytest.approx(0.004 + 8.03e9 * 2 / (3.35e12 * 0.8), rel=0.01)
    # the KV of 100k context tokens adds its bytes over the bandwidth
    extra = model.decode_step_seconds(1, 100_000) - idle
    assert extra == pytest.approx(100_000 * shape.kv_bytes_per_token / (3.35e12 * 0.8), rel=1e-6)
    assert step_model(hardware("h100"), shape, tp=2).decode_step_seconds(1, 0) < idle


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3"])
def test_roofline_counts_the_kv_bytes_of_the_cache_dtype(cache_dtype):
    """Llama-3-8B (32 layers, 8 KV heads, head dim 128): 2 x 32 x 8 x 128 x 2 = 131,072 bytes a
    token in 16 bits; 2 x 32 x 8 x (128 + 4) = 67,584 in 8 bits (codes and a float32 scale a row).
    The blocks that fit, the KV a decode step reads and a transfer's tail all follow."""
    hw, wide = hardware("h100"), MODELS["llama-3-8b"]
    narrow = replace(wide, kv_cache_dtype=cache_dtype)
    assert wide.kv_bytes_per_token == 131_072 and narrow.kv_bytes_per_token == 67_584
    free = 80e9 * 0.9 - 8.03e9 * 2  # memory_fraction 0.9, less the 16-bit weights
    assert worker_spec(hw, wide).num_blocks == int(free // (16 * 131_072)) == 26_674
    assert worker_spec(hw, narrow).num_blocks == int(free // (16 * 67_584)) == 51_731
    bandwidth = 3.35e12 * 0.8
    assert step_model(hw, narrow).decode[2] == pytest.approx(67_584 / bandwidth, rel=1e-12)
    assert step_model(hw, narrow).transfer_s_per_block == pytest.approx(16 * 67_584 / 32 / 50e9, rel=1e-12)


def test_a_roofline_plan_takes_the_topologys_cache_dtype():
    from cluster.cli.plan import _spec_source

    args = argparse.Namespace(from_cluster=None, profile=None, hardware="h100", model_shape="llama-3-8b")
    blocks = {}
    for cache_dtype in ("auto", "int8"):
        spec = parse_topology(f"model:\n  max_model_len: 4096\nkv:\n  cache_dtype: {cache_dtype}\n")
        spec_for = _spec_source(args, spec, None)[0]
        blocks[cache_dtype] = spec_for("decode", 1).num_blocks
    assert blocks == {"auto": 26_674, "int8": 51_731}
