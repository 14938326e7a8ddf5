"""What a worker's load report carries of its steps: the latest ``STEPS_REPORTED``, after its
latest prefill-only steps older than those, so that a decode worker whose last steps were all
decodes still shows the router what its prompts took (``cluster/worker/engine_worker.py``)."""

from __future__ import annotations

import pytest

from cluster.engine.engine import PREFILL_STEPS_KEPT, EngineStats, StepRecord
from cluster.registry.load import STEPS_REPORTED
from cluster.worker.engine_worker import reported_steps

pytestmark = pytest.mark.unit


def prefill(tokens: int) -> StepRecord:
    return StepRecord(num_decode_tokens=0, num_prefill_tokens=tokens, seconds=tokens / 1000, context_tokens=0)


def decode(rows: int) -> StepRecord:
    return StepRecord(num_decode_tokens=rows, num_prefill_tokens=0, seconds=0.01, context_tokens=8)


def test_prompts_older_than_the_window_come_first_then_the_window():
    stats = EngineStats()
    prompts = [prefill(16 + i) for i in range(PREFILL_STEPS_KEPT + 4)]
    for step in prompts:
        stats.record(step)
    mixed = StepRecord(num_decode_tokens=3, num_prefill_tokens=40, seconds=0.02, context_tokens=9)  # not prefill-only
    stats.record(mixed)
    decodes = [decode(1 + i % 4) for i in range(STEPS_REPORTED)]
    for step in decodes:
        stats.record(step)
    assert reported_steps(stats) == prompts[-PREFILL_STEPS_KEPT:] + decodes


def test_a_prompt_inside_the_window_is_reported_once():
    stats = EngineStats()
    early, late = prefill(20), prefill(30)
    steps = [early] + [decode(2)] * STEPS_REPORTED + [late] + [decode(1)] * 5
    for step in steps:
        stats.record(step)
    assert reported_steps(stats) == [early] + steps[-STEPS_REPORTED:]
    assert reported_steps(stats).count(late) == 1


def test_few_steps_are_reported_as_they_are():
    stats = EngineStats()
    steps = [prefill(16), decode(1), prefill(64), decode(2)]
    for step in steps:
        stats.record(step)
    assert reported_steps(stats) == steps and list(stats.prefill_steps) == [steps[0], steps[2]]


def test_wide_batches_older_than_the_window_are_reported_two_per_width():
    """After a run of one-sequence steps, the report still carries the latest two decode-only
    steps of each wider batch width (2-3, 4-7, 8-15, ...), narrowest widths first, before the window."""
    stats = EngineStats()
    wide = [decode(n) for n in (32, 30, 20, 17, 9, 5, 3, 2)]
    for step in wide:
        stats.record(step)
    narrow = [decode(1) for _ in range(STEPS_REPORTED + 10)]
    for step in narrow:
        stats.record(step)
    # widths 2-3: 3, 2; 4-7: 5; 8-15: 9; 16-31: the latest two of 30, 20, 17; 32-63: 32
    assert reported_steps(stats) == [wide[6], wide[7], wide[5], wide[4], wide[2], wide[3], wide[0]] + narrow[-STEPS_REPORTED:]


def test_a_report_read_back_gives_its_steps_and_shares_those_an_earlier_report_held():
    from cluster.registry.load import StepSample, WorkerLoad

    steps = tuple(StepSample(16 * i, 256 * i, i % 3, 40 * i, 0.001 * i) for i in range(1, 9))
    first = WorkerLoad("d0", "decode", 0, 1, 0, 0, 0, 90, 100, 16, 2048, 8, steps[:6], 1.0)
    later = WorkerLoad("d0", "decode", 0, 1, 0, 0, 0, 90, 100, 16, 2048, 8, steps[2:], 2.0)  # the window slid by 2
    read_first, read_later = WorkerLoad.from_json(first.to_json()), WorkerLoad.from_json(later.to_json())
    assert (read_first, read_later) == (first, later)
    assert all(a is b for a, b in zip(read_first.steps[2:], read_later.steps[:4]))  # built once, not per report


def test_a_report_writes_each_step_as_a_row_and_still_reads_steps_written_as_objects():
    import json
    from dataclasses import asdict

    from cluster.registry.load import StepSample, WorkerLoad

    step = StepSample(32, 512, 2, 80, 0.004, kv_blocks_sent=3, guess_tokens=5, accepted_tokens=4, draft_s=0.001)
    load = WorkerLoad("d0", "decode", 1, 2, 0, 32, 80, 90, 100, 16, 2048, 8, (step,), 3.0, unpaired=("p1",))
    written = json.loads(load.to_json())
    assert written["steps"] == [[32, 512, 2, 80, 0.004, 3, 0.0, 5, 4, 0, 0.0, 0, 0.001]]
    assert written["unpaired"] == ["p1"] and written["worker"] == "d0"
    earlier = json.dumps({**written, "steps": [asdict(step)]})  # as a worker of the version before wrote it
    assert WorkerLoad.from_json(earlier) == WorkerLoad.from_json(load.to_json()) == load
