"""Many rows through quantized weights: the weights unpacked to bf16 and one dense product, instead of the
weight-only kernel.

PyTorch's CPU kernels for 4- and 8-bit weights (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) unpack the
weights again for every few rows they multiply, so their cost grows with the rows as a dense product's does, at
2.5-3x its slope (docs/benchmarks.md, "Many rows through 4- and 8-bit weights"). A decode step's few rows are what
they are made for; a prompt's hundreds are not: unpacking a matrix once (about what the 4-bit kernel spends on 25
rows) and handing the rows to the bf16 product (oneDNN) reads a 2,000-token prompt ~1.6x faster. `KernelLinear` takes
this path from `WIDE_ROWS` rows with 4-bit weights (a prefill, a batch's wide step; never a single row's tree, at
most 64 nodes on a CPU) and from `INT8_WIDE_ROWS` with 8-bit ones, on CPUs that multiply bf16 natively
(`native_bf16`: AVX-512 BF16, AMX), where the dense product is the fast one.

The numbers: a 4-bit weight unpacked here is w = (q - 8) * scale + zero computed in fp32 and rounded to bf16, the
very value the kernel's product with an identity matrix gives, so a row's product differs from the kernel's only by
that rounding of the weights and by the order of the sums: a bf16 model's kind of difference (forerun's text then
differs from plain generate of the same model only at ties, as for any bf16 model; plain generate's own prompt
goes the same way). An 8-bit weight's codes are exact in bf16; its row scale multiplies the product after it.

The packed 4-bit layout (tinygemm's, for the CPU; read off `_convert_weight_to_int4pack_for_cpu`, checked by
`layout_holds` before it is used): a [N, K/2] uint8 tensor holding, per block of 64 output rows, K x 32 bytes whose
low nibble is row j's code and high nibble row j + 32's (j < 32) for each input column in turn; output rows past the
last whole block (16 or 48 of them) come after as K x (rows / 2) bytes, each the codes of two adjacent rows.

Example (a [80, 64] matrix's codes packed, then read back):
    >>> codes = torch.randint(0, 16, (80, 64), generator=torch.Generator().manual_seed(0))
    >>> packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    >>> tuple(packed.shape), torch.equal(int4_codes(packed).long(), codes)
    ((80, 32), True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from forerun.measured import cpuinfo

WIDE_ROWS = 96
"""Rows from which a 4-bit layer unpacks its weights and multiplies them dense. Unpacking a matrix costs what the
4-bit kernel spends on a few dozen of its rows, and each further row costs the kernel ~2.5x what it costs the dense
product: over a decoder layer of SmolLM2-135M the two meet at 64 rows (docs/benchmarks.md), and 96 leaves a margin
above a CPU tree's 64 nodes, so a single row's steps never take it."""
INT8_WIDE_ROWS = 24
"""The same for 8-bit weights, whose codes become bf16 in one cast (a quarter of the 4-bit unpacking): the two
meet near 14 rows (docs/benchmarks.md); from 24, trees of a single row included."""
BLOCK = 64
"""Output rows per block of the packed 4-bit layout."""
CHUNK_WEIGHTS = 1 << 20
"""Weights unpacked at a time (in whole blocks of output rows): a chunk's fp32 weights (4 MB) stay in the core's
caches while its product reads them. An output matrix of 49,152 x 576 unpacked whole took 2.5x as long."""


@dataclass(frozen=True)
class Wide:
    """A quantized layer's product for many rows: `product(x [M, K], *operands) -> [M, N]`, from `rows` rows on."""

    product: Callable[..., torch.Tensor]
    rows: int


