"""Transfer states and KV-head re-sharding between prefill and decode TP degrees."""

from __future__ import annotations

import pytest

from cluster.kv_transfer.resharding import HeadSlice, heads_of_rank, plan_head_slices
from cluster.kv_transfer.state import TransferRecord, TransferState, TransferStateError

pytestmark = pytest.mark.unit


def test_a_transfer_moves_through_its_states_layer_by_layer():
    record = TransferRecord.start("r1", num_layers=3, timeout_s=60)
    assert record.state is TransferState.WAITING
    record.layer_moved()
    assert record.state is TransferState.TRANSFERRING and record.layers_done == 1
    record.layer_moved()
    record.layer_moved()
    assert record.state is TransferState.DONE
    assert record.history == [TransferState.WAITING, TransferState.TRANSFERRING, TransferState.DONE]
    with pytest.raises(TransferStateError, match="layer moved while done"):
        record.layer_moved()


def test_terminal_states_are_final():
    record = TransferRecord.start("r2", num_layers=4, timeout_s=60)
    record.layer_moved()
    assert record.abort("decode worker cancelled") is True
    assert record.state is TransferState.ABORTED and record.error == "decode worker cancelled"
    assert record.fail("late peer error") is False
    assert record.state is TransferState.ABORTED
    with pytest.raises(TransferStateError):
        record.layer_moved()


def test_deadline_fails_a_stalled_transfer_once():
    record = TransferRecord.start("r3", num_layers=2, timeout_s=5)
    record.layer_moved()
    assert record.check_deadline(now=record.deadline - 1) is False
    assert record.check_deadline(now=record.deadline + 1) is True
    assert record.state is TransferState.FAILED
    assert record.error == "deadline passed after 1 of 2 layers"
    assert record.check_deadline(now=record.deadline + 2) is False


def test_heads_of_rank_split_and_replicated():
    assert [list(heads_of_rank(8, 2, r)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [list(heads_of_rank(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert list(heads_of_rank(4, 1, 0)) == [0, 1, 2, 3]


def test_prefill_tp2_to_decode_tp1_takes_half_from_each():
    assert plan_head_slices(4, sender_tp=2, receiver_tp=1) == [
        HeadSlice(sender=0, receiver=0, first_head=0, num_heads=2, sender_offset=0, receiver_offset=0),
        HeadSlice(sender=1, receiver=0, first_head=2, num_heads=2, sender_offset=0, receiver_offset=2),
    ]


def test_prefill_tp1_to_decode_tp2_splits_one_senders_heads():
    assert plan_head_slices(4, sender_tp=1, receiver_tp=2) == [
        HeadSlice(sender=0, receiver=0, first_head=0, num_heads=2, sender_offset=0, receiver_offset=0),
        HeadSlice(sender=0, receiver=1, first_head=2, num_heads=2, sender_offset=2, receiver_offset=0),
    ]


def test_replicated_heads_are_sent_by_alternating_replicas():
    slices = plan_head_slices(2, sender_tp=4, receiver_tp=2)
    assert [(s.sender, s.receiver, s.first_head, s.num_heads) for s in slices] == [(0, 0, 0, 1), (3, 1, 1, 1)]


@pytest.mark.parametrize("kv_heads, sender_tp, receiver_tp", [(8, 1, 1), (8, 2, 4), (8, 4, 2), (2, 4, 1), (1, 2, 4)])
def test_every_receiver_gets_each_of_its_heads_exactly_once(kv_heads, sender_tp, receiver_tp):
    slices = plan_head_slices(kv_heads, sender_tp, receiver_tp)
    for receiver in range(receiver_tp):
        got = sorted(h for s in slices if s.receiver == receiver for h in range(s.first_head, s.first_head + s.num_heads))
        assert got == list(heads_of_rank(kv_heads, receiver_tp, receiver))
    for s in slices:
        held = heads_of_rank(kv_heads, sender_tp, s.sender)
        assert held.start + s.sender_offset == s.first_head and s.first_head + s.num_heads <= held.stop
