"""A prefix pulled from a peer engine's cache (device or host tier) over a KV transfer pair:
the receiving engine computes only the rest, with the greedy tokens of recomputation and of
``transformers``; a pull whose sender never sends ends at its deadline in recomputation; no
block stays referenced on either side. The two engines share this process (the in-process
transport); the workers' test (``test_peer_pull_cluster.py``) runs them as Ray actors over gloo."""

import threading

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.request import RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.kv_transfer.agent import PairLayout, TransferAgent
from cluster.kv_transfer.in_process_transport import InProcessTransport
from cluster.kv_transfer import transports
from cluster.parallel.group import GroupSpec
from cluster.parallel.tp_runner import engine_runner
from conftest import random_prompts
from reference_checks import reference_greedy

pytestmark = pytest.mark.integration

BLOCK = 16
BLOCKS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def in_process_transport(monkeypatch):
    """The in-process transport, registered for this module's tests only: a test of topologies
    run after them must still find only the transports a topology may name."""
    monkeypatch.setitem(transports._TRANSPORTS, InProcessTransport.name, InProcessTransport)


def engine(model_dir, name: str, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), num_kv_blocks=BLOCKS, block_size=BLOCK, max_num_seqs=4, engine_name=name)
    return LLMEngine(EngineConfig(**{**config, **overrides}), verbose=False,
                     make_runner=engine_runner(kv_port=TransferAgent))


def paired(sender: LLMEngine, receiver: LLMEngine, name: str) -> str:
    layout = PairLayout(name, 1, 1, sender.model_config.num_kv_heads, InProcessTransport.name)
    spec = GroupSpec("peer-pull-tests", name, 2)
    sender.runner.join_transfer(layout, spec, True)
    receiver.runner.join_transfer(layout, spec, False)
    return name


def run_to_end(llm: LLMEngine):
    finished = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def generate(llm: LLMEngine, request_id: str, prompt: list[int]):
    llm.add_request(request_id, prompt, GREEDY)
    return run_to_end(llm)[request_id]


def pull(sender: LLMEngine, receiver: LLMEngine, pair: str, request_id: str, prompt: list[int], blocks: int,
         timeout_s: float = 10.0, send: bool = True):
    """The receiver reserves the first ``blocks`` blocks, the sender pins what it caches of them
    and sends them while the receiver receives; the request then runs on the receiver."""
    first, dst = receiver.reserve_pull(request_id, prompt, GREEDY, blocks)
    pinned = sender.pin_prefix(prompt, first, blocks)
    errors = {}
    sending = threading.Thread(target=lambda: errors.setdefault(
        "send", sender.send_blocks(pair, request_id, pinned, 0, timeout_s)))
    if send:
        sending.start()
    received = receiver.receive_transfer(pair, request_id, dst[:len(pinned)], 0, timeout_s)
    if send:
        sending.join()
    sender.unpin(pinned)
    receiver.admit_pull(request_id, 0 if received else len(pinned))
    return first, pinned, received, errors.get("send"), run_to_end(receiver)[request_id]


def test_a_pulled_prefix_gives_the_tokens_of_recomputation_and_of_transformers(checkpoint, reference_model):
    model_dir = checkpoint("llama")
    peer, here = engine(model_dir, "peer-a"), engine(model_dir, "here-a")
    pair = paired(peer, here, "pull-a")
    prompt = random_prompts([70], seed=11)[0]  # 4 cacheable blocks, the last 6 tokens always computed
    computed = generate(peer, "on-peer", prompt)
    first, pinned, error, send_error, pulled = pull(peer, here, pair, "pulled", prompt, blocks=4)
    assert (first, len(pinned), error, send_error) == (0, 4, None, None)
    assert pulled.usage.cached_tokens == 64  # 4 blocks pulled, not computed here
    recomputed = generate(engine(model_dir, "alone-a"), "recomputed", prompt)
    expected, _ = reference_greedy(reference_model(model_dir), prompt, 8)
    assert pulled.token_ids == recomputed.token_ids == computed.token_ids == expected
    # Nothing stays referenced: every block is free (cached) on both sides.
    assert peer.block_manager.num_free_blocks == here.block_manager.num_free_blocks == BLOCKS
    # The pulled blocks are cached on the receiver now: the same prompt hits them there.
    again = generate(here, "again", prompt)  # and 5 tokens after them, from the pulled request's last block
    assert again.usage.cached_tokens == 69 and again.token_ids == expected


