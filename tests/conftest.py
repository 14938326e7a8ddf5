"""Shared fixtures: small random-weight checkpoints built by ``transformers`` (the reference
our outputs are compared against), each with a real BPE tokenizer trained on the spot."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# As Tandem's own processes do before they import Ray (cluster/runtime/ray_runtime.py): Ray reads
# it once, at import, and otherwise turns a 127.0.0.1 address into this machine's outward one,
# which the test clusters (bound to loopback) do not listen on.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

VOCAB_SIZE = 512
SMALL = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=3,
    pad_token_id=0,
)

TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. A function returns a value. "
    "Classes define objects; modules hold functions and classes. Tandem serves models. "
    "Émile écrit «bonjour» — naïve café déjà vu. 東京 and 大阪 are cities. 🙂 done.\n"
) * 20


def _architecture(name: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "llama3": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
             "rope_theta": 500000.0},
        ),
        "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 48}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    }[name]


ARCHITECTURES = ["llama", "llama3", "llama_tied", "mistral", "qwen2", "qwen3"]


def train_tokenizer(directory: Path, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TOKENIZER_TEXT], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))


def build_checkpoint(directory: Path, architecture: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                     **overrides) -> Path:
    config_cls, model_cls, extra = _architecture(architecture)
    torch.manual_seed(seed)
    config = config_cls(**{**SMALL, **extra, **overrides})
    model = model_cls(config).eval().to(dtype)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    train_tokenizer(directory, config.vocab_size)
    return directory


def to_transformers4_config(directory: Path) -> None:
    """Rewrites config.json into the transformers 4 form (rope_theta/rope_scaling, torch_dtype)."""
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    rope = raw.pop("rope_parameters", None) or {}
    raw["rope_theta"] = rope.pop("rope_theta", 10000.0)
    if rope.get("rope_type", "default") != "default":
        raw["rope_scaling"] = rope
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    path.write_text(json.dumps(raw, indent=2))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """``checkpoint("llama")`` -> a saved random-weight model directory (built once per session)."""
    built: dict[tuple, Path] = {}

    def make(architecture: str = "llama", dtype: torch.dtype = torch.float32, **overrides) -> Path:
        key = (architecture, dtype, tuple(sorted(overrides.items())))
        if key not in built:
            directory = tmp_path_factory.mktemp(f"ckpt-{architecture}")
            built[key] = build_checkpoint(directory, architecture, dtype, **overrides)
        return built[key]

    return make


DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)  # a smaller model beside SMALL


@pytest.fixture(scope="session")
def draft_checkpoint(tmp_path_factory) -> Callable[..., Path]:
    """``draft_checkpoint("llama")`` -> a smaller random model (another seed, one layer, half the
    width) with the same tokenizer as ``checkpoint(...)``'s: a draft for speculative decoding."""
    built: dict[tuple, Path] = {}

    def make(architecture: str = "llama", **overrides) -> Path:
        key = (architecture, tuple(sorted(overrides.items())))
        if key not in built:
            directory = tmp_path_factory.mktemp(f"draft-{architecture}")
            extra = {"head_dim": 16} if architecture == "qwen3" else {}
            built[key] = build_checkpoint(directory, architecture, seed=1, **{**DRAFT, **extra, **overrides})
        return built[key]

    return make


@pytest.fixture(scope="session")
def reference_model() -> Callable[[Path, torch.dtype], torch.nn.Module]:
    import transformers

    loaded: dict[tuple, torch.nn.Module] = {}

    def load(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        key = (str(directory), dtype)
        if key not in loaded:
            loaded[key] = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
        return loaded[key]

    return load


def random_prompts(lengths, seed: int = 0, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server on loopback for the session."""
    from cluster.registry.local_redis import LocalRedis

    with LocalRedis() as local:
        yield local


@pytest.fixture
def redis_client(redis_server):
    """A client of the session's Redis, emptied for each test."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()


def wait_for(condition, timeout_s: float = 15.0, what: str = "condition", every_s: float = 0.05):
    """``condition()``'s first truthy value, polled until ``timeout_s``; fails naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")
