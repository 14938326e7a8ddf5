"""A worker's start-up profile is measured once per model, settings and machine, then kept:
a second start with the same key reuses the kept steps (the router's cost model gets the same
measurements, nothing is measured) while a timed probe agrees with them, a changed key, an
unreadable entry or a probe that contradicts the kept steps measures afresh, and a fresh profile
stops at its time limits with nothing left running."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine, StepRecord
from cluster.worker import step_profile
from prefill_worker.worker import PrefillWorker

pytestmark = pytest.mark.unit

PROBE_TOLERANCE = step_profile.PROBE_TOLERANCE  # the module's own, before a fixture widens it


@pytest.fixture
def model(checkpoint, tmp_path):
    """A copy of the tiny checkpoint, so a test may touch its files."""
    return shutil.copytree(checkpoint("llama"), tmp_path / "model")


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """A private cache, and the parts of the profiles measured, a tuple a start (the real
    measurement runs). Any probe confirms a kept profile here (a profile measured while the
    machine was busy must not fail these tests); the probe's rule has tests of its own."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(step_profile, "PROBE_TOLERANCE", math.inf)
    starts = []
    measure_parts = step_profile.measure_parts

    def counting(engine, parts):
        starts.append(parts)
        return measure_parts(engine, parts)

    monkeypatch.setattr(step_profile, "measure_parts", counting)
    return starts


PROMPTS, BOTH = ("prompts",), ("prompts", "decode")


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
    assert measured == [PROMPTS] and kept
    second = PrefillWorker(config)
    try:
        assert measured == [PROMPTS]  # not measured again
        assert list(second.engine.stats.steps) == kept
        _, load = second._report_snapshot()  # the engine is free: the reporter's snapshot now
        assert [s.seconds for s in load.steps] == [s.seconds for s in kept[-len(load.steps):]]
        assert_nothing_left(second.engine)
    finally:
        second.shutdown()


@pytest.mark.parametrize("change", ["settings", "checkpoint", "machine"])
def test_a_changed_key_measures_afresh(model, measured, monkeypatch, change):
    assert step_profile.start_up(engine(model), "decode") is True
    assert step_profile.start_up(engine(model), "decode") is False
    overrides = {}
    if change == "settings":
        overrides = {"max_num_seqs": 8}
    elif change == "checkpoint":
        weights = model / "model.safetensors"
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    else:
        monkeypatch.setattr(step_profile, "cpu_model", lambda: "model name\t: another CPU")
    again = engine(model, **overrides)
    assert step_profile.start_up(again, "decode") is True
    assert measured == [BOTH, BOTH]
    assert_nothing_left(again)


def test_a_decode_worker_takes_the_prompts_a_prefill_worker_of_its_settings_measured(model, measured):
    """The quick start's two workers have one engine's settings: the second to start measures
    only its decode batch, and its profile's prompts are the first one's, as kept."""
    prefill = engine(model)
    assert step_profile.start_up(prefill, "prefill") is True
    prompts = list(prefill.stats.steps)
    decode = engine(model, engine_name="decode-0")
    assert step_profile.start_up(decode, "decode") is True
    assert measured == [PROMPTS, ("decode",)]
    steps = list(decode.stats.steps)
    assert steps[:len(prompts)] == prompts
    assert steps[len(prompts):] == step_profile.kept_steps(step_profile.profile_key(decode, "decode"))
    assert steps[len(prompts):] and all(s.num_decode_tokens and not s.num_prefill_tokens for s in steps[-3:])
    assert step_profile.start_up(engine(model), "colocated") is False  # both parts kept: nothing measured
    assert measured == [PROMPTS, ("decode",)]
    assert_nothing_left(decode)


def test_a_worker_keeps_what_it_measured_before_it_lets_the_next_one_measure(model, measured, monkeypatch):
    """Parts are written while the machine's profiling lock is held: a worker waiting for the
    lock reads them once it has it (written after, the quick start's decode worker measured the
    prompts again in one start of two)."""
    from cluster.engine import node_quiet

    probe = node_quiet.open_lock()
    kept_while_held = []
    keep_steps = step_profile.keep_steps
    monkeypatch.setattr(step_profile, "keep_steps",
                        lambda key, steps: (kept_while_held.append((key["part"], node_quiet.held(probe))),
                                            keep_steps(key, steps)))
    try:
        assert step_profile.start_up(engine(model), "decode") is True
    finally:
        os.close(probe)
    assert kept_while_held == [("prompts", True), ("decode", True)]


def test_the_decode_batch_joins_as_sent_prompts_and_narrows_by_two_sequences_a_step(checkpoint, measured):
    """No prompt of the decode batch is computed; its steps are 32, 30, ..., 2 then 1 sequences
    wide, each attending to its sequences' prompts and the tokens decoded so far."""
    llm = engine(checkpoint("llama", max_position_embeddings=4096), num_kv_blocks=512, max_model_len=4096)
    steps = step_profile.measure_parts(llm, ("decode",))["decode"]
    widths = list(range(32, 0, -2)) + [1]
    lengths = [16 + (37 * i) % 112 for i in range(32)]  # the profile's prompt lengths
    assert [s.num_decode_tokens for s in steps] == widths
    assert all(s.num_prefill_tokens == 0 for s in steps)
    assert [s.context_tokens for s in steps] == [sum(lengths[i] + k + 1 for i in range(width))
                                                 for k, width in enumerate(widths)]
    assert step_profile.decode_steps_of(5) == [3, 2, 2, 1, 1]  # widths 5, 3, 1
    assert step_profile.decode_steps_of(1) == [1]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_the_key_does_not_hold_the_engine_code(model, measured):
    """An edit of the engine's sources (a development checkout) keeps the key: the probe judges it."""
    import torch

    key = step_profile.profile_key(engine(model), "decode")
    assert key["software"] == {"torch": torch.__version__}
    assert sorted(key) == ["engine", "format", "machine", "model", "part", "recipe", "software"]


