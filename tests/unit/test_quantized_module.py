"""A model with forerun's 4- and 8-bit layers (`KernelLinear`, `RowInt8Linear`) deep-copies and pickles (their
kernels travel by name: an operator object does not pickle), and cast to another dtype computes in it (the kernel
still multiplies the dtype it was built for): each failed before, the cast at its first forward."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from forerun.base.kernels import KernelLinear
from forerun.base.row_int8 import RowInt8Linear, exact_sums

from tiny_models import quantized_tiny

IDS = torch.tensor([[3, 17, 42, 9, 88, 5]])
BITS = ["int4", "int8", pytest.param("w8a8", marks=pytest.mark.skipif(not exact_sums(), reason="no AVX-512 VNNI"))]


def quantized(bits: str) -> torch.nn.Module:
    return quantized_tiny("llama", bits)


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def layers(model: torch.nn.Module) -> int:
    return sum(isinstance(m, KernelLinear | RowInt8Linear) for m in model.modules())


@pytest.mark.parametrize("bits", BITS)
def test_a_quantized_model_deep_copies_and_pickles_with_its_kernels(bits: str):
    model = quantized(bits)
    assert layers(model) > 0
    before = logits(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert layers(twin) == layers(model)
        assert torch.equal(logits(twin), before)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_quantized_model_cast_computes_in_its_new_dtype(bits: str, dtype: torch.dtype):
    model = quantized(bits)
    before = logits(model).float()
    model.to(dtype)
    after = logits(model)
    assert after.dtype == dtype
    torch.testing.assert_close(after.float(), before, rtol=0.05, atol=0.05)  # the same model, other rounding


@pytest.mark.skipif(not exact_sums(), reason="no AVX-512 VNNI")
def test_a_w8a8_model_refuses_a_checkpoint_that_would_hold_none_of_its_linear_weights(tmp_path):
    """fbgemm's packed codes are no parameter: `save_pretrained` wrote a checkpoint without them, silently."""
    model = quantized("w8a8")
    for save in (model.state_dict, lambda: model.save_pretrained(tmp_path)):
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: a w8a8 layer's weights"):
            save()
    assert not list(tmp_path.glob("*.safetensors"))
