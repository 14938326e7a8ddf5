"""Model quality with quantized weights, teacher-forced over a fixed text of 2,048 tokens.

The text is English prose the standard library ships (heapq's essay on heaps, argparse's and
subprocess's module documentation, the Zen of Python), so it is the same wherever the suite runs.
Our side runs the text through the fused CPU decode step in steps of ``CHUNK`` positions, each
position a row that attends to the cache up to itself, as a decode row does (the rows of a step
share each weight read; one position a step gave the same figures 30x slower), so the fused
step and the quantized kernels produce every logit; the reference is ``transformers`` loading the same GGUF file
(dequantized, float32). Goals: top-1 agreement >= 99% of positions, perplexity within 0.5%.
A float checkpoint quantized at load (``quantization: int8 | int4 | fp8``) is measured against the
same checkpoint served in floats (one prompt chunk of the whole text, the torch path): perplexity
within 1% (int8, fp8) and 5% (int4), the issue's bounds.
"""

from __future__ import annotations

import argparse
import codecs
import heapq
import json
import math
import subprocess
import this
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from cluster.engine.kernels.quantized_matmul import BF16_LAYOUTS, bf16_dots_supported
from cluster.engine.model_runner import PrefillPlan, StepPlan
from cluster.offline.llm import LLM
from test_gguf import gguf_file, gguf_model, transformers_model  # noqa: F401  (gguf_model is a fixture)

pytestmark = pytest.mark.integration

TEXT = "\n\n".join([heapq.__about__, argparse.__doc__, subprocess.__doc__, codecs.decode(this.s, "rot13")])
needs_bf16_dots = pytest.mark.skipif(not bf16_dots_supported(), reason="no bfloat16 dot products here (AVX512_BF16)")
TOKENS = 2048
RANDOM_TOKENS = 512  # the tiny random checkpoints' max_position_embeddings
CHUNK = 32  # positions a step


