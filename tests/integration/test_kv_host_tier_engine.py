"""The host KV tier in a running engine: a prefix evicted from the device cache comes back from
the host tier with the same greedy tokens as a device hit, as recomputation and as
``transformers``; nothing leaks in either tier, nor in what the registry would hold, through a
thousand requests, 30% of them cancelled."""

import random
import threading
import time
from typing import Callable

import pytest
import torch

from cluster.engine.block_hash import hash_token_blocks, request_hash_keys
from cluster.engine.block_manager import AllBlocksCleared, BlockStored
from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.engine import LLMEngine, RequestOutput
from cluster.engine.request import RequestStatus
from cluster.engine.kv_tiers.tier import HOST
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts
from engine_runs import run_one
from reference_checks import reference_greedy

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model_dir, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), num_kv_blocks=12, block_size=BLOCK, max_num_seqs=4, host_cache=32)
    return LLMEngine(EngineConfig(**{**config, **overrides}), verbose=False)


def run(llm: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams = GREEDY):
    return run_one(llm, request_id, prompt, params)


def evict_device_cache(llm: LLMEngine, seed: int) -> None:
    """Two prompts of 5 blocks each: together they take every device block the target's left."""
    for index, prompt in enumerate(random_prompts([80, 80], seed=seed)):
        run(llm, f"filler-{seed}-{index}", prompt)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_host_hit_gives_the_tokens_of_a_device_hit_and_of_recomputation(kv_cache_dtype, checkpoint,
                                                                         reference_model):
    model_dir = checkpoint("llama")
    prompt = random_prompts([70], seed=5)[0]  # 4 full blocks, the last 6 tokens always computed
    llm = engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    first = run(llm, "first", prompt)
    assert first.usage.cached_tokens == 0
    device_hit = run(llm, "device-hit", prompt)
    # 4 full blocks, and 5 of the tokens after them from the first request's last block (a partial hit)
    assert device_hit.usage.cached_tokens == 69 and llm.stats.host_loaded_blocks == 0
    evict_device_cache(llm, seed=6)
    assert llm.stats.host_offloaded_blocks >= 4
    host_hit = run(llm, "host-hit", prompt)
    assert host_hit.usage.cached_tokens == 64 and llm.stats.host_loaded_blocks == 4
    assert host_hit.token_ids == device_hit.token_ids == first.token_ids
    if kv_cache_dtype == "auto":  # the test model is float32: the CPU host tier holds it in 8 bits
        assert llm.host_store.format.name == "int8" and llm.host_store.converts
        reference, _ = reference_greedy(reference_model(model_dir), prompt, GREEDY.max_tokens)
        assert first.token_ids == reference
    else:  # same format on both tiers: the bytes come back unchanged
        assert not llm.host_store.converts


def test_host_tier_refuses_what_it_cannot_serve(checkpoint):
    with pytest.raises(EngineConfigError, match="host_cache keeps the prefix cache's evicted blocks"):
        EngineConfig(model="m", host_cache=8, enable_prefix_caching=False)
    with pytest.raises(EngineConfigError, match="host_cache needs tensor_parallel_size 1"):
        EngineConfig(model="m", host_cache=8, tensor_parallel_size=2)
    with pytest.raises(EngineConfigError, match="^host_cache must be null, a positive number of blocks"):
        EngineConfig(model="m", host_cache="lots")
    with pytest.raises(EngineConfigError, match="host_cache 1KiB holds no block of"):
        engine(checkpoint("llama"), host_cache="1KiB")


@pytest.fixture
def one_thread():
    """Torch on one thread: a thousand tiny steps spend more in two threads' hand-offs than in work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fold_events(events, device: set, host: set) -> None:
    """What a registry makes of a worker's KV events: the hashes it holds in each tier."""
    for event in events:
        if isinstance(event, AllBlocksCleared):
            device.clear()
            host.clear()
        else:
            held = host if event.tier == HOST else device
            (held.update if isinstance(event, BlockStored) else held.difference_update)(event.block_hashes)


def test_no_blocks_leak_in_either_tier_after_a_thousand_requests_30_percent_cancelled(checkpoint, one_thread):
    llm = engine(checkpoint("llama"), num_kv_blocks=16, host_cache=24, max_num_seqs=8)
    requests = 1000
    shared = random_prompts([48, 48, 48, 48], seed=11)  # 4 prefixes of 3 blocks, coming back after evictions
    tails = random_prompts([9 + i % 23 for i in range(requests)], seed=12)
    rng = random.Random(0)
    cancel = set(rng.sample(range(requests), 300))  # each some steps after it was added (0: still waiting)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    pending = list(range(requests))
    aborts: dict[str, int] = {}  # request id -> the step it is cancelled at
    device, host_held = set(), set()
    step = 0
    while pending or llm.has_unfinished_requests():
        while pending and llm.scheduler.num_unfinished < 12:
            index = pending.pop(0)
            llm.add_request(f"r{index}", shared[index % 4] + tails[index], params)
            if index in cancel:
                aborts[f"r{index}"] = step + rng.randrange(4)
        for request_id in [r for r, at in aborts.items() if at == step]:
            llm.abort_request(request_id)
        llm.step()
        fold_events(llm.block_manager.drain_events(), device, host_held)
        step += 1
    assert len(aborts) == 300 and not llm.scheduler.requests
    manager, host = llm.block_manager, llm.block_manager.host
    assert manager.num_used_blocks == 0 and sorted(manager.free_block_ids()) == list(range(16))
    assert host.num_used + host.num_free == host.num_slots == 24
    slots = [slot for _, slot in host.entries()]
    assert len(set(slots)) == len(slots) and set(slots) <= set(range(24))
    # What the registry would hold is exactly what each tier holds: nothing stale, nothing missing.
    assert device == {manager.block_hash_of(b) for b in range(16)} - {None}
    assert host_held == {block_hash for block_hash, _ in host.entries()}
    assert llm.stats.host_offloaded_blocks > 0 and llm.stats.host_loaded_blocks > 0