def test_a_peer_sends_only_the_blocks_the_receiver_lacks_and_loads_its_host_tier_ones(checkpoint):
    model_dir = checkpoint("llama")
    peer, here = engine(model_dir, "peer-b", host_cache=32), engine(model_dir, "here-b")
    pair = paired(peer, here, "pull-b")
    head, prompt = random_prompts([32], seed=12)[0], None
    prompt = head + random_prompts([54], seed=13)[0]  # 5 cacheable blocks; the receiver holds the first 2
    generate(peer, "on-peer", prompt)
    generate(here, "head-here", head + [7])  # caches the 2 head blocks here
    for index, filler in enumerate(random_prompts([80, 80], seed=14)):  # evicts the peer's device copies
        generate(peer, f"filler-{index}", filler)
    loaded_before = peer.stats.host_loaded_blocks
    first, pinned, error, _, pulled = pull(peer, here, pair, "pulled", prompt, blocks=5)
    assert (first, len(pinned), error) == (2, 3, None)
    assert peer.stats.host_loaded_blocks - loaded_before >= 3  # the peer's host tier held them
    assert pulled.usage.cached_tokens == 80
    assert pulled.token_ids == generate(engine(model_dir, "alone-b"), "recomputed", prompt).token_ids
    assert peer.block_manager.num_free_blocks == here.block_manager.num_free_blocks == BLOCKS


def test_the_receivers_own_host_tier_blocks_load_while_it_pulls_the_rest_and_it_runs_once_they_are_in(checkpoint):
    model_dir = checkpoint("llama")
    peer, here = engine(model_dir, "peer-d"), engine(model_dir, "here-d", host_cache=32)
    pair = paired(peer, here, "pull-d")
    head = random_prompts([32], seed=16)[0]
    prompt = head + random_prompts([38], seed=17)[0]  # 4 cacheable blocks; the receiver's host tier holds 2
    computed = generate(peer, "on-peer", prompt)
    generate(here, "head-here", head + [7])
    for index, filler in enumerate(random_prompts([80, 80], seed=18)):  # to the receiver's host tier
        generate(here, f"filler-{index}", filler)
    gate = threading.Event()
    here.host_store.layer_issued = lambda layer: gate.wait(60)  # the load, under way, held
    first, dst = here.reserve_pull("pulled", prompt, GREEDY, 4)
    loading = here.scheduler.receiving["pulled"].block_ids[:2]
    assert first == 2 and len(dst) == 2 and here.block_manager.is_loading(loading)
    pinned = peer.pin_prefix(prompt, first, 4)
    sending = threading.Thread(target=peer.send_blocks, args=(pair, "pulled", pinned, 0, 10.0))
    sending.start()
    assert here.receive_transfer(pair, "pulled", dst, 0, 10.0) is None
    sending.join()
    peer.unpin(pinned)
    here.admit_pull("pulled", len(pinned))
    request = here.scheduler.requests["pulled"]
    assert request.status is RequestStatus.LOADING and here.step() == []  # not scheduled before its load
    gate.set()
    pulled = run_to_end(here)["pulled"]
    assert pulled.usage.cached_tokens == 64 and pulled.token_ids == computed.token_ids
    assert here.stats.host_loaded_blocks == 2
    assert peer.block_manager.num_free_blocks == here.block_manager.num_free_blocks == BLOCKS


def test_a_pull_whose_peer_never_sends_ends_in_recomputation_at_its_deadline(checkpoint):
    model_dir = checkpoint("llama")
    peer, here = engine(model_dir, "peer-c"), engine(model_dir, "here-c")
    pair = paired(peer, here, "pull-c")
    prompt = random_prompts([70], seed=15)[0]
    generate(peer, "on-peer", prompt)
    first, pinned, error, _, recomputed = pull(peer, here, pair, "stalled", prompt, blocks=4, timeout_s=0.5,
                                               send=False)
    assert len(pinned) == 4 and "timed out" in error
    assert recomputed.usage.cached_tokens == 0 and recomputed.finish_reason == "length"
    assert recomputed.token_ids == generate(engine(model_dir, "alone-c"), "alone", prompt).token_ids
    assert peer.block_manager.num_free_blocks == here.block_manager.num_free_blocks == BLOCKS
    # What never arrived was not cached: the receiver holds no block of the prompt's prefix
    # but those its own recomputation registered (the same 4, computed).
    assert here.scheduler.cached_prefix_blocks(here._make_request("probe", prompt, GREEDY)) == 4
