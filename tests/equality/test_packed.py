"""Dense weights laid out once for oneDNN's kernels (`forerun.base.packed`): forerun on a packed model writes what
plain generate of the same packed model writes, token for token in fp32, up to ties in bf16; the laid-out layer
multiplies as `F.linear` does (within fp32 rounding; in bf16 exactly, or within one rounding where a bias is added); the
model keeps one copy of each matrix."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from test_low_precision import CURVE, against_generate, reference
from typer.testing import CliRunner

import forerun
from forerun.base import packed as packed_module
from forerun.base.pack_choice import pack_pays
from forerun.base.packed import PackedLinear, bf16_kernels, check_pack, dense_matrix, pack_weights, packable, packed
from forerun.base.weights import looked_up, quantizable, quantize_weights, read_bytes, weights_kind
from forerun.cli import app
from forerun.exactness import first_divergence
from forerun.latency import curve_settings
from forerun.runspec import RunSpec

from tiny_models import prompts, tiny_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_LAID_OUT = pytest.mark.skipif(
    not bf16_kernels(), reason="oneDNN has no bf16 kernels on this CPU (no AVX-512 BW/VL/DQ): bf16 is not laid out"
)
LAID_OUT = [dtype for dtype in DTYPES if dtype == "fp32" or bf16_kernels()]
"""The dtypes this CPU lays out (fp32 on any; bf16 where oneDNN has bf16 kernels)."""


@functools.lru_cache(maxsize=8)
def packed_model(family: str, dtype: str) -> torch.nn.Module:
    model = tiny_model(family, "sdpa").to(DTYPES[dtype])
    assert pack_weights(model) > 0
    return model


@pytest.mark.parametrize("method", ["prompt_lookup", "jacobi", "auto"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3", "gpt_neox"])
def test_fp32_on_packed_weights_equals_generate_of_the_packed_model(family, method):
    model = packed_model(family, "fp32")
    decoder = forerun.Decoder(model, None, method, latency=CURVE)
    drafted = 0
    for prompt in prompts(3):
        expected, _ = reference(model, prompt)
        result = decoder.generate(prompt, 40, eos_token_id=[])
        assert result.new_tokens == expected, (family, method)
        drafted += result.stats.accepted
    assert drafted > 0  # trees were verified through the packed layers, not only 1-token steps


FORCED_ROWS = (0, 4, 4, 5, 4, 5, 6, 7, 8)
"""A row table computing 1 and 2 rows as 4, 3 as 5 (`forerun.base.packed_rows`), whatever this CPU measured."""


@functools.lru_cache(maxsize=8)
def model_with_rows(family: str, dtype: str, attention: str = "sdpa") -> torch.nn.Module:
    model = tiny_model(family, attention).to(DTYPES[dtype])
    assert pack_weights(model) > 0
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            layer.rows = FORCED_ROWS
    return model


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_a_few_rows_computed_as_more_change_no_token(family, attention):
    """Layers computing 1-3 rows as 4-5: forerun writes what plain generate of the same model writes (fp32, every
    token; bf16, up to ties), the steps of every size going through them."""
    for dtype in LAID_OUT:
        model = model_with_rows(family, dtype, attention)
        decoder = forerun.Decoder(model, None, "auto", latency=CURVE)
        for prompt in prompts(3):
            expected, logits = reference(model, prompt)
            got = decoder.generate(prompt, 40, eos_token_id=[]).new_tokens
            if dtype == "fp32":
                assert got == expected, family
            else:
                divergence = first_divergence(expected, got, logits, model.dtype)
                assert divergence is None or divergence.is_tie, (family, divergence)


@BF16_LAID_OUT
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_on_packed_weights_differs_from_generate_only_at_ties(family):
    model = packed_model(family, "bf16")
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE)
    for prompt in prompts(3):
        _, divergence = against_generate(decoder, model, prompt, 40)
        assert divergence is None or divergence.is_tie, (family, divergence)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=BF16_LAID_OUT)])
def test_a_packed_layer_multiplies_as_f_linear_and_keeps_one_copy_of_its_matrix(dtype, bias):
    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 160, bias=bias).to(DTYPES[dtype])
    model = torch.nn.Sequential(torch.nn.Linear(96, 160, bias=bias).to(DTYPES[dtype]))
    model[0].load_state_dict(dense.state_dict())
    assert pack_weights(model) == 1 and packed(model) and isinstance(model[0], PackedLinear)
    assert model[0].weight.layout == torch._mkldnn and len(list(model.parameters())) == 1 + bias  # no dense copy
    assert torch.equal(dense_matrix(model[0]), dense.weight)  # the layout is the matrix, exactly
    assert read_bytes(model) == read_bytes(torch.nn.Sequential(dense))
    x = torch.randn(2, 5, 96).to(DTYPES[dtype])
    # fp32: within rounding of MKL's sums; bf16: the very products, and with a bias added before the one rounding to
    # bf16 (F.linear rounds the product, then the sum): within a bf16 rounding
    tolerance = {"fp32": (1e-5, 1e-5), "bf16": (2**-7, 2**-6) if bias else (0.0, 0.0)}[dtype]
    for inputs in (x, x[:, ::2], torch.randn(96, 7).to(DTYPES[dtype]).T):  # batched, strided, transposed
        torch.testing.assert_close(model(inputs), dense(inputs), rtol=tolerance[0], atol=tolerance[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's casts are F.linear's
        assert model(x.float()).dtype == torch.bfloat16
    grad = x.float().clone().requires_grad_()
    model(grad.to(DTYPES[dtype])).sum().backward()  # autograd's graph too
    assert grad.grad is not None and grad.grad.shape == x.shape


def test_an_output_matrix_tied_to_the_embedding_gets_its_own_layout_and_the_embedding_stays_dense():
    model = tiny_model("llama", "sdpa")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's are
    before = read_bytes(model, looked_up(model))
    ids = prompts(1)[0]
    expected = model(ids).logits
    pack_weights(model)
    assert isinstance(model.lm_head, PackedLinear) and model.model.embed_tokens.weight.layout == torch.strided
    assert looked_up(model) == (model.model.embed_tokens,)  # no longer read by a forward: only looked up
    assert read_bytes(model, looked_up(model)) == before  # the same bytes per forward
    torch.testing.assert_close(model(ids).logits, expected)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied again by hand: the layer multiplies it densely
    torch.testing.assert_close(model(ids).logits, expected)


@pytest.mark.skipif(not quantizable(), reason="the quantize extra (torchao) is not installed")
def test_quantized_layers_stay_quantized_and_the_curve_key_names_the_layout():
    model = tiny_model("llama", "sdpa").to(torch.bfloat16)
    unpacked = curve_settings(model)
    quantize_weights(model, "int8")
    assert pack_weights(model) == 1 and weights_kind(model) == "int8"  # 8-bit codes in every layer but the output
    assert isinstance(model.lm_head, PackedLinear) and curve_settings(model)["output"] == "dense"
    laid_out = packed_model("llama", "fp32")
    assert curve_settings(laid_out)["packed"] is True and "packed" not in unpacked
    assert weights_kind(laid_out) is None  # dense weights: fp32 steps are still timed, not priced


def test_pack_is_refused_where_it_cannot_run_with_the_reason():
    with pytest.raises(ValueError, match="lays weights out for the CPU's kernels; the model is on cuda"):
        check_pack(True, "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="takes fp32 or bf16 weights, got torch.float16"):
        check_pack(True, "cpu", torch.float16)
    check_pack(False, "cuda", torch.float16)  # not asked: nothing to refuse
    with pytest.MonkeyPatch.context() as patch:  # a CPU without oneDNN's bf16 kernels (AVX2): refused up front
        patch.setattr(packed_module, "bf16_kernels", lambda: False)
        with pytest.raises(ValueError, match="pack=True in bf16 needs oneDNN's bf16 kernels, which this CPU lacks"):
            check_pack(True, "cpu", torch.bfloat16)
        check_pack(True, "cpu", torch.float32)
        assert not packable("cpu", torch.bfloat16)
    assert not packable("cuda", torch.float32) and not packable("cpu", torch.float16)
    with pytest.raises(ValueError, match="takes fp32 or bf16 weights"):
        forerun.load_model("smollm2-135m", dtype="fp16", pack=True)


@pytest.mark.real_model
def test_real_model_packed_where_measured_faster_and_unpacked_on_request():
    model, tokenizer = forerun.load_model("smollm2-135m", pack=True)
    plain, _ = forerun.load_model("smollm2-135m", pack=False)
    assert packed(model) and not packed(plain)
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    default, _ = forerun.load_model("smollm2-135m")
    assert packed(default) == (packable("cpu", torch.float32) and pack_pays(plain))  # as measured on this CPU
    ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
    assert forerun.Decoder(model, tokenizer, "auto").generate(ids, 24).new_tokens == expected
    layer = model.model.layers[0].mlp.down_proj
    torch.testing.assert_close(F.linear(torch.ones(1, 1536), dense_matrix(layer)), layer(torch.ones(1, 1536)))


def test_the_command_line_takes_pack_and_names_a_bad_value_before_loading():
    with pytest.raises(ValueError, match="pack must be one of auto, on, off, got 'yes'"):
        RunSpec(pack="yes")
    with pytest.raises(ValueError, match="takes fp32 or bf16 weights"):
        RunSpec(dtype="fp16", pack="on")
    assert RunSpec(dtype="fp16").pack == "auto"  # auto: not laid out where it cannot be, no error
    result = CliRunner().invoke(app, ["generate", "hi", "--pack", "maybe"])
    assert result.exit_code == 2 and "pack must be one of auto, on, off" in result.output
