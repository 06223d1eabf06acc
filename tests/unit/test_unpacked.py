"""Quantized layers take many rows through weights unpacked to bf16 (`forerun.base.unpacked`): the layout read back
exactly, the unpacked weights the kernel's own, the products near the kernel's and taken from WIDE_ROWS rows on."""

from __future__ import annotations

import pytest
import torch

from forerun.base.kernels import KernelLinear, kernel_of
from forerun.base.unpacked import (
    CHUNK_WEIGHTS,
    INT8_WIDE_ROWS,
    WIDE_ROWS,
    int4_codes,
    int4_weights,
    int4_wide,
    layout_holds,
    native_bf16,
)
from forerun.base.weights import quantize_weights

pytest.importorskip("torchao")


def quantized_layer(rows: int, columns: int, bits: str = "int4", seed: int = 0) -> KernelLinear:
    """A quantized layer of random weights taking many rows through unpacked weights (on any CPU: by default only
    where it multiplies bf16 natively, `native_bf16`)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(columns, rows, bias=False).to(torch.bfloat16))
    layer = quantize_weights(model, bits)[0]
    assert type(layer) is KernelLinear
    layer.wide = kernel_of(layer.weight)[2]
    return layer


def rows_of(count: int, columns: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(count, columns, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_this_pytorch_packs_4_bit_weights_as_forerun_reads_them():
    assert layout_holds()


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_layers_unpack_by_default_where_the_cpu_multiplies_bf16_natively(bits):
    layer = quantize_weights(torch.nn.Sequential(torch.nn.Linear(64, 80, bias=False).to(torch.bfloat16)), bits)[0]
    assert (layer.wide is not None) == native_bf16()
    assert kernel_of(layer.weight, unpack_int4=False, unpack_int8=False)[2] is None


@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (64, 32), (80, 64), (192, 96), (1104, 64)])
def test_packed_codes_read_back_exactly(shape):
    codes = torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(int4_codes(packed).int(), codes)
    # the control: another matrix's codes do not read back as these
    assert not torch.equal(
        int4_codes(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.flip(0), 1)).int(), codes
    )


@pytest.mark.parametrize("shape", [(80, 64), (192, 96), (1104, 64)])
def test_unpacked_weights_are_the_kernels_own(shape):
    """The kernel's product with an identity matrix is its weights, transposed, rounded to bf16: the unpacked ones."""
    layer = quantized_layer(*shape)
    packed, group, scale_and_zero = layer.operands
    identity = torch.eye(layer.in_features, dtype=torch.bfloat16)
    assert torch.equal(int4_weights(packed, group, scale_and_zero), layer.product(identity, *layer.operands).T)


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_many_rows_take_the_unpacked_product_and_few_the_kernel(bits):
    layer = quantized_layer(CHUNK_WEIGHTS // 64 + 1104, 64, bits)  # past one chunk of output rows, a tail of 16
    assert layer.out_features * layer.in_features > CHUNK_WEIGHTS
    assert layer.wide.rows == (WIDE_ROWS if bits == "int4" else INT8_WIDE_ROWS)
    few, many = rows_of(layer.wide.rows - 1, 64), rows_of(layer.wide.rows, 64)
    assert torch.equal(layer(few), layer.product(few, *layer.operands))
    wide, kernel = layer(many[None])[0], layer.product(many, *layer.operands)
    assert torch.equal(wide, layer.wide.product(many, *layer.operands)) and not torch.equal(wide, kernel)
    # the same products up to bf16 rounding of the weights and of the result (a wrong layout is far off)
    error = (wide.float() - kernel.float()).abs().max()
    assert float(error) <= 2**-6 * float(kernel.float().abs().max())
    if bits == "int4":
        whole = torch.nn.functional.linear(many, int4_weights(*layer.operands))
        assert torch.allclose(int4_wide(many, *layer.operands).float(), whole.float(), atol=0, rtol=2**-7)


def test_another_layers_operands_give_other_products():
    """The control for the closeness above: a layer of the same shape and other weights is far from it."""
    first, other = quantized_layer(192, 96, seed=0), quantized_layer(192, 96, seed=5)
    many = rows_of(WIDE_ROWS, 96)
    error = (first(many).float() - other.product(many, *other.operands).float()).abs().max()
    assert float(error) > 2**-3 * float(first(many).float().abs().max())
