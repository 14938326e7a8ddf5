"""Tool calls and the Responses API through Tandem's real HTTP server with the official ``openai``
package as the client, over a fake request path whose model writes scripted text: the shapes of
``tool_choice: auto`` (where a tiny random model would never choose a call) streamed and whole,
a tool round trip's turns reaching the template, ``responses.create``/``stream``/``parse`` with
a function tool and with ``text.format``, the Responses API's refusals, and a body nested too
deeply to read (a 400, not a 500).

The constrained paths (``required``, a named function) with a real model are in
``tests/e2e/test_openai_api.py``."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pydantic
import pytest

from cluster.engine.tool_calls.formats import FORMATS, ToolCalling
from cluster.ingress.http_server import start_http
from cluster.protocol.messages import Ending, Finished, Output, Timings, Usage
from router.router import Decision

pytestmark = pytest.mark.integration

MODEL = "fake-model"
WEATHER_ARGS = '{"city": "Paris", "units": "C"}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>'
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "units": {"enum": ["C", "F"]}},
              "required": ["city", "units"]}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                              "parameters": PARAMETERS}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": PARAMETERS}


class Info:
    model_name = MODEL
    max_model_len = 4096


class ScriptedPath:
    """The request path's interface; the model's text is picked by the last message: a tool
    result gets a final answer, "json" a JSON answer, anything else a call (in pieces that cut
    the trigger and the arguments)."""

    info = Info()
    tokenizer = None
    tool_calling = ToolCalling(FORMATS["hermes"], polyfill=True)

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        last = request.prompt.messages[-1]
        if last["role"] == "tool":
            pieces = ["It is ", "18 C in Paris."]
        elif "json" in last["content"]:
            pieces = ['{"city": "Paris", ', '"temperature": 18}']
        else:
            pieces = ["Let me check", ".\n<tool", "_call>\n", CALL[len("<tool_call>\n"):30], CALL[30:55], CALL[55:]]
        for index, piece in enumerate(pieces):
            await asyncio.sleep(0)
            end = None
            if index == len(pieces) - 1:
                end = Ending(Finished("stop", Usage(20, 0, len(pieces))), Timings(1.0, 2.0, 3.0, 4.0),
                             Decision("place", "r", None, "decode-0"), None, 0)
            yield Output([index + 5], piece, request_id="r" if index == 0 else "", end=end)


@pytest.fixture(scope="module")
def served():
    path = ScriptedPath()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, port, _ = asyncio.run_coroutine_threadsafe(start_http(path, "127.0.0.1", 0, None), loop).result(30)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
    yield path, client
    client.close()
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    loop.close()


def test_auto_tool_call_whole_and_streamed(served):
    path, client = served
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_TOOL])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", WEATHER_ARGS)
    assert call.id.startswith("call_")
    assert path.requests[-1].sampling["structured"].kind == "structural_tag"

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_TOOL], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id.startswith("call_") and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert all(t.index == 0 for t in calls) and all(t.id is None and t.function.name is None for t in calls[1:])
    assert "".join(t.function.arguments for t in calls) == WEATHER_ARGS
    assert len(calls) > 2  # the arguments came in pieces, as written
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_round_trip_feeds_the_call_and_its_result_back(served):
    path, client = served
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_TOOL])
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[CHAT_TOOL])
    assert final.choices[0].message.content == "It is 18 C in Paris." and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None
    sent = path.requests[-1].prompt.messages
    assert sent[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": WEATHER_ARGS}
    assert sent[2] == {"role": "tool", "tool_call_id": call.id, "content": "18 C"}


def test_responses_with_a_function_tool(served):
    path, client = served
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[RESPONSES_TOOL], store=False)
    assert response.status == "completed" and response.output_text == "Let me check."
    message, call = response.output
    assert message.type == "message" and call.type == "function_call"
    assert (call.name, call.arguments, call.status) == ("get_weather", WEATHER_ARGS, "completed")
    assert response.usage.input_tokens == 20 and response.usage.output_tokens == 6

    follow_up = client.responses.create(model=MODEL, tools=[RESPONSES_TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert follow_up.output_text == "It is 18 C in Paris."
    assert path.requests[-1].prompt.messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}

    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[RESPONSES_TOOL]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == WEATHER_ARGS
    assert final.output[1].arguments == WEATHER_ARGS and final.output_text == "Let me check."


class Weather(pydantic.BaseModel):
    city: str
    temperature: int


def test_responses_with_text_format(served):
    path, client = served
    parsed = client.responses.parse(model=MODEL, input="Answer in json", text_format=Weather)
    assert parsed.output_parsed == Weather(city="Paris", temperature=18)
    spec = path.requests[-1].sampling["structured"]
    assert (spec.kind, spec.source) == ("json_schema", "text.format")
    assert json.loads(spec.value)["required"] == ["city", "temperature"]
    plain = client.responses.create(model=MODEL, input="json please", text={"format": {"type": "json_object"}})
    assert json.loads(plain.output_text) == {"city": "Paris", "temperature": 18}


@pytest.mark.parametrize("fields,words", [
    ({"store": True}, "store: responses are not kept on this server"),
    ({"previous_response_id": "resp_123"}, "previous_response_id: responses are not kept on this server"),
    ({"tools": [{"type": "web_search_preview"}]}, "'web_search_preview' tools are not supported by this server"),
])
def test_responses_refusals_reach_the_client(served, fields, words):
    _, client = served
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", **fields)
    assert words in caught.value.message
    with pytest.raises(openai.NotFoundError, match="responses are not kept"):
        client.responses.retrieve("resp_123")


def test_a_body_nested_too_deeply_is_a_400_naming_the_body(served):
    _, client = served
    deep = "[" * 5000 + "]" * 5000
    for path in ("responses", "chat/completions"):
        response = httpx.post(f"{client.base_url}{path}", content=deep, headers={"Content-Type": "application/json"})
        assert response.status_code == 400
        assert response.json()["error"]["message"] == "the request body nests arrays and objects more than 64 levels deep"
