"""Starting a disaggregated cluster on real Ray: the KV budget is the node's, shared by every
rank placed there; a worker that cannot be placed, or whose engine fails to start, ends the
start with one line naming it and the setting to change, and leaves nothing running."""

from __future__ import annotations

import psutil
import pytest
import torch

from cluster.offline.disaggregated import DisaggregatedLLM, PoolResources
from cluster.engine.model_runner import device_memory_bytes
from cluster.runtime.ray_runtime import ensure_ray
from cluster.runtime.startup import ClusterStartError

pytestmark = pytest.mark.integration

CLUSTER = "tandem-startup-tests"


@pytest.fixture(scope="module")
def ray_session():
    ray = ensure_ray(CLUSTER, num_cpus=4)
    yield ray
    ray.shutdown()


def disaggregated(model_dir, **kwargs) -> DisaggregatedLLM:
    kwargs = {"max_num_batched_tokens": 96, "verbose": False, **kwargs}
    return DisaggregatedLLM.from_args(str(model_dir), cluster_name=CLUSTER, **kwargs)


def redis_servers() -> set[int]:
    """The redis-servers under this process; a child that exits while they are listed is none
    (a suite once caught one gone between the listing and its name)."""
    servers = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == "redis-server":
                servers.add(child.pid)
        except psutil.NoSuchProcess:
            continue
    return servers


@pytest.fixture(autouse=True)
def redis_before():
    """The redis-servers this process ran before the test (another test's session fixture)."""
    return redis_servers()


def assert_nothing_left(ray, redis_before: set[int]) -> None:
    """No placement group of this cluster holds resources, no worker actor lives, and no
    private redis-server the test started runs under this process."""
    from ray.util.placement_group import placement_group_table

    live = [t["name"] for t in placement_group_table().values()
            if t["name"].startswith(CLUSTER) and t["state"] != "REMOVED"]
    assert live == []
    assert [a for a in ray.util.list_named_actors() if a.startswith(("prefill-", "decode-", "router"))] == []
    assert redis_servers() - redis_before == set()


def test_ranks_on_one_node_share_its_kv_budget(checkpoint, ray_session):
    """Prefill TP 2 and decode TP 1 on one node: three CPU ranks, each sized to a third of
    kv_cache_memory_fraction of the node's memory, not the whole fraction each."""
    model_dir = checkpoint("llama")
    fraction = 0.0005
    with disaggregated(model_dir, prefill_tp=2, decode_tp=1, kv_cache_memory_fraction=fraction) as llm:
        assert llm.kv_shares == {"prefill-0": pytest.approx(1 / 3), "decode-0": pytest.approx(1 / 3)}
        described = {d["name"]: d for d in ray_session.get([w.describe.remote() for w in llm.prefill + llm.decode])}
    memory = device_memory_bytes(torch.device("cpu"))
    # A block holds 16 tokens of K and V for 2 layers of (KV heads of this rank) x 16 dims, float32.
    per_rank_heads = {"prefill-0": 1, "decode-0": 2}  # the model's 2 KV heads split over TP 2, or whole
    for name, heads in per_rank_heads.items():
        block_bytes = 2 * 2 * 16 * heads * 16 * 4
        assert described[name]["num_blocks"] == int(memory * (fraction * (1 / 3))) // block_bytes, name


def test_colocated_tensor_parallel_ranks_share_one_budget(checkpoint, ray_session):
    """`tandem run --tp 2` on one machine: both ranks come from one budget, half each."""
    from cluster.offline.llm import LLM

    fraction = 0.0005
    with LLM(str(checkpoint("llama")), verbose=False, tensor_parallel_size=2, cluster_name=CLUSTER,
             engine_name="colocated", kv_cache_memory_fraction=fraction) as llm:
        num_blocks = llm.engine.block_manager.num_blocks
    block_bytes = 2 * 2 * 16 * 1 * 16 * 4  # one of the 2 KV heads per rank
    assert num_blocks == int(device_memory_bytes(torch.device("cpu")) * fraction / 2) // block_bytes


def test_a_placement_no_node_can_hold_fails_at_once_naming_the_worker(checkpoint, ray_session, redis_before):
    model_dir = checkpoint("llama")
    nowhere = PoolResources(resources=(("tandem-test-no-such-node", 1.0),))
    with pytest.raises(ClusterStartError) as info:
        disaggregated(model_dir, pools={"decode": nowhere}, num_kv_blocks=32)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("cannot place decode-0: its rank needs 0.25 CPU, 1 tandem-test-no-such-node")
    assert "no node of the Ray cluster has that" in message and "--decode-tp or --decode-workers" in message
    assert_nothing_left(ray_session, redis_before)


def test_a_worker_whose_engine_cannot_allocate_its_kv_cache(checkpoint, ray_session, redis_before):
    """decode-0 is asked for a KV cache far beyond the machine (a billion blocks): its engine's
    allocation fails at start, and the start fails naming it and the setting, with nothing
    left running."""
    model_dir = checkpoint("llama")
    with pytest.raises(ClusterStartError) as info:
        disaggregated(model_dir, num_kv_blocks=32, role_args={"decode": {"num_kv_blocks": 10**9}})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("decode-0 ran out of memory while starting (")
    assert message.endswith("lower --num-kv-blocks (now 1000000000)")
    assert_nothing_left(ray_session, redis_before)


def test_a_worker_whose_engine_raises_at_start(checkpoint, ray_session, redis_before):
    """A setting the engine refuses (a context longer than the model's) fails the start with
    the engine's own message, for the worker it names."""
    model_dir = checkpoint("llama")
    with pytest.raises(ClusterStartError) as info:
        disaggregated(model_dir, num_kv_blocks=32, role_args={"prefill": {"max_model_len": 4096}})
    assert str(info.value) == ("prefill-0 failed to start: max_model_len 4096 exceeds the model's "
                               "max_position_embeddings 512")
    assert_nothing_left(ray_session, redis_before)
