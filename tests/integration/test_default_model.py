"""The self-built default model: a tiny, fast build must load in transformers as a Llama.

Builds run through the real command line (``python -m cluster.default_model.train``) for a
few steps on a slice of the corpus, so the whole file takes well under a minute on a CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import cluster.default_model as default_model
from cluster.default_model import corpus, train

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
CORPUS_BYTES = 150_000

EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
    "bos_token_id": None,
    "dtype": "float32",
    "attention_bias": False,
    "mlp_bias": False,
}


def _cli_build(out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "cluster.default_model.train", "--out", str(out)]
    cmd += ["--max-steps", str(STEPS), "--max-corpus-bytes", str(CORPUS_BYTES)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=120)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two builds with identical arguments, for the determinism check."""
    first = tmp_path_factory.mktemp("default-model-a")
    second = tmp_path_factory.mktemp("default-model-b")
    _cli_build(first)
    _cli_build(second)
    return first, second


@pytest.fixture(scope="module")
def model_dir(built: tuple[Path, Path]) -> Path:
    return built[0]


def test_files_and_config(model_dir: Path) -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    for key, value in EXPECTED_CONFIG.items():
        assert config[key] == value, key
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "eos_token_id"):
        assert isinstance(config[key], int) and config[key] >= 0, key
    assert config["hidden_size"] == config["num_attention_heads"] * config["head_dim"]
    assert config["num_attention_heads"] > config["num_key_value_heads"]  # grouped-query

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert config["eos_token_id"] == tok.token_to_id("<|endoftext|>")
    assert config["vocab_size"] == tok.get_vocab_size()
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_weights_have_hf_llama_names(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    names = set(load_file(model_dir / "model.safetensors"))
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        expected |= {prefix + f"self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}
    assert names == expected  # lm_head is tied, so absent


def _ours(model_dir: Path) -> train.TinyLlama:
    config = json.loads((model_dir / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size")
    model = train.TinyLlama(train.ModelConfig(**{k: config[k] for k in keys}))
    model.load_state_dict(load_file(model_dir / "model.safetensors"), strict=True)
    return model.eval()


def _assert_same_logits(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    hf.eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

    vocab = hf.config.vocab_size
    ids = torch.arange(2 * 24).reshape(2, 24) * 97 % vocab
    with torch.no_grad():
        expected = _ours(model_dir)(ids)
        got = hf(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_transformers_loads_it_with_the_same_logits(model_dir: Path) -> None:
    _assert_same_logits(model_dir)


def test_same_logits_with_large_random_weights(model_dir: Path, tmp_path: Path) -> None:
    """A 3-step model is nearly at its small initialisation, where attention barely shows in
    the logits; large random weights make any difference in rotary or GQA layout visible."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: (1 + 0.5 * torch.randn(t.shape, generator=gen)) if t.dim() == 1
        else 0.3 * torch.randn(t.shape, generator=gen)
        for name, t in load_file(model_dir / "model.safetensors").items()
    }
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    _assert_same_logits(tmp_path)


def test_tokenizer_round_trips(model_dir: Path) -> None:
    from tokenizers import Tokenizer

    texts = [
        "The function returns a new list.\n\n    >>> sorted([3, 1, 2])\n    [1, 2, 3]\n",
        "Unicode too: naïve café, ∑ x² and 日本語, tabs\tand  double  spaces.",
        "",
    ]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in texts:
        assert tok.decode(tok.encode(text).ids) == text

    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert hf_tok.eos_token == "<|endoftext|>"
    assert hf_tok.bos_token is None
    for text in texts:
        ids = hf_tok(text)["input_ids"]
        assert ids == tok.encode(text).ids  # nothing (no BOS) is added
        assert hf_tok.decode(ids) == text


def test_build_is_deterministic(built: tuple[Path, Path]) -> None:
    first, second = built
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_corpus_order_is_fixed(tmp_path: Path) -> None:
    topics = corpus.topic_documents()
    assert topics and topics == corpus.topic_documents()

    # A fake standard library: files are visited in sorted path order, test folders skipped.
    doc = "A docstring long enough to be kept, because it says something about {name}. " * 2
    for rel in ("b.py", "a/z.py", "a/b.py", "test/skipped.py", "site-packages/x/skipped.py"):
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""{doc.format(name=rel)}"""\n\ndef f():\n    """Too short."""\n')
    (tmp_path / "broken.py").write_text("def (:\n")
    found = list(corpus.docstring_documents(tmp_path))
    assert [d.split("about ")[1].split(".")[0] for d in found] == ["a/b", "a/z", "b"]

    sliced = corpus.gather_corpus(max_bytes=10_000)
    assert 9_990 <= sum(len(d.encode()) for d in sliced) <= 10_000
    assert sliced == corpus.gather_corpus(max_bytes=10_000)


def test_default_model_dir_builds_once_and_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache path, the child-process build, the atomic rename and the cached path."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        default_model, "_BUILD_ARGS", ("--max-steps", "1", "--max-corpus-bytes", "50000")
    )
    leftover = tmp_path / "models" / f".{default_model.DEFAULT_MODEL_NAME}.dead.tmp"
    leftover.mkdir(parents=True)  # as if an earlier build had been killed

    path = default_model.default_model_dir()
    assert path == tmp_path / "models" / "tandem-default-v1"
    assert (path / "model.safetensors").is_file()
    assert not leftover.exists()
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []

    built_at = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model.default_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == built_at  # not rebuilt


def test_time_budget_does_not_end_before_the_step_floor() -> None:
    """An overloaded machine that spends its time budget early still trains the floor of steps."""
    from cluster.default_model.train import ModelConfig, TinyLlama, TrainConfig, train_model

    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    tc = TrainConfig(seq_len=8, batch_size=2, warmup_steps=1, log_every_s=1e9)
    data = torch.randint(0, 32, (200,), generator=torch.Generator().manual_seed(0))
    assert train_model(TinyLlama(config), data, tc, max_seconds=1e-9, max_steps=None, min_steps=5)["steps"] == 5
    assert train_model(TinyLlama(config), data, tc, max_seconds=1e-9, max_steps=None)["steps"] == 1