# -- loads in the background, while other requests' steps run ---------------------------------

HANG_GUARD_S = 60
DECODE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class GatedLoads:
    """Holds every load the engine's copier makes after its first layer until ``open``; notes the
    layers in the order their copies were issued; ``fail_at``: raises there instead."""

    def __init__(self, llm: LLMEngine, fail_at: int | None = None):
        self.gate, self.entered, self.layers, self.fail_at = threading.Event(), threading.Event(), [], fail_at
        llm.host_store.layer_issued = self

    def __call__(self, layer: int) -> None:
        self.layers.append(layer)
        if layer == self.fail_at:
            raise RuntimeError("copy failed (test)")
        if layer == 0:
            self.entered.set()
            assert self.gate.wait(HANG_GUARD_S)

    def open(self) -> None:
        self.gate.set()


def host_resident(llm: LLMEngine, prompt: list[int]) -> RequestOutput:
    """Runs ``prompt`` and evicts its 4 full blocks to the host tier; returns its output."""
    first = run(llm, "first", prompt)
    evict_device_cache(llm, seed=6)
    hashes = hash_token_blocks(prompt[:64], BLOCK, request_hash_keys(llm.scheduler.extra_hash_keys, None))
    assert llm.block_manager.lookup_prefix(hashes) == [] and llm.block_manager.lookup_host_prefix(hashes) == 4
    return first


def step(llm: LLMEngine, outputs: dict[str, list[RequestOutput]]) -> None:
    for output in llm.step():
        outputs.setdefault(output.request_id, []).append(output)


def steps_until(llm: LLMEngine, done: Callable[[], bool], outputs: dict[str, list[RequestOutput]]) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not done():
        assert time.monotonic() < deadline, "hang"
        step(llm, outputs)


def all_free_and_the_prefix_hits_again(llm: LLMEngine, prompt: list[int], first: RequestOutput) -> None:
    """Every device block free; the prompt then hits its 4 blocks (one load of them in all) and
    gives the tokens it gave first."""
    manager = llm.block_manager
    assert manager.num_used_blocks == 0 and sorted(manager.free_block_ids()) == list(range(12))
    again = run(llm, "again", prompt)
    assert again.usage.cached_tokens == 64 and again.token_ids == first.token_ids
    assert llm.stats.host_loaded_blocks == 4


def test_other_requests_decode_while_a_host_hit_loads_and_a_second_hit_shares_its_load(checkpoint):
    llm = engine(checkpoint("llama"))
    prompt = random_prompts([70], seed=5)[0]
    first = host_resident(llm, prompt)
    decoding = random_prompts([20], seed=7)[0]
    llm.add_request("decode", decoding, DECODE)
    outputs: dict[str, list[RequestOutput]] = {}
    steps_until(llm, lambda: "decode" in outputs, outputs)
    loads = GatedLoads(llm)
    hit = llm.add_request("hit", prompt, GREEDY)
    outputs_before = len(outputs["decode"])
    step(llm, outputs)
    assert loads.entered.wait(HANG_GUARD_S)
    # Its 4 host blocks went into fresh device blocks, being loaded; it waits in the queue.
    assert hit.status is RequestStatus.LOADING and hit in llm.scheduler.waiting and hit.num_computed_tokens == 64
    loading = hit.block_ids[:4]
    assert llm.block_manager.is_loading(loading) and [llm.block_manager.ref_count(b) for b in loading] == [2] * 4
    assert [m.block_id for m in llm._loads[0].moves] == loading
    # A second request with the same prefix shares those blocks and waits for the same load.
    shared = llm.add_request("shared", prompt, GREEDY)
    for _ in range(3):
        step(llm, outputs)
    assert shared.status is RequestStatus.LOADING and shared.block_ids[:4] == loading
    assert [llm.block_manager.ref_count(b) for b in loading] == [3] * 4 and len(llm._loads) == 1
    # The decoding request advanced a token a step meanwhile; neither host hit was scheduled.
    assert len(outputs["decode"]) == outputs_before + 4 and llm.stats.host_loaded_blocks == 0
    assert hit.times.first_scheduled is None and shared.times.first_scheduled is None
    loads.open()
    steps_until(llm, lambda: not llm.has_unfinished_requests(), outputs)
    assert loads.layers == list(range(llm.model_config.num_layers))  # one load, layer by layer, in order
    assert llm.stats.host_loaded_blocks == 4 and llm.stats.host_load_seconds > 0
    for request_id in ("hit", "shared"):
        done = outputs[request_id][-1]
        assert done.finished and done.usage.cached_tokens == 64 and done.token_ids == first.token_ids
    assert outputs["decode"][-1].token_ids == run(llm, "decode-again", decoding, DECODE).token_ids
    assert llm.block_manager.num_used_blocks == 0


