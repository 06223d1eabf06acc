"""A GGUF file's own 4-bit codes kept: Q4_0, Q4_1 and Q4_K blocks become torchao's CPU int4 weights as they are.

A Q4 block holds 32 weights of one row as 4-bit codes q in [0, 15] and one or two fp16 numbers: Q4_0 means
w = d * (q - 8), Q4_1 means w = d * q + m. A Q4_K super-block (llama.cpp's K-quants; Q4_K_M files hold most of their
matrices so) holds 256 weights as 8 groups of 32 codes, each group with a 6-bit scale s and a 6-bit minimum n under
two fp16 numbers: w = d * s * q - dmin * n. tinygemm's int4 layout (`_weight_int4pack_mm_for_cpu`, behind
torchao's `Int4OpaqueTensor`) holds the same groups of 32 as w = scale * (q - 8) + zero. So the file's codes are
kept unchanged, with scale = d, d or d * s and zero = 0, m + 8d or 8 * scale - dmin * n, rounded to bf16 (the
kernel's scale and zero dtype; fp16's 10 fraction bits become 7). Quantizing the dequantized weights again would
choose its own codes: on SmolLM2-135M's Q4_1 file they differ in ~1 weight of 8.

What is not a 4-bit block (llama.cpp's Q8_0 embedding, the output matrix tied to it, a Q4_K_M file's Q6_K matrices)
is quantized by torchao from the dequantized weights, as `quantize="int4"` does for any other model.

Example:
    >>> model, tokenizer = load_model("smollm2-135m", quantize="int4")       # doctest: +SKIP
    >>> # 210 of its 211 linear layers hold the file's Q4_1 codes; the output matrix was quantized by torchao
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from forerun.base.kernels import plain_linear
from forerun.measured import read_json, write_json

logger = logging.getLogger(__name__)

GROUP = 32
"""Weights per Q4 block, per Q4_K group, and per tinygemm group."""
SUPER = 256
"""Weights per Q4_K super-block (8 groups)."""
BLOCK_BYTES = {"Q4_0": 2 + GROUP // 2, "Q4_1": 4 + GROUP // 2, "Q4_K": 4 + 12 + SUPER // 2}
"""Bytes per block: d (fp16), m (fp16, Q4_1 only), then 16 bytes of 32 codes; a Q4_K super-block: d and dmin
(fp16), 12 bytes of 8 packed 6-bit scales and minima, then 128 bytes of 256 codes."""
BLOCK_WEIGHTS = {"Q4_0": GROUP, "Q4_1": GROUP, "Q4_K": SUPER}
"""Weights per block of each kind: a row's length must be a multiple of it."""
TOLERANCE = 2**-6
"""Largest difference, relative to the block's largest weight, between a kept block and the dense weight
transformers dequantized from the same file (bf16 rounding of scale and zero: at most ~2^-8 of it)."""


@dataclass(frozen=True)
class Codes:
    """One matrix's codes [rows, columns] (int32, 0..15) and per-group scale and zero [rows, columns / 32] (fp32)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantized(self) -> torch.Tensor:
        """The weights these codes stand for, [rows, columns] fp32 (scale and zero as the kernel holds them)."""
        scale, zero = (x.to(torch.bfloat16).float().repeat_interleave(GROUP, dim=1) for x in (self.scale, self.zero))
        return (self.codes.float() - 8) * scale + zero


def block_codes(raw: np.ndarray, kind: str, rows: int, columns: int) -> Codes:
    """Unpack a Q4_0/Q4_1/Q4_K tensor's raw bytes (rows x columns weights, row-major blocks) into Codes.

    Example: one Q4_1 block with d = 0.5, m = -1 whose codes are 0, 1, ..., 15, 0, 1, ..., 15:
        >>> head = np.array([0.5, -1.0], dtype=np.float16).view(np.uint8)
        >>> packed = (np.arange(16) | (np.arange(16) << 4)).astype(np.uint8)  # low nibbles first, then high
        >>> got = block_codes(np.concatenate([head, packed]), "Q4_1", 1, 32)
        >>> got.codes[0, :3].tolist(), got.scale.item(), got.zero.item(), got.dequantized()[0, :3].tolist()
        ([0, 1, 2], 0.5, 3.0, [-1.0, -0.5, 0.0])
    """
    count = rows * columns // BLOCK_WEIGHTS[kind]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(count, BLOCK_BYTES[kind])
    codes, scale, zero = super_groups(blocks) if kind == "Q4_K" else simple_groups(blocks, kind)
    groups = columns // GROUP
    return Codes(
        torch.from_numpy(codes.astype(np.int32).reshape(rows, columns)),
        torch.from_numpy(scale.reshape(rows, groups)),
        torch.from_numpy(zero.reshape(rows, groups)),
    )


Groups = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Per group of 32 weights, in the tensor's order: codes [groups, 32] (uint8, 0..15), scale and zero [groups]
(fp32, unrounded: w = scale * (q - 8) + zero)."""


