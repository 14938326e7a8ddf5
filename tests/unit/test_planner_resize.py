"""The live planner's act: a deployment resized to a split with the fewest scale steps, moves
first (exact steps on a stand-in deployment)."""

from __future__ import annotations

import itertools

import pytest

from cluster.deployment.planner_resize import resize_to, split_of
from cluster.plan.live.propose import Split

pytestmark = pytest.mark.unit


class FakeScale:
    def __init__(self, deployment):
        self.d, self.calls, self.names = deployment, [], itertools.count(5)

    def add(self, role, say=None):
        name = f"{role}-{next(self.names)}"
        self.d.members[role].append(name)
        self.calls.append(("add", role))
        return name

    def remove(self, worker, say=None):
        self.d.members[worker.rsplit("-", 1)[0]].remove(worker)
        self.calls.append(("remove", worker))

    def move(self, worker, role, say=None):
        self.remove(worker)
        self.calls.pop()
        name = self.add(role)
        self.calls[-1] = ("move", worker, role)
        return name


class FakeDeployment:
    def __init__(self, prefill: int, decode: int):
        self.members = {"prefill": [f"prefill-{i}" for i in range(prefill)], "decode": [f"decode-{i}" for i in range(decode)]}
        self.scale = FakeScale(self)


@pytest.mark.parametrize("start, target, calls, said", [
    (Split(1, 2), Split(2, 1), [("move", "decode-1", "prefill")], "moved decode-1 to prefill-5"),
    (Split(2, 1), Split(1, 3), [("move", "prefill-1", "decode"), ("add", "decode")],
     "moved prefill-1 to decode-5, added decode-6"),
    (Split(3, 3), Split(1, 2), [("remove", "prefill-2"), ("remove", "prefill-1"), ("remove", "decode-2")],
     "removed prefill-2, removed prefill-1, removed decode-2"),
    (Split(1, 1), Split(1, 1), [], "nothing to do"),
])
def test_moves_first_then_adds_then_removes(start, target, calls, said):
    deployment = FakeDeployment(start.prefill, start.decode)
    assert resize_to(deployment, target) == said
    assert deployment.scale.calls == calls
    assert split_of(deployment) == target
