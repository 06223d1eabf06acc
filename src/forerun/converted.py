"""A GGUF file converted once to a transformers folder (safetensors, config, tokenizer), then loaded from it.

transformers reads a GGUF file three times for one `load_model` (config, tokenizer, weights), each time parsing
every metadata field (a 49k-token vocabulary and its merges are ~300k fields) and dequantizing every block: the
embedded 98 MB model takes ~18 s to load that way, ~0.2 s from a folder (docs/benchmarks.md). So the first load of a
file keeps what transformers made of it, the dense weights in the dtype asked for, under
`<cache_dir>/converted/<file>-<dtype>-<digest of its path>/`, and later loads read that. The folder records what it
was made from (the file's size and modification time, transformers' version): a file replaced in place, or another
transformers, converts afresh over it, so there is one folder per file and dtype. The folder's weights are the very
tensors a conversion gives (the same dequantized values, cast once), so the model is the same bit for bit.

A folder is kept only where it reads back as the conversion (config, tokenizer: `reads_back_otherwise`), and
appears whole or not at all (written beside it, then renamed); one that fails to load is removed and
converted again; when the disk lacks room for it (and 1 GiB to spare) the model is converted and used, not kept.
`cache_dir=None` converts every time and writes nothing. With `quantize="int4"` the layers take the file's own
4-bit codes, found through an index of its tensors kept in the folder too (`INDEX_FILE`). Deleting
`~/.cache/forerun/converted` is always safe.

Example (the first call converts and keeps; the second reads the folder):
    >>> model, tokenizer = load_model("smollm2-135m")                                        # doctest: +SKIP
    >>> sorted(p.name for p in (DEFAULT_CACHE_DIR / "converted").expanduser().iterdir())      # doctest: +SKIP
    ['SmolLM2-135M-Instruct.Q4_1-float32-5658d911f324dac6']
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from forerun.measured import settings_digest

logger = logging.getLogger(__name__)

FORMAT = 1
"""The layout of a converted folder; a folder of another layout is converted afresh."""
SOURCE_FILE = "forerun-source.json"
"""What a folder was converted from (`source_of`), written last inside it."""
SPARE_BYTES = 1 << 30
"""Disk left free after a folder is written, or it is not written."""
INDEX_FILE = "forerun-gguf-index.json"
"""Where each tensor lies in the file (`forerun.base.gguf_codes.Places`), kept beside the converted model for
`quantize="int4"`, whose layers take the file's own 4-bit codes: without it every load parses the metadata again."""
STALE_SECONDS = 24 * 3600
"""A half-written folder (its writer killed) older than this is swept away by the next writer."""

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


def folder_for(gguf: Path, dtype: torch.dtype, cache_dir: Path | str) -> Path:
    """Where the conversion of `gguf` to `dtype` is kept: one folder per file (by its resolved path) and dtype.

    Example:
        >>> folder_for(Path("/models/a.Q4_0.gguf"), torch.bfloat16, "/cache")
        PosixPath('/cache/converted/a.Q4_0-bfloat16-91c91a550292f7a4')
    """
    dtype_name = str(dtype).removeprefix("torch.")
    return Path(cache_dir).expanduser() / "converted" / f"{gguf.stem}-{dtype_name}-{path_digest(gguf)}"


def path_digest(gguf: Path) -> str:
    """16 hex digits naming the file by its resolved path (two files of one name in two folders: two digests)."""
    return settings_digest({"path": str(gguf.expanduser().resolve())})


def kept(gguf: Path, cache_dir: Path | str) -> dict[str, int]:
    """The dtypes `gguf` is kept converted in under `cache_dir`, with the bytes each folder holds
    (`forerun models list`).

    Example:
        >>> kept(Path("/models/never-loaded.gguf"), "/no/such/cache")
        {}
    """
    digest = path_digest(gguf)
    folders = (Path(cache_dir).expanduser() / "converted").glob(f"{gguf.stem}-*-{digest}")
    return {
        folder.name[len(gguf.stem) + 1 : -len(digest) - 1]: sum(f.stat().st_size for f in folder.iterdir())
        for folder in sorted(folders)
        if (folder / SOURCE_FILE).is_file()
    }


def index_for(gguf: Path, dtype: torch.dtype, cache_dir: Path | str | None) -> Path | None:
    """Where `gguf`'s tensor index is kept (`INDEX_FILE`, in the folder of its conversion to `dtype`); None where
    nothing is kept (no `cache_dir`, or no folder: the disk was full)."""
    if cache_dir is None:
        return None
    folder = folder_for(gguf, dtype, cache_dir)
    return folder / INDEX_FILE if (folder / SOURCE_FILE).is_file() else None


def source_of(gguf: Path) -> dict[str, object]:
    """What a conversion of `gguf` depends on: the file as it is now, transformers' version, the folder's layout."""
    stat = gguf.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "transformers": transformers.__version__,
            "format": FORMAT}  # fmt: skip


