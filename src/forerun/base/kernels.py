"""Quantized linear layers that call PyTorch's CPU weight-only kernels directly, without tensor-subclass dispatch.

torchao holds quantized weights as tensor subclasses: every `F.linear` on one passes through Python
(`__torch_function__`, then the subclass's own checks and reshapes) before it reaches the kernel. A small model's
decode step calls ~200 linear layers, each of whose products takes a few microseconds on 4-bit weights, so that
dispatch was a large share of the step (docs/benchmarks.md). `KernelLinear` keeps torchao's (or forerun's) packed
weight as its `weight` (shape, dtype, state and `weights_kind` stay as they were) and hands the product straight
to the same ATen kernel the subclass would have called, with the same operands: the numbers are identical.

Example (a [64, 32] layer in 8 bits: 64 outputs, 32 inputs; `quantize_weights` calls `direct_kernels` itself):
    >>> from forerun.base.int8 import quantize_int8
    >>> model = quantize_int8(torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False).to(torch.bfloat16)))
    >>> direct_kernels(model), type(model[0]).__name__, tuple(model[0](torch.ones(3, 32).bfloat16()).shape)
    (1, 'KernelLinear', (3, 64))
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forerun.base.unpacked import INT8_WIDE_ROWS, WIDE_ROWS, Wide, int4_wide, int8_wide, layout_holds, native_bf16

aten = torch.ops.aten


class NamedProduct:
    """A layer whose `product` is an operator object (no pickle takes one): pickled and deep-copied with the
    operator by name (`operator_name`), looked up again when read back. First among a module's bases."""

    def __getstate__(self) -> dict:
        return {**self.__dict__, "product": operator_name(self.product)}  # type: ignore[attr-defined]

    def __setstate__(self, state: dict) -> None:
        super().__setstate__({**state, "product": operator_named(state["product"])})  # type: ignore[misc]


class KernelLinear(NamedProduct, torch.nn.Linear):
    """A linear layer whose product is one ATen weight-only kernel: x [..., in] (bf16) -> [..., out].

    `weight` stays the packed tensor subclass it was built from (so the model still reads as quantized and saves
    as before); `product` and `operands` are what its `F.linear` would have called, looked up once. `wide`, where
    given, multiplies its number of rows or more instead (`forerun.base.unpacked`: the weights unpacked, one dense
    product), on the same operands."""

    def __init__(
        self, linear: torch.nn.Linear, product: Callable[..., torch.Tensor], operands: tuple, wide: Wide | None = None
    ) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.product = product
        self.operands = operands
        self.wide = wide
        self.activations = linear.weight.dtype
        """What the kernel multiplies (bf16): a model cast to another dtype hands it rows of that one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat, cast = x.reshape(-1, self.in_features), x.dtype != self.activations
        if cast:  # compared, not `.to` every call: a step calls ~200 of these layers
            flat = flat.to(self.activations)
        if self.wide is not None and flat.shape[0] >= self.wide.rows:
            out = self.wide.product(flat, *self.operands)
        else:
            out = self.product(flat.contiguous(), *self.operands)
        if out.shape[-1] != self.out_features:  # a kernel that padded its output columns
            out = out[:, : self.out_features]
        out = out.reshape(*x.shape[:-1], self.out_features)
        if cast:
            out = out.to(x.dtype)
        return out + self.bias if self.bias is not None else out


def operator_name(op: Callable[..., torch.Tensor]) -> str:
    """An ATen or quantized operator's qualified name, e.g. "aten::_weight_int8pack_mm" (`operator_named`'s)."""
    return op._qualified_op_name  # type: ignore[attr-defined]


def operator_named(name: str) -> Callable[..., torch.Tensor]:
    """The operator `operator_name` named.

    Example:
        >>> operator_named("aten::_weight_int8pack_mm") is torch.ops.aten._weight_int8pack_mm
        True
    """
    namespace, op = name.split("::")
    return getattr(getattr(torch.ops, namespace), op)


Found = tuple[Callable[..., torch.Tensor], tuple, Wide | None]


def kernel_of(weight: torch.Tensor, unpack_int4: bool = True, unpack_int8: bool = True) -> Found | None:
    """The ATen kernel, its weight operands and the product for many rows (`forerun.base.unpacked`; None where the
    weight's kind is not to be unpacked) for a packed `weight`, or None where it is not one forerun knows (dense,
    or a torchao layout with more than the plain bf16-activation path)."""
    name = type(weight).__name__
    if name == "Int4OpaqueTensor":
        plain = weight.act_mapping_type is None and weight.act_pre_scale is None and weight.block_size[0] == 1
        if plain:
            operands = (weight.qdata, weight.block_size[1], weight.scale_and_zero)
            return aten._weight_int4pack_mm_for_cpu, operands, Wide(int4_wide, WIDE_ROWS) if unpack_int4 else None
        return None
    if name == "Int8RowTensor":
        return (
            aten._weight_int8pack_mm,
            (weight.qdata, weight.scale),
            Wide(int8_wide, INT8_WIDE_ROWS) if unpack_int8 else None,
        )
    return None


def direct_kernels(model: torch.nn.Module) -> int:
    """Replace, in place, every linear layer of `model` whose weight is a packed weight `kernel_of` knows by a
    KernelLinear over the same weight, taking many rows through unpacked weights where the CPU multiplies bf16
    natively (`unpacked.native_bf16`) and, for 4-bit weights, this PyTorch packs them as forerun reads them
    (`unpacked.layout_holds`); returns how many were replaced."""
    unpack = native_bf16()
    unpack_int4 = unpack and layout_holds()

    def direct(layer: torch.nn.Linear) -> torch.nn.Module | None:
        found = kernel_of(layer.weight, unpack_int4, unpack)
        return None if found is None else KernelLinear(layer, *found)

    return replace_linears(model, direct)


def plain_linear(module: torch.nn.Module) -> bool:
    """Whether `module` is a `torch.nn.Linear` itself, whose forward is `F.linear`: what quantized weights implement.
    A subclass may compute its product its own way (Falcon's `FalconLinear`: `input @ weight.T`), which a quantized
    weight does not support: such layers keep dense weights."""
    return type(module) is torch.nn.Linear


def replace_linears(model: torch.nn.Module, build: Callable[[torch.nn.Linear], torch.nn.Module | None]) -> int:
    """Replace, in place, every plain `torch.nn.Linear` of `model` for which `build` returns a module by that
    module (None: kept); returns how many were replaced."""
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if plain_linear(child) and (layer := build(child)) is not None:
                swaps.append((parent, name, layer))
    for parent, name, layer in swaps:
        setattr(parent, name, layer)
    return len(swaps)
