"""A worker's start-up profile is measured once per model, settings and machine, then kept:
a second start with the same key reuses the kept steps (the router's cost model gets the same
measurements, nothing is measured), a changed key or an unreadable entry measures afresh, and a
fresh profile stops at its time limits with nothing left running."""

from __future__ import annotations

import os
import shutil

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.worker import step_profile
from prefill_worker.worker import PrefillWorker

pytestmark = pytest.mark.unit


@pytest.fixture
def model(checkpoint, tmp_path):
    """A copy of the tiny checkpoint, so a test may touch its files."""
    return shutil.copytree(checkpoint("llama"), tmp_path / "model")


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """A private cache, and the roles of the profiles measured (the real measurement runs)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    roles = []
    measure = step_profile.measure

    def counting(engine, role):
        roles.append(role)
        measure(engine, role)

    monkeypatch.setattr(step_profile, "measure", counting)
    return roles


def engine(model, **overrides) -> LLMEngine:
    settings = dict(model=str(model), num_kv_blocks=64, max_model_len=512, engine_name="prefill-0")
    return LLMEngine(EngineConfig(**{**settings, **overrides}), verbose=False, fault_kv_in_background=True)


def assert_nothing_left(llm: LLMEngine) -> None:
    assert not llm.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert llm.block_manager.drain_events() == []
    assert llm.stats.num_steps == 0 and llm.stats.prompt_tokens == 0


def test_a_second_start_of_a_worker_reuses_its_kept_profile(model, measured):
    config = EngineConfig(model=str(model), num_kv_blocks=64, max_model_len=512, engine_name="prefill-0")
    first = PrefillWorker(config)
    kept = list(first.engine.stats.steps)
    first.shutdown()
    assert measured == ["prefill"] and kept
    second = PrefillWorker(config)
    try:
        assert measured == ["prefill"]  # not measured again
        assert list(second.engine.stats.steps) == kept
        _, load = second._snapshot()
        assert [s.seconds for s in load.steps] == [s.seconds for s in kept[-len(load.steps):]]
        assert_nothing_left(second.engine)
    finally:
        second.shutdown()


@pytest.mark.parametrize("change", ["settings", "role", "checkpoint", "machine", "engine code"])
def test_a_changed_key_measures_afresh(model, measured, monkeypatch, change):
    assert step_profile.start_up(engine(model), "decode") is True
    assert step_profile.start_up(engine(model), "decode") is False
    role, overrides = "decode", {}
    if change == "settings":
        overrides = {"max_num_seqs": 8}
    elif change == "role":
        role = "prefill"
    elif change == "checkpoint":
        weights = model / "model.safetensors"
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    elif change == "machine":
        monkeypatch.setattr(step_profile, "cpu_model", lambda: "model name\t: another CPU")
    else:
        monkeypatch.setattr(step_profile, "_engine_digest", lambda: "another engine")
    again = engine(model, **overrides)
    assert step_profile.start_up(again, role) is True
    assert measured == ["decode", role]
    assert_nothing_left(again)


def test_an_unreadable_kept_profile_is_measured_again(model, measured):
    llm = engine(model)
    step_profile.start_up(llm, "decode")
    path = step_profile.profile_path(step_profile.profile_key(llm, "decode"))
    path.write_text('{"key": {"format": 1}, "steps": [{"num_decode')
    assert step_profile.start_up(engine(model), "decode") is True
    assert step_profile.start_up(engine(model), "decode") is False
    assert measured == ["decode", "decode"]


def test_the_profile_measures_prompts_then_a_shrinking_decode_batch(model, measured):
    llm = engine(model)
    step_profile.start_up(llm, "decode")
    steps = list(llm.stats.steps)
    limit = min(llm.max_model_len - 16, llm.block_manager.num_blocks * llm.config.block_size // 2)
    prompts = [s.num_prefill_tokens for s in steps[:len(step_profile.PROMPT_TOKENS)]]
    assert prompts == [min(n, limit) for n in step_profile.PROMPT_TOKENS]
    decodes = [s.num_decode_tokens for s in steps if s.num_decode_tokens and not s.num_prefill_tokens]
    assert decodes == sorted(decodes, reverse=True) and decodes[-1] == 1 and decodes[0] > 1
    assert_nothing_left(llm)


def test_a_fresh_profile_stops_at_its_time_limits(model, measured, monkeypatch):
    monkeypatch.setattr(step_profile, "DECODE_TIME_LIMIT_S", 0.0)
    llm = engine(model)
    step_profile.start_up(llm, "decode")
    steps = list(llm.stats.steps)
    assert len(steps) == len(step_profile.PROMPT_TOKENS)  # the prompts, and no step of the decode batch
    assert all(not s.num_decode_tokens for s in steps)
    assert_nothing_left(llm)

    monkeypatch.setattr(step_profile, "PROMPTS_TIME_LIMIT_S", 0.0)
    llm = engine(model, max_num_seqs=64)  # another key: measured afresh
    step_profile.start_up(llm, "decode")
    assert list(llm.stats.steps) == []
    assert_nothing_left(llm)


def test_workers_on_one_machine_measure_one_at_a_time(monkeypatch, tmp_path):
    """A second profile waits for the first to end (another process holds the lock here), and
    measures anyway once its wait is over."""
    import subprocess
    import sys
    import time

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom cluster.worker.step_profile import measuring_alone\n"
         "with measuring_alone():\n    print('held', flush=True)\n    time.sleep(float(sys.argv[1]))", "1.5"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache")})
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with step_profile.measuring_alone():
            waited = time.monotonic() - started
        assert waited > 1.0  # the holder kept the lock 1.5 s after it said so
        holder.wait(timeout=60)
    finally:
        holder.kill()

    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom cluster.worker.step_profile import measuring_alone\n"
         "with measuring_alone():\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache")})
    try:
        assert holder.stdout.readline().strip() == "held"
        with step_profile.measuring_alone(wait_s=0.2):
            assert holder.poll() is None  # a holder that does not let go delays a profile, never stops it
    finally:
        holder.kill()
        holder.wait(timeout=60)
