"""Chat messages as requests: ``tandem run`` lines with ``messages`` run the model's template
before tokenization (the token ids the scheduler and the router's block hashes see), a second
turn reuses the first turn's cached blocks, and a bad line names its field."""

from __future__ import annotations

import io
import json

import pytest
from gguf import GGMLQuantizationType

from cluster.engine.chat_template import ChatPrompt
from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.offline.run_file import run_file
from gguf_files import write_gguf

pytestmark = pytest.mark.integration

CHATML = (
    "{% for message in messages %}{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)
FIRST = [{"role": "system", "content": "You are a terse assistant who answers questions about objects."},
         {"role": "user", "content": "The quick brown fox jumps over the lazy dog. What jumps?"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def chat_gguf(checkpoint, tmp_path_factory):
    return write_gguf(checkpoint("llama"), tmp_path_factory.mktemp("chat") / "chat.gguf",
                      GGMLQuantizationType.Q8_0, chat_template=CHATML)


@pytest.fixture(scope="module")
def llm(chat_gguf):
    with LLM(str(chat_gguf), verbose=False, num_kv_blocks=64, block_size=4) as engine:
        yield engine


def run_lines(llm, lines) -> dict[str, dict]:
    out = io.StringIO()
    run_file(llm, [json.dumps(line) + "\n" for line in lines], out, progress=False)
    return {row["id"]: row for row in map(json.loads, out.getvalue().splitlines())}


def test_messages_run_as_their_templated_token_ids(llm):
    templated = llm.engine.tokenizer.apply_chat_template(FIRST)
    assert templated[:1] == [llm.engine.tokenizer.token_to_id("<s>")]
    rows = run_lines(llm, [{"id": "chat", "messages": FIRST, **GREEDY},
                           {"id": "ids", "prompt_token_ids": templated, **GREEDY}])
    assert rows["chat"]["error"] is None and rows["chat"]["token_ids"] == rows["ids"]["token_ids"]
    assert rows["chat"]["usage"]["prompt_tokens"] == len(templated)


def test_second_turn_hits_the_prefix_cache(llm):
    first = llm.generate([ChatPrompt(FIRST)], SamplingParams(**GREEDY))[0]
    second_turn = FIRST + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]
    second = llm.generate([ChatPrompt(second_turn)], SamplingParams(**GREEDY))[0]
    assert second.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    assert second.usage.cached_tokens >= len(first.prompt_token_ids) // 4 * 4 - 4


@pytest.mark.parametrize("line,words", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, ["messages[0].role", "wizard"]),
    ({"messages": [{"role": "user"}]}, ["messages[0].content is missing"]),
    ({"messages": "hi"}, ["messages must be a non-empty list"]),
    ({"messages": FIRST, "prompt": "hi"}, ["exactly one of", "'messages'"]),
    ({"prompt": "hi", "tools": []}, ["'tools' goes with 'messages'"]),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, ["'messages' is not valid Unicode"]),
])
def test_bad_chat_lines_fail_alone_naming_the_field(llm, line, words):
    rows = run_lines(llm, [{"id": "bad", **line}, {"id": "good", "messages": FIRST, **GREEDY}])
    assert rows["good"]["error"] is None and len(rows["good"]["token_ids"]) == GREEDY["max_tokens"]
    assert rows["bad"]["finish_reason"] == "error"
    for word in words:
        assert word in rows["bad"]["error"], rows["bad"]["error"]


def test_disaggregated_runs_messages_as_the_colocated_engine_does(llm, chat_gguf):
    """``tandem run --disaggregated`` with a ``messages`` line: the chat goes down the request
    path templated, as it does in the colocated engine (it raised a TypeError instead)."""
    from cluster.offline.disaggregated import DisaggregatedLLM
    from cluster.runtime.ray_runtime import ensure_ray

    lines = [{"id": "chat", "messages": FIRST, **GREEDY}]
    ray = ensure_ray("tandem-chat-tests", num_cpus=4)
    try:
        with DisaggregatedLLM.from_args(str(chat_gguf), cluster_name="tandem-chat-tests", verbose=False,
                                        num_kv_blocks=64, block_size=4) as disaggregated:
            rows = run_lines(disaggregated, lines)
    finally:
        ray.shutdown()
    expected = run_lines(llm, lines)["chat"]
    assert rows["chat"]["error"] is None
    assert (rows["chat"]["token_ids"], rows["chat"]["usage"]["prompt_tokens"]) == (
        expected["token_ids"], expected["usage"]["prompt_tokens"])
