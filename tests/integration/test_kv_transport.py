"""The torch.distributed KV transport between two processes (this one and a Ray actor), layer
by layer into scattered blocks, and what a sender sees when its receiver dies."""

from __future__ import annotations

import time

import pytest
import torch

from cluster.kv_transfer.agent import PairLayout, TransferAgent
from cluster.kv_transfer.endpoint import KVEndpoint
from cluster.kv_transfer.kv_blocks import pack_layer
from cluster.kv_transfer.sender import layer_tag
from cluster.kv_transfer.transport import TransportError
from cluster.kv_transfer.transports import create_transport
from cluster.parallel.group import GroupSpec
from cluster.runtime.ray_runtime import ensure_ray

pytestmark = pytest.mark.integration

CLUSTER = "tandem-transport-tests"
SHAPE = (4, 2, 32, 16, 2, 8)  # layers, k/v, blocks, block size, kv heads, head dim


@pytest.fixture(scope="module")
def ray():
    ray = ensure_ray(CLUSTER, num_cpus=4)
    yield ray
    ray.shutdown()


def start_endpoint(ray, spec: GroupSpec):
    return ray.remote(KVEndpoint).options(num_cpus=0.25).remote("torch_distributed", spec, 1, SHAPE)


def test_layers_arrive_in_the_receivers_own_blocks(ray):
    spec = GroupSpec(CLUSTER, "transfer-ok", 2, timeout_s=30)
    receiver = start_endpoint(ray, spec)
    sender = create_transport("torch_distributed", spec=spec, rank=0)
    source = torch.randn(SHAPE)
    src_blocks, dst_blocks = [5, 17, 2, 30], [0, 9, 31, 4]
    done = receiver.receive_layers.remote(0, dst_blocks, 0, SHAPE[4], 30)
    sends = [sender.send(pack_layer(source, layer, torch.tensor(src_blocks), 0, SHAPE[4]), peer=1, tag=layer_tag(0, layer))
             for layer in range(SHAPE[0])]
    for work in sends:
        work.wait(30)
    ray.get(done)
    assert torch.equal(ray.get(receiver.blocks.remote(dst_blocks)), source[:, :, src_blocks])
    assert ray.get(receiver.untouched_sum.remote(dst_blocks)) == 0
    ray.kill(receiver)


def test_a_pair_left_frees_its_rendezvous_port_for_a_group_of_the_same_name(ray):
    """Leaving a pair's group (a worker removed by a resize: ``TransferAgent.leave``) closes it
    and lets its rendezvous store go: a group of the same name, on the same port, builds again
    and carries KV (a store still held would keep the port, and the second rendezvous fail)."""
    spec = GroupSpec(CLUSTER, "transfer-left", 2, timeout_s=30)
    agent = TransferAgent(torch.randn(SHAPE), tp_rank=0)
    layout = PairLayout("p0-d0", 1, 1, SHAPE[4], "torch_distributed")
    for _ in range(2):
        receiver = start_endpoint(ray, spec)
        agent.join(layout, spec, prefill_side=True)
        _, transport = agent.pairs["p0-d0"]
        done = receiver.receive_layers.remote(0, [1, 2], 0, SHAPE[4], 30)
        for layer in range(SHAPE[0]):
            message = pack_layer(agent.kv_cache, layer, torch.tensor([3, 4]), 0, SHAPE[4])
            transport.send(message, peer=1, tag=layer_tag(0, layer)).wait(30)
        ray.get(done)
        assert torch.equal(ray.get(receiver.blocks.remote([1, 2])), agent.kv_cache[:, :, [3, 4]])
        del transport
        agent.leave("p0-d0")
        assert agent.pairs == {}
        ray.kill(receiver)
    agent.leave("p0-d0")  # a pair not joined (any more) is no error