def simple_groups(blocks: np.ndarray, kind: str) -> Groups:
    """Q4_0/Q4_1 blocks [n, 18 or 20] (uint8) as Groups: a block is a group."""
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    packed = blocks[:, BLOCK_BYTES[kind] - GROUP // 2 :]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1)  # elements 0-15, then 16-31
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if kind == "Q4_1" else -8 * d
    return codes, d, m + 8 * d


def super_groups(blocks: np.ndarray) -> Groups:
    """Q4_K super-blocks [n, 144] (uint8) as Groups, 8 per super-block. Its 128 code bytes hold the groups in
    pairs: 32 bytes whose low nibbles are group 2j and high nibbles group 2j + 1 (llama.cpp's
    `dequantize_row_q4_K`); the 6-bit scales and minima are unpacked by gguf's own reader."""
    from gguf.quants import Q4_K

    count = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    scales, minima = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each
    packed = blocks[:, 16:].reshape(count, 4, 1, GROUP)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(count * 8, GROUP)
    scale = (d * scales.astype(np.float32)).reshape(-1)
    low = (dmin * minima.astype(np.float32)).reshape(-1)
    return codes, scale, 8 * scale - low


def int4_weight(codes: Codes) -> torch.nn.Parameter:
    """`codes` packed for tinygemm's CPU kernel, as torchao's Int4OpaqueTensor holds them (bf16 scale and zero)."""
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.codes, 1)
    scale_and_zero = pack_tinygemm_scales_and_zeros(
        codes.scale.to(torch.bfloat16), codes.zero.to(torch.bfloat16), torch.bfloat16
    )
    tensor = Int4OpaqueTensor(packed, scale_and_zero, [1, GROUP], codes.codes.shape)
    return torch.nn.Parameter(tensor, requires_grad=False)


def row_order(model: torch.nn.Module, architecture: str, name: str, rows: int) -> np.ndarray | None:
    """The file's row for each of the model's rows (llama's q/k rows are stored permuted for llama.cpp's rotary),
    asked of transformers' own GGUF processor; None where that processor does more than reorder rows."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor

    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if processor_class not in (TensorProcessor, LlamaTensorProcessor):
        return None
    config = model.config
    heads = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
    index = np.arange(rows, dtype=np.int64)[:, None]
    return processor_class(config=heads).process(weights=index, name=name).weights[:, 0]


@dataclass(frozen=True)
class Kept:
    """What `keep_codes` did: modules holding the file's codes, and those left for torchao (with why)."""

    kept: tuple[str, ...]
    left: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Place:
    """Where one tensor's bytes lie in a GGUF file: its kind ("Q4_1", "Q8_0", "F32"...), first byte and length."""

    kind: str
    offset: int
    size: int


@dataclass(frozen=True)
class Places:
    """A GGUF file's architecture and the place of every tensor (`read_places`), kept as a small JSON file beside
    the converted model (`load_model`) so that a later load reads the codes without parsing the file's metadata."""

    architecture: str
    tensors: dict[str, Place]

    def raw(self, path: Path, name: str) -> np.ndarray | None:
        """The bytes of tensor `name` (uint8, read from `path` as needed), or None where the file has no such one."""
        place = self.tensors.get(name)
        return None if place is None else np.memmap(path, np.uint8, "r", place.offset, (place.size,))

    def as_dict(self) -> dict[str, object]:
        tensors = {name: [p.kind, p.offset, p.size] for name, p in self.tensors.items()}
        return {"architecture": self.architecture, "tensors": tensors}

    @classmethod
    def from_dict(cls, data: dict) -> Places:
        tensors = {
            name: Place(str(kind), int(offset), int(size)) for name, (kind, offset, size) in data["tensors"].items()
        }
        return cls(str(data["architecture"]), tensors)


