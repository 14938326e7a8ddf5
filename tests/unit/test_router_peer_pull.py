"""When the router has a worker pull a prompt's prefix from a peer's cache rather than compute
it: exact predictions from hand-made step models (prefill step = 10 ms + 1 ms a token)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.registry.kv_index import TierHits
from cluster.registry.load import StepSample, WorkerLoad
from router.candidates import Prompt
from router.config import RouterConfig
from router.cost_model import DEFAULT_HOST_LOAD_S_PER_BLOCK, DEFAULT_PULL_S_PER_BLOCK, StepTimeModel, pulled_prefill_seconds
from router.peer_pull import PeerPull, best_pull
from router.router import RouteRequest, Router, Topology

pytestmark = pytest.mark.unit

BS = 4
NOW = 1000.0
PREFILL_STEPS = tuple(StepSample(n, 0, 0, 0, 0.010 + 0.001 * n) for n in (16, 64, 256))
DECODE_STEPS = tuple(StepSample(0, 0, s, c, 0.020 + 0.005 * s + 0.0001 * c) for s, c in ((1, 100), (2, 400), (4, 300)))
# A step that prefilled 32 tokens and then waited 16 ms for 8 blocks' sends: 2 ms a block sent.
SENT_STEP = StepSample(32, 0, 0, 0, 0.010 + 0.032 + 0.016, kv_blocks_sent=8, transfer_tail_s=0.016)
PROMPT = list(range(100, 133))  # 33 tokens: 8 cacheable blocks of 4
COMPUTE = StepTimeModel.fit(PREFILL_STEPS, 2048)
SENDER = StepTimeModel.fit(PREFILL_STEPS + (SENT_STEP,), 2048)


def test_the_default_costs_are_what_the_arithmetic_below_assumes():
    assert (DEFAULT_PULL_S_PER_BLOCK, DEFAULT_HOST_LOAD_S_PER_BLOCK) == (0.004, 0.003)
    assert COMPUTE.pull_s_per_block == 0.004 and SENDER.pull_s_per_block == pytest.approx(0.002)


def test_a_pull_costs_its_blocks_sent_the_peers_host_loads_and_the_rest_computed():
    # 8 blocks on the peer's device, none here: 8 x 2 ms sent + 1 token computed (10 + 1 ms).
    assert pulled_prefill_seconds(COMPUTE, SENDER, 33, BS, TierHits(0), TierHits(8)) == pytest.approx(0.027)
    # 4 of them on its host tier: 4 x 3 ms loaded there first.
    assert pulled_prefill_seconds(COMPUTE, SENDER, 33, BS, TierHits(0), TierHits(4, 4)) == pytest.approx(0.039)
    # 2 held here: only 6 travel, and of the peer's host blocks (2..7 of 2 device + 6 host) all 6.
    assert pulled_prefill_seconds(COMPUTE, SENDER, 33, BS, TierHits(2), TierHits(2, 6)) == pytest.approx(
        6 * 0.003 + 6 * 0.002 + 0.011)
    # A peer holding no more than here: plain computation after what is held (25 tokens).
    assert pulled_prefill_seconds(COMPUTE, SENDER, 33, BS, TierHits(2), TierHits(2)) == pytest.approx(0.035)


def test_a_pull_wins_only_where_it_is_predicted_sooner_than_computing():
    prompt = Prompt.of(33, 8, BS)
    models = {"fast": SENDER, "unmeasured": COMPUTE}
    compute = COMPUTE.prefill_seconds(33)  # 43 ms
    # Measured sends: 27 ms < 43 ms.
    assert best_pull(COMPUTE, TierHits(0), ["fast"], {"fast": TierHits(8)}, models, prompt) == PeerPull(
        "fast", 8, pytest.approx(0.027))
    # The default 4 ms a block: 32 + 11 ms = 43 ms, a tie, and a tie computes (a pull can fail).
    assert pulled_prefill_seconds(COMPUTE, COMPUTE, 33, BS, TierHits(0), TierHits(8)) == pytest.approx(compute)
    assert best_pull(COMPUTE, TierHits(0), ["unmeasured"], {"unmeasured": TierHits(8)}, models, prompt) is None
    # Six of eight on the peer's host: 18 + 16 + 11 = 45 ms > 43 ms.
    assert best_pull(COMPUTE, TierHits(0), ["fast"], {"fast": TierHits(2, 6)}, models, prompt) is None
    # Of two peers, the one predicted sooner.
    assert best_pull(COMPUTE, TierHits(0), ["unmeasured", "fast"], {"fast": TierHits(6), "unmeasured": TierHits(8)},
                     models, prompt).source == "fast"


def test_the_receivers_measured_pulls_price_the_blocks_before_the_senders_sends():
    """A decode worker that has pulled reports what its pulls took per block, from the ask to the
    last block (``WorkerLoad.pull_s_per_block``): that prices its next pulls, not the sender's
    sends or the default."""
    prompt = Prompt.of(33, 8, BS)
    models = {"fast": SENDER, "unmeasured": COMPUTE}
    # 1 ms a block measured: 8 + 11 ms, where the default 4 ms tied computation (43 ms) and lost.
    assert pulled_prefill_seconds(COMPUTE, COMPUTE, 33, BS, TierHits(0), TierHits(8), 0.001) == pytest.approx(0.019)
    assert best_pull(COMPUTE, TierHits(0), ["unmeasured"], {"unmeasured": TierHits(8)}, models, prompt,
                     measured_s_per_block=0.001) == PeerPull("unmeasured", 8, pytest.approx(0.019))
    # 5 ms a block measured: 40 + 11 ms, where the sender's 2 ms sends predicted 27: it computes.
    assert best_pull(COMPUTE, TierHits(0), ["fast"], {"fast": TierHits(8)}, models, prompt,
                     measured_s_per_block=0.005) is None


def colocated(worker: str, running: int = 0, pull_from: tuple[str, ...] = (), steps=PREFILL_STEPS + DECODE_STEPS):
    return WorkerLoad(worker, "colocated", 0, running, 0, 0, 0, 100, 100, BS, 2048, 16, steps, NOW - 0.01,
                      pull_from=pull_from)


class Registry:
    def __init__(self, loads, hits):
        self.state, self.hits = loads, hits

    def loads(self, workers):
        return {w: self.state[w] for w in workers if w in self.state}

    def prefix_tiers(self, hashes, workers):
        return {w: self.hits.get(w, TierHits(0)) for w in workers}

    def loads_and_prefix_tiers(self, workers, hashes):
        return self.loads(workers), self.prefix_tiers(hashes, workers)


@pytest.mark.parametrize("pull_from, source, ttft", [(("c1",), "c1", 0.027), ((), None, 0.043)])
def test_a_worker_that_can_pull_from_a_full_peer_is_placed_with_the_peer_as_its_kv_source(pull_from, source, ttft):
    """c1 holds the whole prefix but has no free slot; c0 holds none of it: placed on c0, which
    pulls the 8 blocks where it has a pair with c1 (27 ms predicted), else computes them (43 ms)."""
    topology = Topology(prefill=(), decode=(), colocated=("c0", "c1"), block_size=BS)
    loads = {"c0": colocated("c0", pull_from=pull_from),
             "c1": colocated("c1", running=16, steps=PREFILL_STEPS + DECODE_STEPS + (SENT_STEP,))}
    router = Router(topology, Registry(loads, {"c1": TierHits(8)}), RouterConfig.from_mapping({"policy": "slo"}))
    decision = router.route(RouteRequest("r", PROMPT, max_tokens=8), now=NOW)
    assert (decision.action, decision.prefill, decision.decode) == ("place", None, "c0")
    assert (decision.kv_source, decision.kv_source_blocks) == (source, 8 if source else 0)
    assert decision.predicted_ttft_s == pytest.approx(ttft)


def test_the_router_prices_a_pull_by_the_receivers_reported_pulls():
    """As above with c1's sends unmeasured (the default 4 ms a block ties computation): c0's
    reported pulls at 1 ms a block make the pull sooner (19 ms), and it is chosen."""
    topology = Topology(prefill=(), decode=(), colocated=("c0", "c1"), block_size=BS)
    unmeasured = {"c0": colocated("c0", pull_from=("c1",)), "c1": colocated("c1", running=16)}
    router = Router(topology, Registry(unmeasured, {"c1": TierHits(8)}), RouterConfig.from_mapping({"policy": "slo"}))
    assert router.route(RouteRequest("r", PROMPT, max_tokens=8), now=NOW).kv_source is None
    measured = {**unmeasured, "c0": replace(unmeasured["c0"], pull_s_per_block=0.001)}
    router = Router(topology, Registry(measured, {"c1": TierHits(8)}), RouterConfig.from_mapping({"policy": "slo"}))
    decision = router.route(RouteRequest("r", PROMPT, max_tokens=8), now=NOW)
    assert (decision.decode, decision.kv_source, decision.kv_source_blocks) == ("c0", "c1", 8)
    assert decision.predicted_ttft_s == pytest.approx(0.019)
