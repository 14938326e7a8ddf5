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
