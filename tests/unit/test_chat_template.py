"""Chat templates: rendered text and token ids equal ``transformers``' ``apply_chat_template``
for templates in the styles models ship (ChatML with a default system prompt, Llama 3 with
BOS, tools and loop controls, one that refuses with ``raise_exception``, a Hermes/Qwen tool-use
template fed tool calls and results); Tandem's tool prompt for a template that knows no tools;
where the template is found; bad messages named by field; and the sandbox."""

from __future__ import annotations

import json

import pytest

from cluster.engine.chat_template import ChatTemplate, ChatTemplateError
from cluster.engine.tokenizer import Tokenizer
from conftest import train_tokenizer

pytestmark = pytest.mark.unit

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
    "{% for tool in tools %}{{ tool | tojson(indent=2) }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}{% continue %}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% if loop.index > 8 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
ALTERNATING = (
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '[' + message['role'] + '] ' + message['content'] + eos_token }}{% endfor %}"
)
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<s>", "</s>"]
CONVERSATION = [
    {"role": "system", "content": "Be brief. Émile says «bonjour» 🙂"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "  Paris.  "},
    {"role": "user", "content": "And of Japan?"},
]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Finds a city — fast",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
HERMES_TOOLS = (  # Qwen 2.5's shape: tools in the system turn, calls as <tool_call> JSON, results as user turns
    "{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}"
    "{%- else %}{% set system = 'You are helpful.' %}{% endif %}"
    "<|im_start|>system\n{{ system }}{% if tools %}\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}"
    "{% endfor %}\n</tools>{% endif %}<|im_end|>\n"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}\n{{ message.content }}"
    "{% endif %}{% for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", "
    "\"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def model_dir(tmp_path, template: str | None, bos: str = "<|begin_of_text|>", eos: str = "<|im_end|>",
              jinja: str | None = None):
    directory = tmp_path / "model"
    directory.mkdir(parents=True, exist_ok=True)
    train_tokenizer(directory)
    raw = json.loads((directory / "tokenizer.json").read_text())
    base = len(raw["model"]["vocab"])
    raw["added_tokens"] += [{"id": base + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, t in enumerate(SPECIAL)]
    (directory / "tokenizer.json").write_text(json.dumps(raw))
    config = {"bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (directory / "chat_template.jinja").write_text(jinja)
    return directory


def transformers_render(directory, messages, tools=None, tokenize=False):
    import transformers

    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    return reference.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=tokenize,
                                         **({"return_dict": False} if tokenize else {}))


@pytest.mark.parametrize("template,tools", [(CHATML, None), (LLAMA3, None), (LLAMA3, TOOLS), (ALTERNATING, None)],
                         ids=["chatml", "llama3", "llama3-tools", "alternating"])
def test_render_and_token_ids_equal_transformers(tmp_path, template, tools):
    directory = model_dir(tmp_path, template)
    tokenizer = Tokenizer(directory)
    messages = CONVERSATION[1:] if template is ALTERNATING else CONVERSATION
    text = tokenizer.chat_template.render(messages, tools=tools)
    assert text == transformers_render(directory, messages, tools)
    assert tokenizer.apply_chat_template(messages, tools=tools) == transformers_render(directory, messages, tools, True)
    if template is LLAMA3:
        assert tokenizer.apply_chat_template(messages)[0] == tokenizer.token_to_id("<|begin_of_text|>")
        assert tokenizer.apply_chat_template(messages).count(tokenizer.token_to_id("<|begin_of_text|>")) == 1


def test_template_refusal_is_one_clear_error(tmp_path):
    tokenizer = Tokenizer(model_dir(tmp_path, ALTERNATING))
    with pytest.raises(ChatTemplateError, match="the chat template refused the messages: Conversation roles must "
                                                "alternate"):
        tokenizer.chat_template.render(CONVERSATION)


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    tokenizer = Tokenizer(model_dir(tmp_path, CHATML, jinja="{{ messages[0]['content'] }}!"))
    assert tokenizer.chat_template.render([{"role": "user", "content": "hi"}]) == "hi!"
    named = model_dir(tmp_path / "named", [{"name": "tool_use", "template": "no"},
                                           {"name": "default", "template": "{{ eos_token }}"}])
    assert Tokenizer(named).chat_template.render([{"role": "user", "content": "x"}]) == "<|im_end|>"
    assert Tokenizer(model_dir(tmp_path / "none", None)).chat_template is None


@pytest.mark.parametrize("messages,error", [
    ([], "messages must be a non-empty list"),
    ("hello", "messages must be a non-empty list"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object with 'role' and 'content'"),
    ([{"content": "a"}], r"messages\[0\]\.role is missing"),
    ([{"role": "wizard", "content": "a"}], r"messages\[0\]\.role must be one of system, user, assistant, tool; "
                                          r"got 'wizard'"),
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": 3}], r"messages\[0\]\.content must be a string or a list of text parts, got 3"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\] must be "),
])
def test_bad_messages_name_the_field(messages, error):
    with pytest.raises(ChatTemplateError, match=error):
        ChatTemplate(CHATML).render(messages)


def test_content_parts_and_tool_calls():
    template = ChatTemplate("{% for m in messages %}{{ m.role }}={{ m.content }}"
                            "{% for c in m.tool_calls or [] %}{{ c.function.arguments.q }}{% endfor %};{% endfor %}"
                            "{{ tools | length }}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             ROUND_TRIP[1]]
    assert template.knows_tools
    # arguments reach a tool-use template as an object (transformers' convention)
    assert template.render(parts, add_generation_prompt=False, tools=TOOLS) == "user=a\nb;assistant=Paris;1"


def test_tool_turns_render_as_transformers_renders_them(tmp_path):
    directory = model_dir(tmp_path, HERMES_TOOLS)
    tokenizer = Tokenizer(directory)
    as_transformers_wants = [*ROUND_TRIP[:1], {**ROUND_TRIP[1], "tool_calls": [
        {**ROUND_TRIP[1]["tool_calls"][0], "function": {"name": "lookup", "arguments": {"q": "Paris"}}}]},
        ROUND_TRIP[2]]
    text = tokenizer.chat_template.render(ROUND_TRIP, tools=TOOLS)
    assert text == transformers_render(directory, as_transformers_wants, TOOLS)
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text


def test_a_template_without_tools_gets_them_through_the_tool_prompt():
    template = ChatTemplate(CHATML)
    assert not template.knows_tools
    turns = [{"role": "system", "content": "Be brief."}, *ROUND_TRIP,
             {"role": "tool", "tool_call_id": "call_2", "content": "no rain"}]
    signature = json.dumps(TOOLS[0], ensure_ascii=False)
    assert template.render(turns, tools=TOOLS) == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{signature}\n</tools>\n\nFor each function call, write the function's name and its arguments as a JSON "
        'object, exactly like this:\n<tool_call>\n{"name": "<function-name>", "arguments": <arguments-json-object>}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "lookup", "arguments": {"q": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\nno rain\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # no system message: the tool prompt is one (in place of the template's default)
    first = template.render(ROUND_TRIP[:1], tools=TOOLS, tool_format="llama3_json")
    assert first.startswith("<|im_start|>system\n# Tools\n") and "You are a helpful assistant" not in first
    assert '{"name": "<function-name>", "parameters": <arguments-json-object>}<|im_end|>' in first
    # tool turns without tools (tool_choice none) still render, without the tool prompt
    assert "# Tools" not in template.render(ROUND_TRIP) and "<tool_response>" in template.render(ROUND_TRIP)


@pytest.mark.parametrize("calls,error", [
    ("x", r"messages\[1\]\.tool_calls must be a list of calls"),
    ([{"id": "1"}], r"messages\[1\]\.tool_calls\[0\] must be \{\"id\", \"type\": \"function\""),
    ([{"type": "custom", "function": {"name": "f"}}], r"messages\[1\]\.tool_calls\[0\]\.type must be function"),
    ([{"function": {"name": ""}}], r"messages\[1\]\.tool_calls\[0\]\.function\.name must be a non-empty string"),
    ([{"function": {"name": "f", "arguments": 3}}], r"tool_calls\[0\]\.function\.arguments must be JSON text"),
])
def test_bad_tool_calls_name_the_field(calls, error):
    with pytest.raises(ChatTemplateError, match=error):
        ChatTemplate(CHATML).render([ROUND_TRIP[0], {"role": "assistant", "content": None, "tool_calls": calls}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.tool_calls: only an assistant's message"):
        ChatTemplate(CHATML).render([{"role": "user", "content": "x", "tool_calls": []}])


def test_the_sandbox_refuses_unsafe_templates():
    with pytest.raises(ChatTemplateError, match="rendering the chat template failed"):
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="rendering the chat template failed"):
        ChatTemplate("{% set _ = messages.append(1) %}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="the chat template does not compile"):
        ChatTemplate("{% for %}")


def test_gguf_template_is_read_from_metadata(checkpoint, tmp_path):
    from gguf_files import write_gguf

    path = write_gguf(checkpoint("llama"), tmp_path / "chat.gguf", chat_template=CHATML.replace("<|im_end|>", "</s>"))
    tokenizer = Tokenizer(path)
    assert tokenizer.eos_token == "</s>" and tokenizer.bos_token == "<s>"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("hi</s>\n<|im_start|>assistant\n")
    assert ids.count(tokenizer.token_to_id("</s>")) == 2  # matched whole, as a special token
