"""What a resize refuses before it touches anything (``cluster/deployment/scaling.py``): exact one-line
errors naming the field and what to do, for a deployment described by its pools and members."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.deployment.scaling import ScaleError, Scaler

pytestmark = pytest.mark.unit


def scaler(members: dict[str, list[str]], draining=()) -> Scaler:
    deployment = SimpleNamespace(members=members, draining=set(draining), pools={role: None for role in members},
                                 next_index={role: len(names) for role, names in members.items()}, supervisor=None)
    return Scaler(deployment)


def refused(call) -> str:
    with pytest.raises(ScaleError) as caught:
        call()
    return str(caught.value)


DISAGGREGATED = {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0"]}


def test_removable_workers_and_the_refusals():
    s = scaler(DISAGGREGATED)
    assert s._removable("prefill-1") == "prefill"
    assert refused(lambda: s._removable("decode-0")) == (
        "worker: decode-0 is the last worker that generates; add another first (`tandem scale add decode`)")
    assert refused(lambda: s._removable("decode-7")) == (
        "worker: 'decode-7' is not a worker of this cluster; its workers: prefill-0, prefill-1, decode-0")
    s = scaler(DISAGGREGATED, draining=["prefill-1"])
    assert refused(lambda: s._removable("prefill-1")) == "worker: prefill-1 is draining already"
    assert refused(lambda: s._removable("prefill-0")) == (
        "worker: prefill-0 is the last prefill worker of the decode workers; add another first "
        "(`tandem scale add prefill`)")
    s = scaler({"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1"]}, draining=["decode-1"])
    assert refused(lambda: s._removable("decode-0")).startswith("worker: decode-0 is the last worker that generates")


def test_add_and_move_refuse_a_role_the_topology_has_no_pool_of():
    s = scaler(DISAGGREGATED)
    assert refused(lambda: s.add("decoder")) == "role: 'decoder' is not a role; choose one of prefill, decode, colocated"
    assert refused(lambda: s.add("colocated")) == (
        "role: the topology declares no colocated pool (its replicas are 0); add to one of decode, prefill")
    assert refused(lambda: s.move("prefill-1", "prefill")) == "role: prefill-1 is a prefill worker already"
    assert refused(lambda: s.move("prefill-1", "colocated")) == (
        "role: the topology declares no 'colocated' pool; move to one of decode")
    assert s.deployment.next_index == {"prefill": 2, "decode": 1}  # nothing was started


def moving(members: dict[str, list[str]], room: bool, add_error: str | None = None,
           add_error_after_remove: str | None = None) -> tuple[Scaler, list[tuple]]:
    """A scaler whose add and remove only record what they were asked: the first add places the
    new worker when there is ``room`` (else it is not placed within its wait), or fails with
    ``add_error``; an add after a remove fails with ``add_error_after_remove``."""
    s, steps = scaler(members), []

    def add(role, say=None, within_s=None):
        steps.append(("add", role, within_s))
        removed = any(step[0] == "remove" for step in steps)
        if (add_error_after_remove if removed else add_error) is not None:
            raise ScaleError(add_error_after_remove if removed else add_error)
        return f"{role}-9" if room or within_s is None else None

    s.add = add
    s.remove = lambda worker, timeout_s, say=None: steps.append(("remove", worker))
    return s, steps


def test_a_move_adds_first_when_there_is_room_and_the_pool_never_runs_short():
    s, steps = moving(DISAGGREGATED, room=True)
    assert s.move("prefill-1", "decode", say=lambda line: None) == "decode-9"
    assert steps == [("add", "decode", 5.0), ("remove", "prefill-1")]


def test_a_move_without_room_removes_first_then_adds_in_the_room_left():
    s, steps = moving(DISAGGREGATED, room=False)
    said = []
    assert s.move("prefill-1", "decode", say=said.append) == "decode-9"
    assert steps == [("add", "decode", 5.0), ("remove", "prefill-1"), ("add", "decode", None)]
    assert said == ["making room: prefill-1 is removed first"]


def test_a_move_whose_add_fails_first_changes_nothing_and_says_so():
    s, steps = moving(DISAGGREGATED, room=True, add_error="decode-9: its engine failed\nTraceback ...")
    assert refused(lambda: s.move("prefill-1", "decode", say=lambda line: None)) == (
        "no decode worker could be added, so prefill-1 was not removed (the pools are as they were): "
        "decode-9: its engine failed")
    assert steps == [("add", "decode", 5.0)]


def test_a_move_whose_add_fails_after_the_remove_names_the_pool_short_and_what_to_run():
    s, steps = moving(DISAGGREGATED, room=False, add_error_after_remove="decode-9: no node has 1 GPU free")
    assert refused(lambda: s.move("prefill-1", "decode", say=lambda line: None)) == (
        "prefill-1 was removed from the prefill pool, but no decode worker could be added in its place "
        "(decode-9: no node has 1 GPU free): the decode pool is one short of the move; run "
        "`tandem scale add decode` once there is room, or `tandem scale add prefill` to undo it")
    assert steps == [("add", "decode", 5.0), ("remove", "prefill-1"), ("add", "decode", None)]


def test_an_add_not_placed_within_its_wait_starts_nothing_and_keeps_the_name_free():
    s = scaler(DISAGGREGATED)
    asked = []
    s.deployment.reserve = lambda name, within_s=None, waiting=None: asked.append((name, within_s))  # never placed: None
    said = []
    assert s.add("decode", say=said.append, within_s=5.0) is None
    assert asked == [("decode-1", 5.0)]
    assert said == ["placing decode-1", "no free resources for decode-1 now"]
    assert s.deployment.next_index == {"prefill": 2, "decode": 1}
    assert s.deployment.members == DISAGGREGATED
