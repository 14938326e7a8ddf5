"""The OpenAI-compatible HTTP API end to end, with the official ``openai`` package as the client:
chat and completions, streamed and not, usage with cached tokens on a second turn, ``n``,
seeds, stop strings, logprobs, structured output (``chat.completions.parse`` with a pydantic
model, a nested JSON schema sampled 50 times, Tandem's regex, choice and grammar fields, the
same schema through gRPC), every error status, and a disconnect that frees every block.
Tool calls: a round trip (call, ``tool`` result, final answer) with ``tool_choice`` required,
streamed calls, ``responses.create`` with a function tool and with ``text.format``, and the same
round trip through the gRPC API; the random model's calls always parse and match the schema
because the output is constrained.

One cluster (1 prefill + 1 decode worker, the small test checkpoint with a ChatML template that
knows nothing of tools, so tools reach it through Tandem's tool prompt), behind a bearer token.
Greedy answers are compared with `tandem run` on the same messages.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from conftest import random_prompts, wait_for
from e2e_cluster import Cluster, tandem, topology
from tandem import TandemClient, TandemError

pytestmark = pytest.mark.e2e

TOKEN = "sk-tandem-test"
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "The quick brown fox"}]
PROMPT = "The quick brown fox jumps over the lazy dog. A"


@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("chat-model") / "tiny-chat"
    shutil.copytree(checkpoint("llama", max_position_embeddings=2048), directory)  # room for a tool prompt
    (directory / "chat_template.jinja").write_text(CHATML)
    return directory


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    spec = topology("e2e-openai", model_dir, server={"auth_token_env": "E2E_OPENAI_TOKEN"}, kv={"num_blocks": 160},
                    ray={"restart_workers": False})  # the last test kills the decode worker to see a 503
    cluster = Cluster("e2e-openai", spec, tmp, env={"E2E_OPENAI_TOKEN": TOKEN})
    yield cluster
    if (cluster.cache / "clusters" / "e2e-openai.json").exists():
        cluster.down()


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.state["http"], api_key=TOKEN, max_retries=0, timeout=120)


def tandem_run(model_dir: Path, tmp: Path, lines: list[dict]) -> dict:
    source, out = tmp / "in.jsonl", tmp / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = tandem("run", "--model", str(model_dir), "--input", str(source), "--output", str(out), "--quiet",
                    "--num-kv-blocks", "64")
    assert result.returncode == 0, result.stderr
    return {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}


def test_models_and_greedy_chat_and_completions_equal_tandem_run(client, model_dir, tmp_path):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    reference = tandem_run(model_dir, tmp_path, [
        {"id": "chat", "messages": CHAT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"id": "text", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}])
    chat = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == reference["chat"]["text"]
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 12
    assert chat.usage.prompt_tokens == reference["chat"]["usage"]["prompt_tokens"]
    streamed = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=12, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert text.choices[0].text == reference["text"]["text"]
    pieces = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=12, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(p.choices[0].text for p in pieces if p.choices) == reference["text"]["text"]


def test_a_second_turn_reports_its_cached_tokens(client):
    first = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=20, temperature=0,
                                           extra_body={"ignore_eos": True})
    turn = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(model="tiny-chat", messages=turn, max_tokens=4, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the first turn's full blocks, and where its tokens go on, a part of the next (a partial hit)
    assert 16 <= cached < second.usage.prompt_tokens


def test_n_choices_seeds_stop_strings_and_logprobs(client):
    sampled = dict(model="tiny-chat", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=123,
                   extra_body={"ignore_eos": True})
    three = client.completions.create(n=3, **sampled)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    assert three.usage.completion_tokens == 24
    again = client.completions.create(n=3, **sampled)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]  # a seed gives the same answers
    greedy = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 2]
    stopped = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == greedy[:greedy.index(stop)]
    with_logprobs = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=2)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == with_logprobs.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the top token
    assert "".join(t.token for t in content) == with_logprobs.choices[0].message.content


def test_every_error_status(client, cluster):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny-chat", messages=CHAT, temperature=-1)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.BadRequestError) as unknown:
        client.completions.create(model="tiny-chat", prompt=PROMPT, extra_body={"colour": "blue"})
    assert unknown.value.body["param"] == "colour"
    with pytest.raises(openai.BadRequestError, match="messages\\[0\\].role"):
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "wizard", "content": "x"}])
    wrong = openai.OpenAI(base_url=cluster.state["http"], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt=PROMPT)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model="tiny-chat", prompt=PROMPT, extra_body={"slo_class": "interactive",
                                                                                "ttft_ms": 0.001})
    assert "rejected by admission control" in refused.value.message


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    kind: Literal["fox", "dog", "cat"]
    age: int = pydantic.Field(ge=0, le=20)


# Nested objects, enums and arrays, every string and array bounded: every output of the tiny
# random model completes within max_tokens, sampled at temperature 1.
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "status": {"enum": ["open", "closed", "pending"]},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                         "zone": {"enum": ["north", "south"]}},
                        "required": ["city", "zone"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "object", "properties": {
            "k": {"type": "string", "maxLength": 3}, "v": {"type": "boolean"}},
            "required": ["k", "v"], "additionalProperties": False}, "maxItems": 2},
    },
    "required": ["id", "status", "owner", "tags", "scores"],
    "additionalProperties": False,
}


def test_chat_completions_parse_gives_the_pydantic_model(client):
    completion = client.chat.completions.parse(model="tiny-chat", messages=CHAT, response_format=Pet,
                                               temperature=0, max_tokens=300)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content)


def test_a_nested_json_schema_validates_50_of_50_sampled_at_temperature_1(client):
    choices = []
    for seed, n in ((1, 16), (100, 16), (200, 16), (300, 2)):
        response = client.chat.completions.create(
            model="tiny-chat", messages=CHAT, n=n, seed=seed, temperature=1.0, max_tokens=600,
            response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD,
                                                                    "strict": True}})
        choices += response.choices
    assert len(choices) == 50
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), RECORD)
    assert len({c.message.content for c in choices}) > 40  # sampled: nearly all differ


def test_tandems_own_structured_fields_and_a_json_object(client):
    regex = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=4,
                                      extra_body={"regex": "(fox|dog)-[0-9]{2}"}).choices[0]
    assert re.fullmatch("(fox|dog)-[0-9]{2}", regex.text) and regex.finish_reason == "stop"
    choice = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=5,
                                       extra_body={"choice": ["left", "right"]}).choices[0]
    assert choice.text in ("left", "right") and choice.finish_reason == "stop"
    grammar = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=40, temperature=0,
                                             extra_body={"grammar": 'start: "(" /[a-c]{1,5}/ ")"',
                                                         "grammar_syntax": "lark"}).choices[0]
    assert re.fullmatch(r"\([a-c]{1,5}\)", grammar.message.content)
    obj = client.chat.completions.create(model="tiny-chat", messages=CHAT, max_tokens=400, temperature=0,
                                         response_format={"type": "json_object"}).choices[0]
    if obj.finish_reason == "stop":  # greedy on a random model may not close its object within max_tokens
        assert isinstance(json.loads(obj.message.content), dict)
    else:
        assert obj.finish_reason == "length" and obj.message.content.startswith("{")


def test_a_spec_that_does_not_compile_is_a_400_naming_its_field(client, cluster):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="tiny-chat", messages=CHAT, response_format=bad_schema)
    assert bad.value.body["param"] == "response_format"
    assert bad.value.body["message"] == "response_format: the JSON schema is not valid: Invalid type: strin"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-chat", prompt=PROMPT, stream=True, extra_body={"regex": "a(b"})
    assert bad.value.body["param"] == "regex" and "unclosed group" in bad.value.message
    with pytest.raises(openai.BadRequestError) as both:
        client.completions.create(model="tiny-chat", prompt=PROMPT, extra_body={"regex": "a", "choice": ["a"]})
    assert both.value.body["param"] == "choice"
    with TandemClient(cluster.api, token=TOKEN, timeout_s=60) as grpc_client:
        with pytest.raises(TandemError) as refused:
            list(grpc_client.generate(PROMPT, json_schema={"type": "object", "if": {}}))
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert refused.value.message == 'sampling.json_schema: the JSON schema is not valid: Unimplemented keys: ["if"]'
    assert cluster.status()["in_flight"] == 0  # refused at the edge: nothing was placed


def test_grpc_generate_with_a_json_schema(cluster):
    with TandemClient(cluster.api, token=TOKEN, timeout_s=120) as grpc_client:
        responses = list(grpc_client.generate(PROMPT, json_schema=RECORD, temperature=1.0, seed=9, max_tokens=600))
    assert responses[-1].finished and responses[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(r.text for r in responses)), RECORD)


def test_a_disconnected_stream_frees_every_block(cluster):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"model": "tiny-chat", "prompt": random_prompts([40], seed=3)[0], "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    log = cluster.cache / "clusters" / "e2e-openai.log"
    logged = log.stat().st_size if log.exists() else 0
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            with http.stream("POST", f"{cluster.state['http']}/completions", json=body, headers=headers) as events:
                lines = events.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))  # streaming: then hang up
    status = wait_for(lambda: (s := cluster.status()) and all(
        w["kv_blocks_used"] == 0 and w["running"] == 0 for w in s["workers"]) and s, 60, "every block to be free",
        every_s=0.5)
    assert status["in_flight"] == 0
    with open(log, errors="replace") as text:  # a hang-up is no fault of the server's: nothing in its log
        text.seek(logged)
        assert "Traceback" not in text.read()


# -- tool calls ---------------------------------------------------------------------------------

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                   "unit": {"enum": ["C", "F"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_tool_round_trip_with_tool_choice_required(client):
    first = client.chat.completions.create(model="tiny-chat", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=3)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    turn = ASK + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    final = client.chat.completions.create(model="tiny-chat", messages=turn, tools=[WEATHER], tool_choice="none",
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason == "length"
    assert final.choices[0].message.content and final.usage.completion_tokens == 8
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result went into the prompt
    # the tools stay in the prompt (tool_choice none only stops calls): the first turn's blocks are reused
    assert final.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32


def test_streamed_tool_calls_with_tool_choice_required(client):
    asked = dict(model="tiny-chat", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=300,
                 temperature=0)
    whole = client.chat.completions.create(**asked).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **asked))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls and all(d.content in (None, "") for d in deltas)
    opened = [t for t in calls if t.id is not None]
    assert [t.function.name for t in opened] == [c.function.name for c in whole.message.tool_calls]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.finish_reason]
    assert whole.finish_reason in ("tool_calls", "length")  # several parallel calls may run out of tokens
    complete = whole.message.tool_calls[:-1] if whole.finish_reason == "length" else whole.message.tool_calls
    assert complete
    for index, call in enumerate(whole.message.tool_calls):  # greedy: the stream says what the whole answer says
        streamed = "".join(t.function.arguments or "" for t in calls if t.index == index)
        assert streamed == call.function.arguments
        if call in complete:
            jsonschema.validate(json.loads(streamed), WEATHER_SCHEMA)


def test_responses_with_a_function_tool_and_with_text_format(client):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": WEATHER_SCHEMA}
    called = client.responses.create(model="tiny-chat", input="Weather in Rome?", tools=[tool],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                                     store=False)
    assert called.status == "completed"
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    answer = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    formatted = client.responses.create(model="tiny-chat", input="Is it sunny in Rome?", max_output_tokens=100,
                                        text={"format": {"type": "json_schema", "name": "weather", "schema": answer,
                                                         "strict": True}})
    assert formatted.status == "completed"
    jsonschema.validate(json.loads(formatted.output_text), answer)


def test_a_tool_round_trip_through_grpc(cluster):
    with TandemClient(cluster.api, token=TOKEN, timeout_s=120) as grpc_client:
        responses = list(grpc_client.generate(ASK, tools=[WEATHER], tool_choice="get_weather", max_tokens=200,
                                              temperature=0))
        calls = [c for r in responses for c in r.tool_calls]
        assert responses[-1].finish_reason == "tool_calls" and "".join(r.text for r in responses) == ""
        [call] = calls
        assert call.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
        turn = ASK + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
        final = list(grpc_client.generate(turn, tools=[WEATHER], tool_choice="none", max_tokens=6, temperature=0,
                                          ignore_eos=True))
        assert final[-1].finish_reason == "length" and not [c for r in final for c in r.tool_calls]
        assert "".join(r.text for r in final) and final[-1].usage.prompt_tokens > responses[-1].usage.prompt_tokens


def test_no_worker_left_is_503(client, cluster):
    cluster.ray("ray.kill(ray.get_actor('decode-0'))")
    deadline = time.monotonic() + 60
    while True:  # the first call finds the worker dead; after it, every call knows
        try:
            client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=2)
        except openai.InternalServerError as exc:
            assert exc.status_code == 503 and "decode" in exc.message
            break
        assert time.monotonic() < deadline, "decode-0 was never found dead"

