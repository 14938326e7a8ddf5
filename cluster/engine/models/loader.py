"""Loads weights into a model, tensor by tensor: safetensors (one file or a sharded index, float
or quantized) or a GGUF file (dequantized as it is read).

Each checkpoint tensor goes to its parameter's ``weight_loader`` as a slice (a safetensors slice,
a :class:`~cluster.engine.models.hf_checkpoint.QuantizedWeightSlice` joining a quantized weight's
tensors, or a :class:`~cluster.engine.models.gguf_checkpoint.GGUFTensorSlice`), so a
tensor-parallel rank reads (and dequantizes, or repacks) only the rows or columns it keeps. The
``dummy`` load format reads no weights: they are small seeded random values, for measuring speed
on a model's shape (a directory with only ``config.json``, or a GGUF file, is enough).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from cluster.engine.models.config import ModelConfig
from cluster.engine.models.decoder import PACKED_MODULES, CausalLM
from cluster.engine.models.hf_checkpoint import HFCheckpoint, QuantizedTensorError
from cluster.engine.models.layers import SINGLE_RANK, ParallelGroup, default_weight_loader
from cluster.engine.models.source import ModelSource, resolve_model_source

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
LOAD_FORMATS = ("safetensors", "dummy")


class WeightLoadError(ValueError):
    """The checkpoint lacks a tensor the model needs, or holds one it does not know."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{model_dir}: no *.safetensors files")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightLoadError(f"{model_dir}: files named in the index are missing: {', '.join(missing)}")
    return files


def _target(name: str) -> tuple[str, object]:
    """Checkpoint name -> (parameter name in our module tree, shard id)."""
    for source, (fused, shard_id) in PACKED_MODULES.items():
        marker = f".{source}."
        if marker in name:
            return name.replace(marker, f".{fused}."), shard_id
    return name, None


def load_weights(
    model: CausalLM,
    model_path: str | Path | ModelSource,
    progress: Callable[[int, int, str], None] | None = None,
) -> None:
    """Fills every parameter from the checkpoint; ``progress(done, total, unit)`` reports files
    (safetensors) or tensors (GGUF) as they are read."""
    source = resolve_model_source(model_path)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    tied = model.config.tie_word_embeddings

    def visit(name: str, tensor, where: str) -> None:
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            return
        target, shard_id = _target(name)
        param = params.get(target)
        if param is None and _zero_bias(name, tensor):  # GPTQ exports may give every linear layer one
            return
        if param is None:
            raise WeightLoadError(f"{where}: tensor {name!r} does not belong to a {model.config.architecture}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor, shard_id)
        loaded.add(target if shard_id is None else f"{target}:{shard_id}")

    if source.is_gguf:
        from cluster.engine.models.gguf_checkpoint import load_gguf_tensors

        where = source.gguf_file.name
        report = (lambda done, total: progress(done, total, "tensors")) if progress else None
        load_gguf_tensors(source.gguf_file, model.config.dtype, lambda n, t: visit(n, t, where), report)
    else:
        files = checkpoint_files(source.path)
        with HFCheckpoint(files, model.config.checkpoint_quantization) as checkpoint:
            for file_index, path in enumerate(files):
                try:
                    for name, tensor in checkpoint.tensors(path):
                        visit(name, tensor, path.name)
                except QuantizedTensorError as exc:
                    raise WeightLoadError(f"{path.name}: {exc}") from None
                if progress is not None:
                    progress(file_index + 1, len(files), "files")
    _check_complete(model, loaded, source.path)


def _zero_bias(name: str, tensor) -> bool:
    return name.endswith(".bias") and not bool(tensor[:].any())


def _expected_keys(model: CausalLM) -> set[str]:
    """Every parameter, or every part of a fused one, that a complete checkpoint fills."""
    expected: set[str] = set()
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        shards = [shard for fused, shard in PACKED_MODULES.values() if f".{fused}." in name]
        if shards:
            expected.update(f"{name}:{shard}" for shard in shards)
        else:
            expected.add(name)
    return expected


def _check_complete(model: CausalLM, loaded: set[str], model_path: Path) -> None:
    missing = sorted(_expected_keys(model) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightLoadError(f"{model_path}: checkpoint is missing tensors: {shown}")


def build_model(
    config: ModelConfig,
    model_path: str | Path | ModelSource,
    max_positions: int | None = None,
    group: ParallelGroup = SINGLE_RANK,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int, str], None] | None = None,
    load_format: str = "safetensors",
) -> CausalLM:
    if load_format not in LOAD_FORMATS:
        raise WeightLoadError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    with torch.device(device):
        model = CausalLM(config, max_positions, group)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_weights(model, model_path, progress)
    model.finish_loading()
    model.eval()
    return model


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, scale: float = 1e-3) -> None:
    """Uniform values in [-scale, scale] for every parameter, drawn on its device (fast even for
    billions of parameters), the same for a seed; norm weights stay 1 so activations keep their size."""
    generator = None
    for name, param in model.named_parameters():
        if generator is None or generator.device != param.device:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.uniform_(-scale, scale, generator=generator)


def parameter_bytes(model: CausalLM) -> int:
    """Bytes of the weights as held: float parameters and packed quantized ones."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) + model.packed_bytes()
