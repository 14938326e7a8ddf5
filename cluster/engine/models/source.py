"""Where a model comes from: a Hugging Face directory or a GGUF file.

Everything that reads a model (its config, its weights, its tokenizer and chat template) starts
from :func:`resolve_model_source`, so a path means the same thing everywhere: a directory with a
``config.json`` is a Hugging Face checkpoint; a ``.gguf`` file, or a directory holding exactly one
``.gguf`` file (and no ``config.json``), is a GGUF checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GGUF_MAGIC = b"GGUF"


class ModelSourceError(ValueError):
    """The path names no model Tandem can read."""


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the directory, or the .gguf file
    gguf_file: Path | None = None  # set for a GGUF checkpoint

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def directory(self) -> Path:
        """The folder that holds the checkpoint (and may hold tokenizer files beside it)."""
        return self.path if self.path.is_dir() else self.path.parent

    @property
    def name(self) -> str:
        """A short name: the GGUF file's or the directory's (after following links)."""
        return (self.gguf_file or self.path).resolve().name


def _is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model_source(path: str | Path | ModelSource) -> ModelSource:
    """The checkpoint at ``path``; raises :class:`ModelSourceError` naming what is wrong."""
    if isinstance(path, ModelSource):
        return path
    given = Path(path).expanduser()
    if given.is_file():
        if not _is_gguf_file(given):
            raise ModelSourceError(f"{given} is not a GGUF file; give a .gguf file or a model directory")
        return ModelSource(given, given)
    if not given.is_dir():
        raise ModelSourceError(f"{given} does not exist; give a model directory or a .gguf file")
    if (given / "config.json").is_file():
        return ModelSource(given)
    found = sorted(p for p in given.glob("*.gguf") if p.is_file())
    if len(found) == 1:
        if not _is_gguf_file(found[0]):
            raise ModelSourceError(f"{found[0]} is not a GGUF file (its first bytes are not 'GGUF')")
        return ModelSource(given, found[0])
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:5]) + (", ..." if len(found) > 5 else "")
        raise ModelSourceError(f"{given} holds several .gguf files ({names}); give the path of one")
    raise ModelSourceError(f"{given} is not a model directory: it has no config.json and no .gguf file")