def test_heads_from_two_senders_fill_one_receiver(ray):
    """Re-sharding on the way: two messages of two heads each land in one cache's head ranges."""
    shape = (2, 2, 8, 4, 4, 8)
    spec = GroupSpec(CLUSTER, "transfer-heads", 2, timeout_s=30)
    receiver = ray.remote(KVEndpoint).options(num_cpus=0.25).remote("torch_distributed", spec, 1, shape)
    sender = create_transport("torch_distributed", spec=spec, rank=0)
    source = torch.randn(shape)
    blocks = [1, 6]
    for first_head, tag_base in ((0, 0), (2, 100)):
        done = receiver.receive_layers.remote(0, blocks, first_head, 2, 30, tag_base)
        for layer in range(shape[0]):
            message = pack_layer(source, layer, torch.tensor(blocks), first_head, 2)
            sender.send(message, peer=1, tag=layer_tag(tag_base, layer)).wait(30)
        ray.get(done)
    assert torch.equal(ray.get(receiver.blocks.remote(blocks)), source[:, :, blocks])
    ray.kill(receiver)


def test_sender_fails_within_its_deadline_when_the_receiver_dies(ray):
    spec = GroupSpec(CLUSTER, "transfer-dies", 2, timeout_s=30)
    receiver = start_endpoint(ray, spec)
    sender = create_transport("torch_distributed", spec=spec, rank=0)
    ray.kill(receiver)
    big = torch.randn(64, 1024, 1024)  # 256 MiB: more than socket buffers hold
    started = time.monotonic()
    with pytest.raises(TransportError, match="send of .* bytes to rank 1 failed"):
        sender.send(big, peer=1, tag=0).wait(timeout_s=5)
    assert time.monotonic() - started < 20


def test_unknown_transport_names_the_known_ones():
    with pytest.raises(TransportError, match="unknown KV transport 'rdma'; known: torch_distributed"):
        create_transport("rdma")


def test_prefill_streams_each_layer_while_later_layers_compute(ray, checkpoint):
    """A real prefill with a KVSender on the layer hook: every layer is posted during the
    forward pass, and the receiver ends with exactly the prefill engine's KV blocks."""
    from cluster.offline.llm import LLM
    from cluster.engine.sampling_params import SamplingParams
    from cluster.kv_transfer.sender import Destination, KVSender
    from cluster.kv_transfer.state import TransferRecord, TransferState

    with LLM(str(checkpoint("qwen2")), verbose=False, num_kv_blocks=32) as llm:
        engine, runner = llm.engine, llm.engine.runner
        shape = tuple(runner.kv_cache.shape)
        spec = GroupSpec(CLUSTER, "transfer-prefill", 2, timeout_s=30)
        receiver = ray.remote(KVEndpoint).options(num_cpus=0.25).remote("torch_distributed", spec, 1, shape)
        transport = create_transport("torch_distributed", spec=spec, rank=0)
        request = engine.add_request("r", list(range(3, 43)), SamplingParams(temperature=0, max_tokens=1))
        record = TransferRecord.start("r", num_layers=shape[0], timeout_s=30)
        sender = KVSender(transport, runner.kv_cache, record, lambda: request.block_ids,
                          [Destination(peer=1, first_head=0, num_heads=shape[4], tag_base=0)])
        dst_blocks = [20, 3, 9]
        done = receiver.receive_layers.remote(0, dst_blocks, 0, shape[4], 30)
        posted_during_forward = []
        runner.after_layer = lambda layer: (sender.after_layer(layer), posted_during_forward.append(layer))
        engine.step()
        runner.after_layer = None
        assert posted_during_forward == list(range(shape[0]))
        assert sender.finish() is TransferState.DONE
        ray.get(done)
        src_blocks = sender.sent_block_ids
        assert len(src_blocks) == 3
        assert torch.equal(ray.get(receiver.blocks.remote(dst_blocks)), runner.kv_cache[:, :, src_blocks])
        ray.kill(receiver)