def int4_codes(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] (uint8, 0..15) of a packed [N, K/2] 4-bit weight (the module docstring's layout): its
    weights with scale 1 and zero 8, one group a row (`int4_transposed` alone reads the layout)."""
    rows, half = packed.shape
    unit = torch.tensor([1.0, 8.0], dtype=torch.bfloat16).expand(1, rows, 2)
    return int4_transposed(packed, 2 * half, unit).T.to(torch.uint8)


def int4_weights(packed: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """The bf16 weights [N, K] a packed 4-bit weight stands for (a view of `int4_transposed`'s)."""
    return int4_transposed(packed, group, scale_and_zero).T


def int4_transposed(packed: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """The bf16 weights of a packed 4-bit weight as [K, N] (the product's right operand): (q - 8) * scale + zero
    per group of `group` input columns, in fp32, rounded once; `scale_and_zero` [K / group, N, 2] as the kernel
    takes it. The whole blocks are unpacked column-major first, so that the fp32 work is written where it stays."""
    rows, half = packed.shape
    whole = rows // BLOCK * BLOCK
    parts = []
    if whole:
        blocks = packed[:whole].view(whole // BLOCK, 2 * half, BLOCK // 2).transpose(0, 1)  # [K, blocks, 32]
        bytes_ = blocks.contiguous()[:, :, None]  # [K, blocks, 1, 32]
        codes = torch.cat((bytes_ & 15, bytes_ >> 4), 2)  # [K, blocks, 2, 32]: rows j and j + 32 of a block
        parts.append(affine(codes.view(2 * half, whole), group, scale_and_zero[:, :whole]))
    if whole < rows:
        tail = packed[whole:].reshape(2 * half, (rows - whole) // 2)  # [K, pairs of adjacent rows]
        codes = torch.stack((tail & 15, tail >> 4), -1).view(2 * half, rows - whole)
        parts.append(affine(codes, group, scale_and_zero[:, whole:]))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def affine(codes: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """(codes - 8) * scale + zero [K, n] in bf16, from codes [K, n] and scale_and_zero [K / group, n, 2]."""
    columns, rows = codes.shape
    grouped = codes.view(columns // group, group, rows).float().sub_(8)
    scale, zero = (scale_and_zero[:, None, :, which].float() for which in (0, 1))  # [groups, 1, n]
    return torch.addcmul(zero, grouped, scale, out=grouped).to(torch.bfloat16).view(columns, rows)


def int4_wide(x: torch.Tensor, packed: torch.Tensor, group: int, scale_and_zero: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) times a packed 4-bit weight, its weights unpacked a chunk at a time (`by_chunks`): [M, N]."""
    return by_chunks(x, packed.shape[0], lambda a, b: x @ int4_transposed(packed[a:b], group, scale_and_zero[:, a:b]))


def int8_wide(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) times int8 `codes` [N, K] with a bf16 `scale` [N] per output row, the codes cast a chunk at a
    time (`by_chunks`): [M, N]."""
    return by_chunks(x, codes.shape[0], lambda a, b: torch.nn.functional.linear(x, codes[a:b].to(x.dtype)) * scale[a:b])


def by_chunks(x: torch.Tensor, rows: int, product: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x [M, K] times a weight of `rows` output rows, as `product(start, stop)` [M, stop - start] of a chunk of
    them at a time (about CHUNK_WEIGHTS weights, in whole blocks), joined: [M, rows]."""
    chunk = max(BLOCK, CHUNK_WEIGHTS // x.shape[-1] // BLOCK * BLOCK)
    parts = [product(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), where the dense product is the fast one.
    Elsewhere oneDNN computes bf16 products on fp32 units, about as fast a row as the 4-bit kernel: nothing is
    unpacked there (read from /proc/cpuinfo: no such file, no flags, nothing unpacked)."""
    flags = set(cpuinfo("flags").split())
    return bool({"avx512_bf16", "amx_bf16"} & flags) and torch.backends.mkldnn.is_available()


def layout_holds() -> bool:
    """Whether this PyTorch packs 4-bit weights as `int4_codes` reads them (whole blocks and a tail of 16 rows)."""
    codes = torch.randint(0, 16, (BLOCK + 16, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return tuple(packed.shape) == (BLOCK + 16, 32) and torch.equal(int4_codes(packed).int(), codes)
    except (RuntimeError, AttributeError):  # no such kernel, or another layout's shape
        return False
