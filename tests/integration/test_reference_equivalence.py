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

from cluster.engine.llm import LLM
from cluster.engine.models.config import ModelConfigError
from cluster.engine.models.loader import WeightLoadError
from cluster.engine.sampling_params import SamplingParams
from conftest import ARCHITECTURES, random_prompts, to_transformers4_config

pytestmark = pytest.mark.integration

PROMPT_LENGTHS = [1, 7, 16, 33, 70, 129]
MAX_TOKENS = 24
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def reference_greedy(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            output_scores=True, return_dict_in_generate=True, pad_token_id=0,
        )
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.scores)[:, 0].float()


def assert_equivalent(ours: list[int], reference: list[int], scores: torch.Tensor, dtype: torch.dtype, label: str):
    for position, (a, b) in enumerate(zip(ours, reference)):
        if a == b:
            continue
        top2 = scores[position].topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap <= TOLERANCE[dtype] * max(1.0, top2[0].abs().item()), (
            f"{label}: token {position} is {a}, reference {b}; reference top-2 logit gap {gap:.3g} is not a tie"
        )
        return
    assert len(ours) == len(reference), label


def run_batch(model_dir, dtype="float32", **engine_args):
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    llm = LLM(str(model_dir), dtype=dtype, verbose=False, num_kv_blocks=128, max_num_batched_tokens=96, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert llm.engine.block_manager.num_free_blocks == 128
    return prompts, [o.token_ids for o in outputs]


def assert_batch_matches_reference(model_dir, reference, label: str, dtype: torch.dtype = torch.float32):
    prompts, ours = run_batch(model_dir, dtype=str(dtype).removeprefix("torch."))
    for prompt, tokens in zip(prompts, ours):
        expected, scores = reference_greedy(reference, prompt, MAX_TOKENS)
        assert_equivalent(tokens, expected, scores, dtype, f"{label}, prompt of {len(prompt)}")


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
    assert run_batch(legacy)[1] == run_batch(source)[1]


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
