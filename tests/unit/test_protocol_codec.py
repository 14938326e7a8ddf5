"""The stream's one codec: every message survives encode -> msgpack -> decode unchanged, and
data that is not a message (no tag, an unknown tag, a field the message lacks) is refused
with a clear error."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured.spec import StructuredOutput
from cluster.protocol.codec import MESSAGES, TAG, UnknownMessage, decode_message, encode_message
from cluster.protocol.messages import (FailureKind, Finished, Hello, PullReport, RequestFailed, ScaleProgress,
                                       ScaleRequest, ScaleResult, TokenDelta, TransferReport, Usage, WorkerFailure,
                                       WorkerRequest)

pytestmark = pytest.mark.unit

TRANSFER = TransferReport("prefill-0", 2, 3, 16, 4096, (1.0, 1.5), (1.0, 1.6), 1.7)
PULL = PullReport("decode-0", 5, 2, 3, 3 * 4096, (2.0, 2.25))
EXAMPLES = [
    Hello("s3cret"),
    WorkerRequest("r1.2", [1, 2, 3], SamplingParams(max_tokens=7, temperature=0.0, stop=("\n",), stop_token_ids=(5,),
                                                    seed=3, logprobs=2), 4, "prefill-1", 12.5, False),
    WorkerRequest("r2", [9], SamplingParams()),
    WorkerRequest("r3", list(range(80)), SamplingParams(), kv_source="decode-1", kv_source_blocks=4, pull_timeout_s=2.5),
    SamplingParams(top_k=4),
    SamplingParams(structured=StructuredOutput("grammar", 'root ::= "yes" | "no"', syntax="ebnf")),
    StructuredOutput("json_schema", '{"type": "object"}', source="tools"),
    TokenDelta([4, 5], "ab", [[-0.5, [[4, -0.5], [6, -1.0]]], [-0.1, []]]),
    TokenDelta([], "", transfer=TRANSFER),
    TokenDelta([], "", pull=PULL),
    PULL,
    PullReport("decode-1", 4, 0, 0, 0, (3.0, 8.0), "decode-1 did not answer within 5s (kv.pull_timeout_s)"),
    TokenDelta([7], "c", end=Finished("length", Usage(3, 1, 8))),
    Finished("stop", Usage(1, 0, 1)),
    Usage(1, 2, 3),
    TRANSFER,
    WorkerFailure(FailureKind.RETRY, "prefill worker prefill-0 died", "prefill-0"),
    WorkerFailure(FailureKind.NO_ROOM, "decode-0 has no free KV blocks for this prompt now"),
    WorkerFailure(FailureKind.UNPAIRED, "KV transfer failed: receive: timed out", "prefill-1"),
    RequestFailed("invalid", "max_tokens must be >= 1"),
    ScaleRequest("move", role="decode", worker="prefill-1", timeout_s=30.0),
    ScaleProgress("decode-0 draining: routers place on it no more"),
    ScaleResult(True, worker="decode-2", members={"prefill": ["prefill-0"], "decode": ["decode-1", "decode-2"]}),
    ScaleResult(False, "worker: 'decode-9' is not a worker of this cluster; its workers: prefill-0, decode-0"),
]


def over_the_wire(message):
    return decode_message(msgpack.unpackb(msgpack.packb(encode_message(message), use_bin_type=True), raw=False))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    back = over_the_wire(message)
    assert type(back) is type(message) and back == message


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(MESSAGES.values())


def test_a_pull_choice_and_its_report_cross_the_stream_as_typed_fields():
    """The router's pull choice rides on the worker request, and what the pull did on the delta
    that brings the first tokens; a request that pulls nothing carries neither."""
    request = over_the_wire(EXAMPLES[3])
    assert (request.kv_source, request.kv_source_blocks, request.pull_timeout_s) == ("decode-1", 4, 2.5)
    assert request.prefill is None
    plain = encode_message(WorkerRequest("r", [1], SamplingParams()))
    assert (plain["kv_source"], plain["kv_source_blocks"]) == (None, 0)
    delta = over_the_wire(TokenDelta([], "", pull=PULL))
    assert delta.pull.span == (2.0, 2.25) and isinstance(delta.pull.span, tuple)
    assert (delta.pull.blocks_held, delta.pull.blocks_pulled, delta.pull.error) == (2, 3, None)


def test_the_plain_data_is_made_from_the_fields():
    data = encode_message(WorkerFailure(FailureKind.NO_ROOM, "full"))
    assert data == {TAG: "WorkerFailure", **{f.name: None for f in dataclasses.fields(WorkerFailure)},
                    "kind": "no_room", "message": "full"}
    assert isinstance(over_the_wire(WorkerFailure(FailureKind.NO_ROOM, "full")).kind, FailureKind)


def test_an_unknown_tag_is_refused_naming_it():
    with pytest.raises(UnknownMessage, match="unknown message type 'Pickle'; known: .*WorkerRequest"):
        decode_message({TAG: "Pickle", "payload": 1})


def test_data_without_a_tag_or_with_a_foreign_field_is_refused():
    with pytest.raises(UnknownMessage, match="no '@type' tag"):
        decode_message({"token": "guess"})
    with pytest.raises(UnknownMessage, match="Hello has no field"):
        decode_message({TAG: "Hello", "token": "x", "extra": 1})
    with pytest.raises(UnknownMessage, match="Hello: .*token"):
        decode_message({TAG: "Hello"})


def test_a_dataclass_that_is_not_a_message_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Stranger:
        x: int = 1

    with pytest.raises(UnknownMessage, match="Stranger is not a stream message"):
        encode_message(Stranger())
