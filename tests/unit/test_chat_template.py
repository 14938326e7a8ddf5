"""Chat templates: rendered text and token ids equal ``transformers``' ``apply_chat_template``
for templates in the styles models ship (ChatML with a default system prompt, Llama 3 with
BOS, tools and loop controls, one that refuses with ``raise_exception``); where the template is
found; bad messages named by field; and the sandbox."""

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
    template = ChatTemplate("{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    assert template.render(parts, add_generation_prompt=False) == "user=a\nb;assistant=;"


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