def read_places(path: Path | str) -> Places:
    """Every tensor's place in the GGUF file `path` (gguf's reader: it parses all the metadata, seconds for a
    large vocabulary)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    tensors = {t.name: Place(t.tensor_type.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    return Places(architecture, tensors)


def places_of(path: Path, index: Path | None) -> Places:
    """The places of `path`'s tensors: read from `index` (a JSON file of `Places.as_dict` written for this very
    file) where it holds them, else from the file itself, then kept in `index` where its folder still is."""
    try:
        return Places.from_dict(read_json(index) if index is not None else None)  # type: ignore[arg-type]
    except (TypeError, KeyError, ValueError):  # no index, not written yet, or damaged: read the file again
        pass
    places = read_places(path)
    if index is not None and index.parent.is_dir():
        try:
            write_json(index, places.as_dict())
        except OSError as error:  # a full disk: the next load reads the file again
            logger.warning("the GGUF tensor index was not kept in %s: %s", index, error)
    return places


def keep_codes(model: torch.nn.Module, path: Path | str, index: Path | None = None) -> Kept:
    """Give every linear layer of `model` (loaded dense from the GGUF file `path`) whose tensor is Q4_0/Q4_1/Q4_K the
    file's codes; the others are left as they are (listed with the reason). A block that does not match the dense
    weight transformers loaded (an unexpected layout) is left too, never kept wrong. `index`: where the file's
    tensor places are kept between loads (`places_of`; None: read from the file each time)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    path = Path(path)
    places = places_of(path, index)
    architecture = places.architecture
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        return Kept((), (("*", f"gguf does not know architecture {architecture!r}"),))
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    kept, left = [], []
    for module_name, module in model.named_modules():
        if not plain_linear(module):
            continue
        tensor_name = f"{names.get_name(module_name)}.weight"
        place = places.tensors.get(tensor_name)
        reason = why_not(module, place)
        if reason is None:
            rows, columns = module.weight.shape
            codes = block_codes(places.raw(path, tensor_name), place.kind, rows, columns)
            order = row_order(model, architecture, tensor_name, rows)
            if order is None:
                reason = f"transformers' {architecture} processor does more than reorder rows"
            else:
                codes = Codes(codes.codes[order], codes.scale[order], codes.zero[order])
                reason = mismatch(codes, module.weight)
        if reason is None:
            module.weight = int4_weight(codes)
            kept.append(module_name)
        else:
            left.append((module_name, reason))
    logger.info("kept the GGUF file's 4-bit codes in %d linear layers; %d left to torchao", len(kept), len(left))
    return Kept(tuple(kept), tuple(left))


def why_not(module: torch.nn.Linear, place: Place | None) -> str | None:
    """None if the tensor at `place` (None: not in the file) holds `module`'s weight as Q4 blocks that can be kept."""
    if place is None:
        return "not in the file (tied to another tensor)"
    kind = place.kind
    if kind not in BLOCK_BYTES:
        return f"stored as {kind}"
    if module.weight.shape[1] % BLOCK_WEIGHTS[kind] or type(module.weight) is not torch.nn.Parameter:
        return f"not a dense matrix with rows in blocks of {BLOCK_WEIGHTS[kind]}"
    return None


def mismatch(codes: Codes, weight: torch.Tensor) -> str | None:
    """None if `codes` stand for `weight` (the dense copy of the same tensor) up to TOLERANCE, else why not."""
    dense = weight.detach().float()
    error = (codes.dequantized() - dense).abs().view(dense.shape[0], -1, GROUP).amax(-1)
    largest = dense.abs().view(dense.shape[0], -1, GROUP).amax(-1).clamp_min(1e-12)
    worst = float((error / largest).max())
    return None if worst <= TOLERANCE else f"its blocks differ from the loaded weight ({worst:.3g} of a block)"
