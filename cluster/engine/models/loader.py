"""Loads safetensors weights (one file or a sharded index) into a model, tensor by tensor.

Each checkpoint tensor goes to its parameter's ``weight_loader`` as a safetensors slice, so a
tensor-parallel rank reads only the rows or columns it keeps. The ``dummy`` load format reads
no file: weights are small seeded random values, for measuring speed on a model's shape
(a directory with only ``config.json`` is enough).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from cluster.engine.models.config import ModelConfig
from cluster.engine.models.decoder import PACKED_MODULES, CausalLM
from cluster.engine.models.layers import SINGLE_RANK, ParallelGroup, default_weight_loader

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
    model_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    tied = model.config.tie_word_embeddings
    files = checkpoint_files(model_dir)
    for file_index, path in enumerate(files):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, shard_id = _target(name)
                param = params.get(target)
                if param is None:
                    raise WeightLoadError(f"{path.name}: tensor {name!r} does not belong to a {model.config.architecture}")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, f.get_slice(name), shard_id)
                loaded.add(target if shard_id is None else f"{target}:{shard_id}")
        if progress is not None:
            progress(file_index + 1, len(files))
    _check_complete(model, loaded, model_dir)


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


def _check_complete(model: CausalLM, loaded: set[str], model_dir: Path) -> None:
    missing = sorted(_expected_keys(model) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise WeightLoadError(f"{model_dir}: checkpoint is missing tensors: {shown}")


def build_model(
    config: ModelConfig,
    model_dir: Path,
    max_positions: int | None = None,
    group: ParallelGroup = SINGLE_RANK,
    device: torch.device | str = "cpu",
    progress: Callable[[int, int], None] | None = None,
    load_format: str = "safetensors",
) -> CausalLM:
    if load_format not in LOAD_FORMATS:
        raise WeightLoadError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    with torch.device(device):
        model = CausalLM(config, max_positions, group)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        load_weights(model, Path(model_dir), progress)
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


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
