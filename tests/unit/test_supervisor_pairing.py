"""The supervisor builds a restarted worker's transfer groups again when a build fails with both
workers alive, and leaves a pair whose peer died to that peer's restart."""

from __future__ import annotations

import threading

import pytest

from cluster.deployment import supervisor as supervisor_module
from cluster.deployment.supervisor import PAIR_TRIES, Supervisor

pytestmark = pytest.mark.unit


class RayError(Exception):
    pass


class RayActorError(RayError):
    pass


class FakeRay:
    class exceptions:
        RayError = RayError
        RayActorError = RayActorError

    def __init__(self, outcomes: dict[tuple[str, str], list]):
        self.outcomes = outcomes  # per pair, what each build does: None (built) or an exception

    def get(self, ref, timeout=None):
        outcome = self.outcomes[ref].pop(0)
        if outcome is not None:
            raise outcome
        return None


class FakeDeployment:
    def __init__(self, ray, peers=()):
        self._ray = ray
        self.peers = list(peers)  # decode peers it pulls from and sends to (kv.peer_pull)
        self.builds: list[tuple[tuple[str, str], int]] = []

    def pairs(self, name):
        return [("prefill-0", name), ("prefill-1", name)]

    def pair_calls(self, pairs, generation=0):
        self.builds += [(pair, generation) for pair in pairs]
        return [(d, (p, d)) for p, d in pairs]

    def peer_pairs(self, name):
        return [pair for peer in self.peers for pair in ((peer, name), (name, peer))]

    def peer_pair_calls(self, pairs, generation=0):
        self.builds += [(pair, generation) for pair in pairs]
        return [(receiver, (sender, receiver)) for sender, receiver in pairs]


def supervisor(outcomes, monkeypatch, peers=()):
    monkeypatch.setattr(supervisor_module, "RETRY_S", (0.0,))
    monkeypatch.setattr(supervisor_module, "log", lambda message: None)
    deployment = FakeDeployment(FakeRay(outcomes), peers)
    sup = Supervisor.__new__(Supervisor)
    sup.deployment, sup.ray, sup.restarting = deployment, deployment._ray, {"decode-0"}
    sup._lock, sup.pairing, sup._stop = threading.Lock(), threading.Lock(), threading.Event()
    sup._generations = iter(range(1, 100))
    return sup, deployment


def test_a_group_that_failed_to_build_with_both_workers_alive_is_built_again_in_a_new_group(monkeypatch):
    timed_out = RayError("rendezvous timed out")
    sup, deployment = supervisor({("prefill-0", "decode-0"): [timed_out, None],
                                  ("prefill-1", "decode-0"): [RayActorError("prefill-1 died")]}, monkeypatch)
    sup._pair("decode-0")
    assert deployment.builds == [(("prefill-0", "decode-0"), 1), (("prefill-1", "decode-0"), 1),
                                 (("prefill-0", "decode-0"), 2)]
    assert sup.restarting == set()


def test_a_group_that_never_builds_is_tried_a_bounded_number_of_times(monkeypatch):
    sup, deployment = supervisor({("prefill-0", "decode-0"): [RayError("refused")] * PAIR_TRIES,
                                  ("prefill-1", "decode-0"): [None]}, monkeypatch)
    sup._pair("decode-0")
    tries = [generation for pair, generation in deployment.builds if pair == ("prefill-0", "decode-0")]
    assert tries == list(range(1, PAIR_TRIES + 1))
    assert [g for pair, g in deployment.builds if pair == ("prefill-1", "decode-0")] == [1]


def test_a_restarted_decode_worker_is_paired_with_its_peers_both_ways_and_a_failed_peer_pair_again(monkeypatch):
    """With kv.peer_pull a decode worker started again builds its prefill pairs and, in the same
    generation, a pair each way with every peer; a peer pair that failed with both alive is
    built again alone, in the next generation; one whose peer is restarting is left to it."""
    timed_out = RayError("rendezvous timed out")
    sup, deployment = supervisor({("prefill-0", "decode-0"): [None], ("prefill-1", "decode-0"): [None],
                                  ("decode-1", "decode-0"): [None], ("decode-0", "decode-1"): [timed_out, None]},
                                 monkeypatch, peers=["decode-1", "decode-2"])
    sup.restarting = {"decode-0", "decode-2"}
    sup._pair("decode-0")
    assert deployment.builds == [(("prefill-0", "decode-0"), 1), (("prefill-1", "decode-0"), 1),
                                 (("decode-1", "decode-0"), 1), (("decode-0", "decode-1"), 1),
                                 (("decode-0", "decode-1"), 2)]
    assert sup.restarting == {"decode-2"}