def teacher_forced_logits(llm: LLM, token_ids: list[int], fused: bool = True) -> torch.Tensor:
    """[len - 1, vocab]: the logits after each prefix, ``CHUNK`` positions a step (blocks 0.. of an
    otherwise idle engine), through the fused decode step unless ``fused`` is off."""
    runner = llm.engine.runner
    assert (runner.native_step is not None) == fused
    bs, n = runner.block_size, len(token_ids) - 1
    chunks = []
    for start in range(0, n, CHUNK):
        end = min(start + CHUNK, n)
        blocks = tuple(range(-(-end // bs)))
        plan = StepPlan(token_ids[start:end], list(range(start, end)), list(range(start, end)), [], [],
                        [PrefillPlan(0, end - start, end, blocks)], list(range(end - start)))
        inputs = runner.build_inputs(plan)
        assert not fused or runner._native_rows(inputs) is not None
        chunks.append(runner.execute(inputs).float())
    return torch.cat(chunks)


def prefill_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: the same logits from one prompt chunk of the whole text (the torch path)."""
    runner = llm.engine.runner
    n, bs = len(token_ids) - 1, runner.block_size
    blocks = tuple(range(-(-n // bs)))
    plan = StepPlan(token_ids[:-1], list(range(n)), list(range(n)), [], [], [PrefillPlan(0, n, n, blocks)],
                    list(range(n)))
    return runner.execute(runner.build_inputs(plan)).float()


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, :-1].float()


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    targets = torch.tensor(token_ids[1:])
    nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).mean()
    return math.exp(nll.item())


def compare(ours: torch.Tensor, reference: torch.Tensor, token_ids: list[int]) -> tuple[float, float]:
    """(top-1 agreement, relative perplexity difference)."""
    agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    ppl, ref_ppl = perplexity(ours, token_ids), perplexity(reference, token_ids)
    return agreement, abs(ppl - ref_ppl) / ref_ppl


def engine(path: Path, max_model_len: int = TOKENS + 64, **options) -> LLM:
    return LLM(str(path), verbose=False, num_kv_blocks=max_model_len // 16 + 8, max_model_len=max_model_len, **options)


@pytest.fixture(scope="module")
def default_model_in_transformers():
    """``transformers`` loading the default model's GGUF (dequantized, float32), loaded once for
    the module: its load (17 s on 2 cores) and a forward over the text (6 s) took most of each
    test here."""
    import transformers

    from cluster.default_model import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def default_model_reference(default_model_in_transformers):
    """``reference(token_ids)``: the reference logits of the default model over the text's tokens,
    computed once per distinct token ids."""
    computed: dict[tuple[int, ...], torch.Tensor] = {}

    def reference(token_ids: list[int]) -> torch.Tensor:
        if tuple(token_ids) not in computed:
            computed[tuple(token_ids)] = reference_logits(default_model_in_transformers, token_ids)
        return computed[tuple(token_ids)]

    return reference


@pytest.mark.registry
@pytest.mark.parametrize("cpu_matmul_dtype", ["float32", "auto", pytest.param("bfloat16", marks=needs_bf16_dots)])
def test_default_model_against_transformers_on_the_same_gguf(cpu_matmul_dtype, default_model_reference):
    """Every setting within the issue's bounds: with bfloat16 dot products 99.07% top-1 agreement
    and a 0.02% perplexity gap for auto's (4-bit weights, where the CPU has them), 99.27% and 0.03%
    for bfloat16's (every weight), when measured (2026-11-28), against 100% and 0.00% in float32."""
    from cluster.default_model import default_model_path

    path = default_model_path()
    with engine(path, cpu_matmul_dtype=cpu_matmul_dtype) as llm:
        token_ids = llm.engine.tokenize(TEXT)[:TOKENS]
        assert len(token_ids) == TOKENS
        resolved = llm.engine.model_config.cpu_matmul_dtype
        assert resolved == (cpu_matmul_dtype if bf16_dots_supported() else "float32")
        assert llm.engine.runner.native_step.bf16_layouts == BF16_LAYOUTS[resolved]
        assert llm.engine.runner.model.lm_head.bf16_layouts == BF16_LAYOUTS[resolved]
        ours = teacher_forced_logits(llm, token_ids)
    agreement, ppl_gap = compare(ours, default_model_reference(token_ids), token_ids)
    print(f"{cpu_matmul_dtype}: top-1 agreement {agreement:.4f}, perplexity gap {ppl_gap:.5f}")
    assert agreement >= 0.99 and ppl_gap <= 0.005, (agreement, ppl_gap)


@pytest.mark.parametrize("qtype, cpu_matmul_dtype, least_agreement, most_ppl_gap", [
    (Q.Q8_0, "float32", 0.99, 0.005),
    (Q.Q4_K, "float32", 0.99, 0.005),
    (Q.Q8_0, "auto", 0.99, 0.005),
    (Q.Q4_K, "auto", 0.99, 0.005),
    pytest.param(Q.Q4_K, "bfloat16", 0.99, 0.005, marks=needs_bf16_dots),
    # bfloat16 rounds a Q8_0 weight's 8 bits: 96.5% agreement and a 0.47% gap when measured
    # (2026-11-27), why float32 stays the default; held to what a wrong widening would miss by far.
    pytest.param(Q.Q8_0, "bfloat16", 0.95, 0.01, marks=needs_bf16_dots),
], ids=["Q8_0", "Q4_K", "Q8_0-auto", "Q4_K-auto", "Q4_K-bfloat16", "Q8_0-bfloat16"])
def test_random_gguf_checkpoints_against_transformers(gguf_model, qtype, cpu_matmul_dtype, least_agreement,  # noqa: F811
                                                      most_ppl_gap):
    folder = gguf_model("llama", qtype, "wide")
    with engine(gguf_file(folder), max_model_len=RANDOM_TOKENS, cpu_matmul_dtype=cpu_matmul_dtype) as llm:
        token_ids = llm.engine.tokenize(TEXT)[:RANDOM_TOKENS]
        assert llm.engine.model_config.quantization == "gguf"
        ours = teacher_forced_logits(llm, token_ids)
    agreement, ppl_gap = compare(ours, reference_logits(transformers_model(folder), token_ids), token_ids)
    print(f"{qtype.name} {cpu_matmul_dtype}: top-1 agreement {agreement:.4f}, perplexity gap {ppl_gap:.5f}")
    assert agreement >= least_agreement and ppl_gap <= most_ppl_gap, (agreement, ppl_gap)


@pytest.fixture(scope="module")
def float_default_model(tmp_path_factory, default_model_in_transformers) -> Path:
    """The default model's weights as a bfloat16 Hugging Face checkpoint (real trained weights,
    which a random model would not test): the float32 dequantization rounded to bfloat16, as
    loading the GGUF with ``dtype=torch.bfloat16`` does."""
    import transformers

    from cluster.default_model import default_model_path

    path = default_model_path()
    folder = tmp_path_factory.mktemp("smollm2-bf16")
    model = default_model_in_transformers
    # transformers will not save a model it read from a GGUF: write the tensors and config ourselves.
    weights = {name: t.to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
               if not (name == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(weights, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.update(torch_dtype="bfloat16", dtype="bfloat16", architectures=[type(model).__name__])
    (folder / "config.json").write_text(json.dumps(config))
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
    return folder


@pytest.mark.registry
def test_quantized_at_load_against_the_float_weights(float_default_model):
    with engine(float_default_model, dtype="float32", quantization="none") as llm:
        token_ids = llm.engine.tokenize(TEXT)[:TOKENS]
        float_bytes = llm.engine.runner.weight_bytes
        reference = prefill_logits(llm, token_ids)
    for kind, bound in (("int8", 0.01), ("int4", 0.05), ("fp8", 0.01)):
        with engine(float_default_model, dtype="float32", quantization=kind) as llm:
            assert llm.engine.model_config.quantization == kind
            assert llm.engine.runner.weight_bytes < float_bytes * (0.4 if kind == "int4" else 0.5)
            ours = teacher_forced_logits(llm, token_ids)
        _, ppl_gap = compare(ours, reference, token_ids)
        assert ppl_gap <= bound, (kind, ppl_gap)


@pytest.mark.registry
def test_8bit_kv_cache_against_the_float_cache():
    """The default model's perplexity with keys and values held in 8 bits (codes and a scale per
    token and head, read directly by the attention kernels), within 1% of the float32 cache's."""
    from cluster.default_model import default_model_path

    path = default_model_path()
    with engine(path) as llm:
        token_ids = llm.engine.tokenize(TEXT)[:TOKENS]
        reference = teacher_forced_logits(llm, token_ids)
        float_block = llm.engine.runner.block_bytes
    for kind in ("int8", "fp8_e4m3"):
        with engine(path, kv_cache_dtype=kind) as llm:
            assert llm.engine.runner.kv_cache.dtype == torch.int8
            assert llm.engine.runner.block_bytes * 64 == float_block * 17  # (64 + 4) bytes a row against 4 x 64
            ours = teacher_forced_logits(llm, token_ids)
        agreement, ppl_gap = compare(ours, reference, token_ids)
        assert ppl_gap <= 0.01, (kind, agreement, ppl_gap)
