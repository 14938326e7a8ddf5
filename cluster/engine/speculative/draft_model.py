"""The draft model of ``method: draft``, checked against the target before anything is loaded:
its guesses are token ids the target checks, so both must split text into the same ids (the same
vocabulary), the draft must have no id the target lacks, and it must reach the model's context."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.models.config import ModelConfig, ModelConfigError
from cluster.engine.models.read_config import load_model_config
from cluster.engine.models.source import ModelSource, ModelSourceError, resolve_model_source
from cluster.engine.quantization.choice import resolve_quantization
from cluster.engine.request_limits import clip
from cluster.engine.speculative.config import SpeculativeConfigError
from cluster.engine.tokenizer import Tokenizer, TokenizerError

FIELD = "speculative.draft_model"


@dataclass(frozen=True)
class DraftCheckpoint:
    source: ModelSource
    config: ModelConfig


def read_draft(path: str, dtype: str | None = None) -> DraftCheckpoint:
    """The draft's checkpoint and configuration; raises naming ``speculative.draft_model``."""
    try:
        source = resolve_model_source(path)
        return DraftCheckpoint(source, load_model_config(source, dtype))
    except (ModelSourceError, ModelConfigError, ValueError, OSError) as exc:
        raise SpeculativeConfigError(f"{FIELD}: {clip(str(exc))}") from None


def _tokenizer(source: ModelSource) -> Tokenizer | None:
    try:
        return Tokenizer(source)
    except TokenizerError:
        return None


def check_draft(draft: DraftCheckpoint, target: ModelConfig, target_tokenizer: Tokenizer | None,
                max_model_len: int) -> None:
    """Raises naming ``speculative.draft_model`` when the draft cannot guess for this target."""
    if draft.config.vocab_size > target.vocab_size:
        raise SpeculativeConfigError(
            f"{FIELD}: the draft's vocabulary ({draft.config.vocab_size} ids) is larger than the model's "
            f"({target.vocab_size}); give a draft with the model's tokenizer")
    draft_tokenizer = _tokenizer(draft.source)
    if (draft_tokenizer is None) != (target_tokenizer is None):
        which = "the draft" if draft_tokenizer is None else "the model"
        raise SpeculativeConfigError(f"{FIELD}: {which} has no tokenizer, so the two cannot be checked to split text "
                                     "alike; give a draft with the model's tokenizer")
    if draft_tokenizer is not None and draft_tokenizer.vocabulary() != target_tokenizer.vocabulary():
        raise SpeculativeConfigError(f"{FIELD}: the draft's tokenizer differs from the model's (another vocabulary); "
                                     "give a draft with the model's tokenizer")
    if draft.config.max_position_embeddings < max_model_len:
        raise SpeculativeConfigError(
            f"{FIELD}: the draft's context ({draft.config.max_position_embeddings} tokens) is shorter than "
            f"max_model_len ({max_model_len}); lower max_model_len or give a draft with a longer context")


def check_draft_path(path: str, target: ModelSource, target_config: ModelConfig, dtype: str | None,
                     max_model_len: int) -> None:
    """The whole check from paths (``tandem validate``): reads the draft and both tokenizers."""
    check_draft(read_draft(path, dtype), target_config, _tokenizer(target), max_model_len)


FLOAT_DRAFT_QUANTIZATION = "int8"  # the closest to the draft's own floats of the forms quantized at load


def draft_quantization(draft: DraftCheckpoint, target_quantization: str, device: str, attention_backend: str) -> str:
    """The draft's ``ModelConfig.quantization``: a quantized draft as shipped where the kernels
    run; a float draft quantized at load (int8) where the target runs quantized weights, so that
    the draft runs the target's fast path (on the CPU the fused step, which a float model does not
    take: a float SmolLM2-135M draft ran the torch path at 0.34-0.67x of plain decoding), and in
    floats where the target runs floats (a draft that is the target then guesses its very tokens).
    Raises QuantizationChoiceError as :func:`resolve_quantization` does."""
    shipped = "gguf" if draft.source.is_gguf else draft.config.quant_method
    if shipped is None and target_quantization != "none":
        return resolve_quantization(FLOAT_DRAFT_QUANTIZATION, None, device, attention_backend)
    return resolve_quantization("auto", shipped, device, attention_backend)