def step(prefill: int, decode: int, seconds: float) -> StepRecord:
    return StepRecord(num_decode_tokens=decode, num_prefill_tokens=prefill, seconds=seconds, context_tokens=0)


def test_a_probe_is_judged_against_the_kept_steps_of_its_shapes():
    kept = [step(16, 0, 0.010), step(16, 0, 0.030), step(16, 0, 0.020), step(0, 1, 0.005), step(64, 0, 0.040)]
    slower = [step(16, 0, 0.040), step(0, 1, 0.005)]  # against the median 16-token prompt (20 ms) and the decode
    assert step_profile.probe_ratio(kept, slower) == pytest.approx(0.045 / 0.025)
    assert step_profile.profile_holds(kept, slower, tolerance=2.0)
    assert step_profile.profile_holds(kept, [step(16, 0, 2.0)], tolerance=2.0)  # 100x slower: a busy machine now
    faster = [step(16, 0, 0.005), step(0, 1, 0.002)]  # 0.28x: an engine made much faster, or a profile measured slow
    assert step_profile.probe_ratio(kept, faster) == pytest.approx(0.007 / 0.025)
    assert not step_profile.profile_holds(kept, faster, tolerance=2.0)
    assert step_profile.profile_holds(kept, faster, tolerance=4.0)
    assert step_profile.profile_holds(kept, [step(16, 0, 0.010)], tolerance=2.0)  # exactly half: holds
    assert step_profile.probe_ratio(kept, [step(32, 0, 0.01)]) is None  # no shape in common: cannot confirm it
    assert not step_profile.profile_holds(kept, [step(32, 0, 0.01)], tolerance=100.0)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_the_probe_has_the_shapes_of_the_profile(model, measured, role):
    """A prompt of the profile's first length, and (where the worker generates) a lone decode
    step: shapes a fresh profile holds, timed once warm, with nothing left behind."""
    llm = engine(model)
    step_profile.start_up(llm, role)
    kept = list(llm.stats.steps)
    probed = step_profile.probe(llm, role)
    shapes = {(s.num_prefill_tokens, s.num_decode_tokens) for s in probed}
    assert shapes == ({(16, 0)} if role == "prefill" else {(16, 0), (0, 1)})
    assert shapes <= {(s.num_prefill_tokens, s.num_decode_tokens) for s in kept}
    assert step_profile.probe_ratio(kept, probed) is not None
    assert_nothing_left(llm)


def test_a_kept_profile_its_probe_contradicts_is_measured_again(model, measured, monkeypatch, capsys):
    llm = engine(model)
    step_profile.start_up(llm, "decode")
    key = step_profile.profile_key(llm, "decode")
    path = step_profile.profile_path(key)
    data = json.loads(path.read_text())
    for kept in data["steps"]:
        kept["seconds"] *= 1000  # as measured by an engine 1,000 times slower than this one (or a busy machine)
    path.write_text(json.dumps(data))
    monkeypatch.setattr(step_profile, "PROBE_TOLERANCE", PROBE_TOLERANCE)
    again = engine(model)
    assert step_profile.start_up(again, "decode") is True
    assert measured == [BOTH, BOTH]  # both parts again, though only the decode batch's were off
    assert "prefill-0: the kept step profile does not hold here any more" in capsys.readouterr().err
    fresh = step_profile.kept_steps(key)  # the fresh profile replaced it
    assert fresh and list(again.stats.steps)[-len(fresh):] == fresh
    assert_nothing_left(again)


def test_an_unreadable_kept_profile_is_measured_again(model, measured):
    llm = engine(model)
    step_profile.start_up(llm, "decode")
    path = step_profile.profile_path(step_profile.profile_key(llm, "decode"))
    path.write_text('{"key": {"format": 1}, "steps": [{"num_decode')
    assert step_profile.start_up(engine(model), "decode") is True
    assert step_profile.start_up(engine(model), "decode") is False
    assert measured == [BOTH, ("decode",)]  # the prompts' part was still readable


def test_the_profile_measures_prompts_then_a_shrinking_decode_batch(model, measured):
    llm = engine(model)
    step_profile.start_up(llm, "decode")
    steps = list(llm.stats.steps)
    limit = min(llm.max_model_len - 16, llm.block_manager.num_blocks * llm.config.block_size // 2)
    shapes = step_profile.PROMPT_TOKENS * step_profile.PROMPT_ROUNDS
    prompts = [s.num_prefill_tokens for s in steps[:len(shapes)]]
    assert prompts == [min(n, limit) for n in shapes] and step_profile.PROMPT_ROUNDS == 2
    decodes = [s.num_decode_tokens for s in steps if s.num_decode_tokens and not s.num_prefill_tokens]
    assert decodes == sorted(decodes, reverse=True) and decodes[-1] == 1 and decodes[0] > 1
    assert_nothing_left(llm)


def test_a_fresh_profile_stops_at_its_time_limits(model, measured, monkeypatch):
    monkeypatch.setattr(step_profile, "DECODE_TIME_LIMIT_S", 0.0)
    llm = engine(model)
    step_profile.start_up(llm, "decode")
    steps = list(llm.stats.steps)
    assert len(steps) == len(step_profile.PROMPT_TOKENS) * step_profile.PROMPT_ROUNDS  # no decode batch step
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
