"""The host KV tier in a running engine: a prefix evicted from the device cache comes back from
the host tier with the same greedy tokens as a device hit, as recomputation and as
``transformers``; nothing leaks in either tier, nor in what the registry would hold, through a
thousand requests, 30% of them cancelled."""

import random

import pytest
import torch

from cluster.engine.block_manager import AllBlocksCleared, BlockStored
from cluster.engine.config import EngineConfig, EngineConfigError
from cluster.engine.engine import LLMEngine
from cluster.engine.kv_tiers.tier import HOST
from cluster.engine.sampling_params import SamplingParams
from conftest import random_prompts
from reference_checks import reference_greedy

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def engine(model_dir, **overrides) -> LLMEngine:
    config = dict(model=str(model_dir), num_kv_blocks=12, block_size=BLOCK, max_num_seqs=4, host_cache=32)
    return LLMEngine(EngineConfig(**{**config, **overrides}), verbose=False)


def run(llm: LLMEngine, request_id: str, prompt: list[int]):
    llm.add_request(request_id, prompt, GREEDY)
    finished = None
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                finished = output
    return finished


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
    assert device_hit.usage.cached_tokens == 64 and llm.stats.host_loaded_blocks == 0
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