def test_a_request_cancelled_mid_load_frees_its_blocks_once_the_copy_is_made(checkpoint):
    llm = engine(checkpoint("llama"))
    prompt = random_prompts([70], seed=5)[0]
    first = host_resident(llm, prompt)
    loads = GatedLoads(llm)
    hit = llm.add_request("hit", prompt, GREEDY)
    llm.step()
    assert loads.entered.wait(HANG_GUARD_S)
    loading = hit.block_ids[:4]
    llm.abort_request("hit")
    # The request's references are gone; the load's stay until its copy is made.
    manager, host = llm.block_manager, llm.block_manager.host
    assert not llm.has_unfinished_requests() and llm.loads_in_flight  # a worker's loop steps for it still
    assert manager.num_used_blocks == 4 and [manager.ref_count(b) for b in loading] == [1] * 4
    assert not set(loading) & set(manager.free_block_ids())
    loads.open()
    llm._loads[0].done.wait(HANG_GUARD_S)
    llm.step()  # collects the load
    assert not llm.loads_in_flight
    assert host.num_used + host.num_free == host.num_slots and host.num_held_slots == 0
    # The copy was made: the blocks are cached, and a request that hits them reads the right KV.
    all_free_and_the_prefix_hits_again(llm, prompt, first)


def test_a_failed_load_ends_the_requests_that_hold_its_blocks_and_nothing_else(checkpoint):
    llm = engine(checkpoint("llama"))
    prompt = random_prompts([70], seed=5)[0]
    first = host_resident(llm, prompt)
    decoding = random_prompts([20], seed=7)[0]
    alone = run(llm, "alone", decoding)
    llm.add_request("decode", decoding, GREEDY)
    outputs: dict[str, list[RequestOutput]] = {}
    steps_until(llm, lambda: "decode" in outputs, outputs)
    loads = GatedLoads(llm, fail_at=1)
    loads.open()
    llm.add_request("hit", prompt, GREEDY)
    steps_until(llm, lambda: not llm.has_unfinished_requests(), outputs)
    failed = outputs["hit"][-1]
    assert failed.finished and failed.finish_reason == "error" and failed.token_ids == []
    assert failed.error == "loading the prompt's cached prefix from the host KV tier failed: copy failed (test)"
    assert outputs["decode"][-1].token_ids == alone.token_ids  # the other request never noticed
    assert llm.stats.host_load_failures == 1 and llm.stats.host_loaded_blocks == 0
    # The blocks it was loading are uncached; the host copies stay, and load the next time.
    llm.host_store.layer_issued = None
    all_free_and_the_prefix_hits_again(llm, prompt, first)


def test_a_failed_load_under_a_reserved_transfer_ends_it_at_its_admission_not_before(checkpoint):
    llm = engine(checkpoint("llama"))
    prompt = random_prompts([70], seed=5)[0]
    host_resident(llm, prompt)
    GatedLoads(llm, fail_at=0).open()
    first, destination = llm.reserve_transfer("moved", prompt, GREEDY)
    assert first == 4 and len(destination) == 1  # the host blocks do not travel: loaded here
    llm._loads[0].done.wait(HANG_GUARD_S)
    assert llm.step() == []  # the failure is noted; the KV still arriving may write its blocks until admitted
    assert "moved" in llm.scheduler.receiving and llm.block_manager.num_used_blocks == 5
    ended = llm.admit_transfer("moved", 7)
    assert ended.finished and ended.finish_reason == "error" and "host KV tier failed" in ended.error
    assert llm.block_manager.num_used_blocks == 0 and not llm.has_unfinished_requests()


def test_shutdown_with_a_load_in_flight_ends_after_its_copy(checkpoint):
    llm = engine(checkpoint("llama"))
    prompt = random_prompts([70], seed=5)[0]
    host_resident(llm, prompt)
    loads = GatedLoads(llm)
    llm.add_request("hit", prompt, GREEDY)
    llm.step()
    assert loads.entered.wait(HANG_GUARD_S)
    job = llm._loads[0]
    threading.Timer(0.2, loads.open).start()
    llm.shutdown()  # waits for the copy under way: nothing writes the cache after
    assert job.done.is_set() and job.error is None and loads.layers == list(range(llm.model_config.num_layers))
    assert not llm.load_queue.running and not llm.copy_queue.running
