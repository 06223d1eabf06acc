"""8-bit weights on the CPU: one int8 code per weight and one scale per output row, multiplied by PyTorch's own
`aten._weight_int8pack_mm` (bf16 activations).

torchao's `Int8WeightOnlyConfig` (0.18.0) dequantizes the whole matrix to bf16 on every CPU call, which measured
slower than the bf16 product it replaces (docs/benchmarks.md); PyTorch ships a CPU kernel that reads the int8
codes directly. This tensor subclass hands `F.linear` to that kernel, on torchao's tensor-subclass base (the same
machinery as its int4 CPU layout), with torchao's symmetric per-row quantization.

Example (a [3, 64] matrix: 3 rows of 64 codes, 3 scales):
    >>> weight = Int8RowTensor.from_hp(torch.randn(3, 64, dtype=torch.bfloat16))
    >>> weight.qdata.dtype, tuple(weight.scale.shape), tuple(F.linear(torch.ones(2, 64).bfloat16(), weight).shape)
    (torch.int8, (3,), (2, 3))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine
from torchao.utils import TorchAOBaseTensor

from forerun.base.kernels import plain_linear

aten = torch.ops.aten


class Int8RowTensor(TorchAOBaseTensor):
    """A [rows, columns] weight held as int8 codes `qdata` [rows, columns] and bf16 `scale` [rows]:
    w = qdata * scale (symmetric, one scale per output row)."""

    tensor_data_names = ["qdata", "scale"]
    tensor_attribute_names = []

    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor):
        kwargs = {"device": qdata.device, "dtype": scale.dtype, "requires_grad": False}
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, **kwargs)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.qdata = qdata
        self.scale = scale

    @classmethod
    def from_hp(cls, weight: torch.Tensor) -> Int8RowTensor:
        """Quantize a dense [rows, columns] weight (bf16): codes in [-127, 127], scale = the row's largest |w| / 127."""
        block = [1, weight.shape[1]]
        scale, zero = choose_qparams_affine(
            weight, MappingType.SYMMETRIC, block, torch.int8, quant_min=-127, quant_max=127, scale_dtype=torch.float32
        )
        codes = quantize_affine(weight, block, scale, zero, torch.int8, quant_min=-127, quant_max=127)
        return cls(codes.contiguous(), scale.reshape(-1).to(weight.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.scale.dtype) * self.scale[:, None]


implements = Int8RowTensor.implements
implements_torch_function = Int8RowTensor.implements_torch_function


@implements(aten.linear.default)
@implements_torch_function(F.linear)
def _linear(func, types, args, kwargs):
    """x [..., columns] (bf16) @ w^T -> [..., rows], by the int8 kernel (it takes 2-D inputs)."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = aten._weight_int8pack_mm(flat, weight.qdata, weight.scale).reshape(*x.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


def quantize_int8(model: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> torch.nn.Module:
    """Give every dense linear layer of `model` (bf16) but those in `skip` 8-bit weights, in place (`plain_linear`
    ones: a subclass's own product is not the int8 kernel's)."""
    for module in model.modules():
        if plain_linear(module) and type(module.weight) in (torch.Tensor, torch.nn.Parameter) and module not in skip:
            module.weight = torch.nn.Parameter(Int8RowTensor.from_hp(module.weight.detach()), requires_grad=False)
    return model
