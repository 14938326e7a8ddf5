"""GGUF checkpoints against ``transformers`` loading the same file
(``from_pretrained(dir, gguf_file=...)``): greedy tokens for Llama, Qwen2 (and Qwen3) in every weight type
we promise (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), the configuration read from the
metadata, the tokenizer on a varied text sample, and the errors a bad path gets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from cluster.offline.llm import LLM
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.models.config import ModelConfigError
from cluster.engine.models.read_config import load_model_config
from cluster.engine.models.source import ModelSourceError, resolve_model_source
from cluster.engine.tokenizer import Tokenizer
from gguf_files import write_gguf
from reference_checks import assert_batch_matches_reference, run_batch

pytestmark = pytest.mark.integration

SIZES = {
    None: {},
    "wide": dict(hidden_size=256, intermediate_size=512),  # K-quant blocks hold 256 values: rows that long
    # transformers reads no head size from a Qwen3 GGUF and takes its default, 128.
    "head128": dict(head_dim=128),
}

TEXT_SAMPLE = [
    "The quick brown fox jumps over the lazy dog.",
    " leading space, and trailing one ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Numbers: 1234567, 3.14159 and the year 2024!",
    "Émile écrit «bonjour» — naïve café déjà vu.",
    "東京 and 大阪 are cities; 한국어; русский текст",
    "emoji 🙂🚀👍🏽 done",
    "tabs\t\tand   runs of    spaces\n\n\n  end  ",
    "<s>special</s> tokens <pad> inside <unk> text",
    "I'm sure you're right; they'll say WE'VE won",
    "a\r\nb\rc",
    "",
    "    ",
    "$$$%%%^^^&&&***((()))",
    "\u00a0nbsp\u2003em\u200bzero-width",
]


@pytest.fixture(scope="session")
def gguf_model(checkpoint, tmp_path_factory):
    """``gguf_model("llama", Q.Q4_0)`` -> a folder holding one GGUF file written from the tiny
    random checkpoint (built once per session)."""
    built: dict[tuple, Path] = {}

    def make(architecture: str, qtype: Q, size: str | None = None, **options) -> Path:
        key = (architecture, qtype, size, tuple(sorted(options.items())))
        if key not in built:
            source = checkpoint(architecture, **SIZES[size])
            folder = tmp_path_factory.mktemp(f"gguf-{architecture}-{qtype.name}")
            write_gguf(source, folder / f"tiny-{architecture}.{qtype.name}.gguf", qtype, **options)
            built[key] = folder
        return built[key]

    return make


def gguf_file(folder: Path) -> Path:
    (path,) = folder.glob("*.gguf")
    return path


def transformers_model(folder: Path, dtype: torch.dtype = torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=gguf_file(folder).name, dtype=dtype).eval()


def transformers_tokenizer(folder: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file(folder).name)


CASES = [
    ("llama", Q.F32, None), ("llama", Q.F16, None), ("llama", Q.BF16, None), ("llama", Q.Q8_0, None),
    ("llama", Q.Q4_0, None), ("llama", Q.Q4_1, None), ("llama", Q.Q4_K, "wide"), ("llama", Q.Q6_K, "wide"),
    ("qwen2", Q.F16, None), ("qwen2", Q.Q8_0, None), ("qwen2", Q.Q4_1, None), ("qwen2", Q.Q4_K, "wide"),
    ("qwen3", Q.Q8_0, "head128"),
]


@pytest.mark.parametrize("architecture,qtype,size", CASES, ids=[f"{a}-{q.name}" for a, q, _ in CASES])
def test_greedy_tokens_match_transformers(gguf_model, architecture, qtype, size):
    folder = gguf_model(architecture, qtype, size)
    # The file itself for some cases, the folder holding it for the others: the same model.
    path = gguf_file(folder) if qtype in (Q.Q4_0, Q.Q8_0, Q.Q4_K) else folder
    assert_batch_matches_reference(path, transformers_model(folder), f"{architecture} {qtype.name} GGUF")


def test_mixed_types_and_bfloat16_engine(gguf_model):
    """A Q6_K embedding under Q4_K layers (as llama.cpp's Q4_K_M files mix them), run in bfloat16."""
    folder = gguf_model("llama", Q.Q4_K, "wide", embedding_qtype=Q.Q6_K)
    assert_batch_matches_reference(folder, transformers_model(folder, torch.bfloat16), "mixed K-quants bf16",
                                   torch.bfloat16)


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_config_from_metadata_equals_the_checkpoints(checkpoint, gguf_model, architecture):
    ours = load_model_config(gguf_model(architecture, Q.F32))
    hf = load_model_config(checkpoint(architecture))
    if architecture == "qwen3":
        assert ours.head_dim == 32 != ours.hidden_size // ours.num_heads  # from attention.key_length
    for field in ("architecture", "family", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                  "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "sliding_window", "eos_token_ids"):
        assert getattr(ours, field) == getattr(hf, field), field
    assert ours.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert ours.rope.theta == hf.rope.theta and ours.rope.freq_factors is None
    assert ours.dtype == torch.float32 and ours.bos_token_id == 2


PRE_TOKENIZERS = ["gpt2", "llama-bpe", "qwen2", "smollm"]


@pytest.mark.parametrize("pre", PRE_TOKENIZERS)
@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenization_matches_transformers(gguf_model, pre, add_bos):
    folder = gguf_model("qwen2" if pre == "qwen2" else "llama", Q.Q8_0, pre=pre, add_bos=add_bos)
    ours, reference = Tokenizer(folder), transformers_tokenizer(folder)
    for text in TEXT_SAMPLE:
        ids = ours.encode(text)
        assert ids == reference.encode(text), f"{pre}: {text!r}"
        if add_bos:
            assert ids[:1] == [2], f"{pre}: no BOS first in {ids}"
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_text_prompts_run_through_the_gguf_tokenizer(gguf_model):
    folder = gguf_model("llama", Q.Q8_0)
    tokenizer = Tokenizer(folder)
    with LLM(str(folder), verbose=False, num_kv_blocks=64) as llm:
        by_text, by_ids = llm.generate([TEXT_SAMPLE[0], tokenizer.encode(TEXT_SAMPLE[0])],
                                       SamplingParams(temperature=0, max_tokens=8))
    assert by_text.prompt_token_ids == tokenizer.encode(TEXT_SAMPLE[0])
    assert by_text.token_ids == by_ids.token_ids
    assert tokenizer.decode(by_text.token_ids).startswith(by_text.text)  # an unfinished UTF-8 tail waits


def test_paths_that_are_not_one_model(gguf_model, tmp_path):
    folder = gguf_model("llama", Q.F32)
    assert resolve_model_source(folder).gguf_file == gguf_file(folder)
    assert resolve_model_source(gguf_file(folder)).gguf_file == gguf_file(folder)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(gguf_file(folder).read_bytes())
    with pytest.raises(ModelSourceError, match=r"several \.gguf files \(a\.gguf, b\.gguf\); give the path of one"):
        resolve_model_source(two)
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf")
    with pytest.raises(ModelSourceError, match="is not a GGUF file"):
        load_model_config(fake)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match="no config.json and no .gguf file"):
        load_model_config(empty)


def test_unsupported_architecture_is_named(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelConfigError, match="GGUF architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        load_model_config(path)


def test_gguf_and_safetensors_of_one_model_agree(checkpoint, gguf_model):
    """The F32 GGUF holds exactly the safetensors weights (Q/K reordered and back)."""
    assert run_batch(gguf_model("llama", Q.F32)).tokens == run_batch(checkpoint("llama")).tokens
