"""Greedy output token for token against ``transformers`` on random-weight checkpoints.

Prompts of different lengths run together in one continuous batch. Where a token differs,
the reference's top two logits at that position must be within float rounding of each other
(a tie the two implementations may break either way); the comparison stops there because
the continuations diverge.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cluster.offline.llm import LLM
from cluster.engine.models.config import ModelConfigError
from cluster.engine.models.loader import WeightLoadError
from conftest import ARCHITECTURES, to_transformers4_config
from reference_checks import assert_batch_matches_reference, run_batch

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_matches_transformers(architecture, checkpoint, reference_model):
    model_dir = checkpoint(architecture)
    assert_batch_matches_reference(model_dir, reference_model(model_dir), architecture)


@pytest.mark.parametrize("architecture", ["mistral", "qwen3"])
def test_plain_torch_decode_attention_matches_transformers(architecture, checkpoint, reference_model, monkeypatch):
    """The fallback used where the native kernel cannot run (no compiler, not float32, GPU)."""
    monkeypatch.setenv("TANDEM_NATIVE_KERNELS", "0")
    model_dir = checkpoint(architecture)
    assert_batch_matches_reference(model_dir, reference_model(model_dir), f"{architecture} (plain torch)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_transformers(dtype, checkpoint, reference_model):
    model_dir = checkpoint("qwen2", dtype=dtype)
    assert_batch_matches_reference(model_dir, reference_model(model_dir, dtype), f"qwen2 {dtype}", dtype)


def test_checkpoint_dtype_is_the_default(checkpoint):
    llm = LLM(str(checkpoint("llama", dtype=torch.bfloat16)), verbose=False, num_kv_blocks=16)
    assert llm.engine.model_config.dtype == torch.bfloat16


def test_transformers4_config_and_sharded_weights_load_the_same(checkpoint, reference_model, tmp_path):
    source = checkpoint("llama3")
    reference = reference_model(source)
    legacy = tmp_path / "legacy"
    reference.save_pretrained(legacy, max_shard_size="100KB")
    shutil.copy(source / "tokenizer.json", legacy / "tokenizer.json")
    to_transformers4_config(legacy)
    raw = json.loads((legacy / "config.json").read_text())
    assert "rope_theta" in raw and "rope_scaling" in raw and "torch_dtype" in raw and "rope_parameters" not in raw
    assert (legacy / "model.safetensors.index.json").is_file()
    assert len(list(legacy.glob("*.safetensors"))) > 1
    assert run_batch(legacy).tokens == run_batch(source).tokens


def test_unsupported_architecture_is_a_clear_error(checkpoint, tmp_path):
    broken = tmp_path / "gpt"
    shutil.copytree(checkpoint("llama"), broken)
    raw = json.loads((broken / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel.*not supported"):
        LLM(str(broken), verbose=False, num_kv_blocks=8)


def test_missing_tensor_is_a_clear_error(checkpoint, reference_model, tmp_path):
    from safetensors.torch import save_file

    source = checkpoint("llama")
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(source / "config.json", partial / "config.json")
    state = {k: v.contiguous() for k, v in reference_model(source).state_dict().items()}
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(partial / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.qkv_proj\.weight:k"):
        LLM(str(partial), verbose=False, num_kv_blocks=8)