def load_gguf(
    gguf: Path,
    dtype: torch.dtype,
    attn_implementation: str,
    cache_dir: Path | str | None,
    convert: Callable[[], Loaded],
) -> Loaded:
    """(model, tokenizer) of `gguf` in `dtype`: from its converted folder where that is current, else `convert()`
    (transformers' own reading of the file) and keep the result there for the next load.

    The loaded model and tokenizer name the GGUF file's folder (`name_or_path`), as a conversion does."""
    if cache_dir is None:
        return convert()
    folder, source = folder_for(gguf, dtype, cache_dir), source_of(gguf)
    loaded = read_folder(folder, source, dtype, attn_implementation)
    if loaded is None:
        started = time.perf_counter()
        loaded = convert()
        # recorded as the file was before converting: one replaced meanwhile reads as another source next time
        if keep(*loaded, folder, source):
            logger.info("forerun: %s converted in %.1f s and kept in %s", gguf.name, time.perf_counter() - started,
                        folder)  # fmt: skip
    model, tokenizer = loaded
    model.config.name_or_path = tokenizer.name_or_path = str(gguf.parent)
    return model, tokenizer


def read_folder(folder: Path, source: dict[str, object], dtype: torch.dtype, attn_implementation: str) -> Loaded | None:
    """The model and tokenizer kept in `folder` when it was converted from `source`; None where there is no such
    folder, or it was converted from something else or fails to load (then it is removed, to be written again)."""
    if recorded(folder) != source:
        if folder.exists():
            logger.info("forerun: %s was converted from another file or transformers; converting again", folder)
            remove(folder)
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation
        )
    except Exception as error:  # a damaged file of a cache: what transformers, safetensors or json raise varies
        logger.warning("forerun: the converted model in %s does not load (%s: %s); converting again", folder,
                       type(error).__name__, error)  # fmt: skip
        remove(folder)
        return None
    return model, tokenizer


def recorded(folder: Path) -> object:
    """What `folder` records it was converted from (`source_of`), or None where it records nothing readable."""
    try:
        return json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def keep(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path, source: dict[str, object]) -> bool:
    """Write `model` and `tokenizer` to `folder` (whole or not at all: beside it, then renamed). False, with
    nothing written, where the disk lacks room or the cache cannot be written (a read-only home, a full disk,
    a path through a file): the caller still has the model, and the next load converts again."""
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        sweep(folder.parent)
        if shutil.disk_usage(folder.parent).free < needed + SPARE_BYTES:
            logger.warning("forerun: not keeping the converted model (%.0f MB) in %s: too little disk free; it "
                           "will be converted again next time", needed / 1e6, folder.parent)  # fmt: skip
            return False
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        unfaithful = reads_back_otherwise(partial, model, tokenizer)
        if unfaithful is not None:  # a conversion transformers cannot round-trip: used now, never kept wrong
            logger.warning("forerun: the converted model was not kept: %s", unfaithful)
            remove(partial)
            return False
        (partial / SOURCE_FILE).write_text(json.dumps(source))
        if recorded(folder) == source:  # another process kept the same conversion meanwhile: leave it be read
            remove(partial)
            return True
        remove(folder)  # a stale folder (another source), if any
        partial.rename(folder)
        return True
    except OSError as error:  # an unwritable cache, a full disk, another process's folder in the way
        logger.warning("forerun: the converted model was not kept in %s: %s", folder, error)
        remove(partial)
        return False


PROBE_TEXT = "Hello, world!\n\tdef f(x): return x ** 2  # 12345 ünïcödé 漢字 🙂"
"""Text a kept tokenizer must split as the converted one does."""


def reads_back_otherwise(folder: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """None where `folder` (just written) reads back as `model`'s config and `tokenizer`, else what differs (an
    architecture whose GGUF conversion holds something a transformers folder does not keep)."""
    ours, theirs = config_values(model.config), config_values(AutoConfig.from_pretrained(folder, local_files_only=True))
    if ours != theirs:
        keys = sorted(k for k in ours | theirs if ours.get(k) != theirs.get(k))
        return f"its config reads back otherwise ({', '.join(keys)})"
    if tokenizer_facts(AutoTokenizer.from_pretrained(folder, local_files_only=True)) != tokenizer_facts(tokenizer):
        return "its tokenizer reads back otherwise (size, special tokens, chat template or how it splits text)"
    return None


def config_values(config) -> dict[str, object]:
    """A config's values but the name of where it was read from."""
    return {k: v for k, v in config.to_dict().items() if "name_or_path" not in k}


def tokenizer_facts(tokenizer: PreTrainedTokenizerBase) -> tuple:
    """What a kept tokenizer must share with the converted one."""
    return len(tokenizer), tokenizer.all_special_ids, tokenizer.chat_template, tokenizer(PROBE_TEXT).input_ids


def sweep(converted: Path) -> None:
    """Remove half-written folders under `converted` that no writer has touched for `STALE_SECONDS`."""
    for partial in converted.glob("*.partial-*"):
        try:
            stale = time.time() - partial.stat().st_mtime > STALE_SECONDS
        except OSError:
            continue
        if stale:
            remove(partial)


def remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
