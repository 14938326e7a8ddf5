"""Workloads and arrivals of ``tandem bench``: trace parsing (hash ids -> shared blocks), the
generators, and the arrival processes (a seeded Poisson stream has its rate)."""

import json
import statistics

import pytest

from cluster.bench.arrivals import ArrivalError, Arrivals, poisson_offsets
from cluster.bench.workloads import (Session, Turn, WorkloadError, cap, chat, mooncake_prompt, parse_length,
                                     read_mooncake, read_sharegpt, synthetic)

pytestmark = pytest.mark.unit


def write_trace(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_mooncake_equal_hash_ids_give_equal_token_blocks(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 1000, "input_length": 1024, "output_length": 10, "hash_ids": [7, 8]},
        {"timestamp": 1500, "input_length": 1200, "output_length": 20, "hash_ids": [7, 8, 9]},
        {"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [5, 8]},
    ])
    workload = read_mooncake(trace, vocab_size=1000)
    a, b, c = (s.turns[0].user for s in workload.sessions)
    assert (len(a), len(b), len(c)) == (1024, 1200, 700)
    assert a == b[:1024]  # hash ids 7, 8 in common: the same 1024 tokens
    assert b[1024:1200] == mooncake_prompt(1200, [7, 8, 9], 1000)[1024:]
    assert c[:512] != a[:512]  # hash 5 is not hash 7
    assert c[512:700] == a[512:700]  # hash 8's block, cut at the input length
    assert [s.at_s for s in workload.sessions] == [0.0, 0.5, 2.0]
    assert [s.turns[0].max_tokens for s in workload.sessions] == [10, 20, 5]
    assert workload.has_timestamps


def test_mooncake_block_tokens_scale_lengths_and_keep_sharing(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 512, "output_length": 64, "hash_ids": [1]},
    ])
    a, b = (s.turns[0] for s in read_mooncake(trace, 1000, block_tokens=32).sessions)
    assert (len(a.user), len(b.user), a.max_tokens) == (64, 32, 4)
    assert a.user[:32] == b.user


def test_mooncake_prompt_past_the_hash_ids_is_unique_per_request():
    one = mooncake_prompt(600, [3], 1000, unique="a")
    two = mooncake_prompt(600, [3], 1000, unique="b")
    assert one[:512] == two[:512] and one[512:] != two[512:]


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 1, "input_length": 5}', "needs 'output_length'"),
    ('{"timestamp": "x", "input_length": 5, "output_length": 1}', "must be numbers"),
    ("not json", "not valid JSON"),
])
def test_mooncake_bad_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\n' + line + "\n")
    with pytest.raises(WorkloadError, match=rf"bad.jsonl:2: .*{message}"):
        read_mooncake(path, 1000)


def test_sharegpt_takes_human_prompts_and_gpt_answer_lengths(tmp_path):
    data = [{"conversations": [{"from": "human", "value": "a b c"}, {"from": "gpt", "value": "d e"},
                               {"from": "human", "value": "f"}, {"from": "gpt", "value": "g h i j"}]},
            {"conversations": [{"from": "gpt", "value": "orphan"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    words = {}

    def tokenize(text):
        return [words.setdefault(w, 100 + len(words)) for w in text.split()]

    one = read_sharegpt(path, tokenize)
    assert len(one.sessions) == 1 and len(one.sessions[0].turns) == 1
    assert one.sessions[0].turns[0].max_tokens == 2 and len(one.sessions[0].turns[0].user) == 3
    multi = read_sharegpt(path, tokenize, multi_turn=True)
    assert [t.max_tokens for t in multi.sessions[0].turns] == [2, 4]


def test_chat_sessions_share_system_prompts_and_carry_history():
    workload = chat(20, parse_length("3"), 2, parse_length("64"), parse_length("8"), parse_length("4"), 0.5, 1000)
    prefixes = {s.prefix for s in workload.sessions}
    assert len(prefixes) == 2 and all(len(p) == 64 for p in prefixes)
    session = workload.sessions[0]
    second = session.prompt(1, [[11, 12, 13, 14]])
    assert second == list(session.prefix) + list(session.turns[0].user) + [11, 12, 13, 14] + list(session.turns[1].user)
    assert session.request_id(1) == "c0.t1" and workload.requests == 60
    assert cap(workload, 7).requests == 7


def test_synthetic_is_seeded_and_in_range():
    a = synthetic(50, parse_length("10-20"), parse_length("5"), 300, seed=3)
    b = synthetic(50, parse_length("10-20"), parse_length("5"), 300, seed=3)
    assert a == b
    assert all(10 <= len(s.turns[0].user) <= 20 and s.turns[0].max_tokens == 5 for s in a.sessions)
    assert all(10 <= t < 300 for s in a.sessions for t in s.turns[0].user)


@pytest.mark.parametrize("text, kind", [("128", "fixed"), ("64-512", "uniform"), ("normal:256,64", "normal"),
                                        ("exp:100", "exp")])
def test_lengths_parse(text, kind):
    assert parse_length(text).kind == kind and str(parse_length(text)) == text


@pytest.mark.parametrize("text", ["0", "9-3", "abc", "normal:1", "exp:0"])
def test_bad_lengths_name_the_flag(text):
    with pytest.raises(WorkloadError, match="--input-len"):
        parse_length(text, "--input-len")


def test_seeded_poisson_stream_has_the_right_rate():
    offsets = poisson_offsets(rate=4.0, count=20000, seed=7)
    gaps = [b - a for a, b in zip([0.0] + offsets, offsets)]
    assert offsets == poisson_offsets(4.0, 20000, seed=7)
    assert len(offsets) / offsets[-1] == pytest.approx(4.0, rel=0.03)
    # exponential gaps: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.05)


def test_constant_burst_and_trace_offsets():
    assert Arrivals("constant", rate=2.0).offsets(4) == [0.0, 0.5, 1.0, 1.5]
    assert Arrivals("burst", rate=2.0, burst_size=3).offsets(7) == [0, 0, 0, 1.5, 1.5, 1.5, 3.0]
    assert Arrivals("trace", speedup=2.0).offsets(3, [0.0, 1.0, 4.0]) == [0.0, 0.5, 2.0]
    with pytest.raises(ArrivalError, match="--arrival trace"):
        Arrivals("trace").offsets(2, [None, None])
    with pytest.raises(ArrivalError, match="--rate"):
        Arrivals("poisson")
    with pytest.raises(ArrivalError, match="--concurrency"):
        Arrivals("concurrency", concurrency=0)


def test_session_prompt_of_a_single_turn_is_its_tokens():
    s = Session("x", (Turn((1, 2, 3), 4),))
    assert s.prompt(0, []) == [1, 2, 3] and s.request_id(0) == "x"
