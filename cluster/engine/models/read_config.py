"""A model's configuration from wherever it ships: a Hugging Face directory or a GGUF file."""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.engine.models.config import ModelConfig, hf_model_config
from cluster.engine.models.gguf_checkpoint import open_gguf
from cluster.engine.models.source import ModelSource, resolve_model_source


def load_model_config(model: str | Path | ModelSource, dtype: str | torch.dtype | None = None) -> ModelConfig:
    """The configuration of the model at ``model``: a Hugging Face directory's ``config.json``
    (and ``generation_config.json`` for EOS ids), or a GGUF file's metadata."""
    source = resolve_model_source(model)
    if source.is_gguf:
        return open_gguf(source.gguf_file).model_config(dtype)
    return hf_model_config(source.path, dtype)
