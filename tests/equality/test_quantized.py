"""4- and 8-bit weights (torchao's CPU int4 layout; int8 codes with a scale per row; bf16 activations) and 8-bit
weights with 8-bit activations (w8a8, fp32 around them): forerun on a quantized model against plain generate of the
same quantized model. Every first difference must sit on a numerical tie, as for bf16 (w8a8: at bf16's resolution)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from test_low_precision import CURVE, against_generate, real_model_ties, reference

import forerun
from forerun.base.row_int8 import exact_sums
from forerun.base.weights import check_quantize, dense, quantize_weights, weights_kind
from forerun.drafters.eagle3 import load_head
from forerun.drafters.eagle3.runner import HeadRunner
from forerun.exactness import W8A8_EPS, first_divergence, resolution
from forerun.latency import curve_settings

from eagle3_heads import write_head
from tiny_models import VOCAB, prompts, quantized_tiny, tiny_model


@functools.lru_cache(maxsize=6)
def int4_model(family: str, bits: str = "int4") -> torch.nn.Module:
    return quantized_tiny(family, bits)


w8a8_runs = pytest.mark.skipif(not exact_sums(), reason="this CPU's integer product saturates (no AVX-512 VNNI)")


@pytest.mark.parametrize("bits", ["int4", "int8", pytest.param("w8a8", marks=w8a8_runs)])
@pytest.mark.parametrize("method", ["prompt_lookup", "auto"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_first_differences_are_ties(family, method, bits):
    model = int4_model(family, bits)
    assert weights_kind(model) == bits
    decoder = forerun.Decoder(model, None, method, latency=CURVE)
    drafted = 0
    for prompt in prompts(3):
        result, divergence = against_generate(decoder, model, prompt, 40)
        assert divergence is None or divergence.is_tie, (family, method, divergence)
        drafted += result.stats.accepted
    assert drafted > 0  # trees were verified on the 4-bit weights


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_a_head_over_quantized_weights_is_quantized_alike_and_drafts(bits, tmp_path):
    model = int4_model("llama", bits)
    write_head(tmp_path, model)
    head, dense = load_head(tmp_path, model), load_head(tmp_path, model, quantized=False)
    assert weights_kind(head) == bits and weights_kind(dense) is None
    # the same head in fewer bits: its draft distribution over the same inputs nearly the dense one's (another
    # head's is not: the control)
    write_head(tmp_path / "other", model, edit_state=lambda state: torch.nn.init.normal_(state["lm_head.weight"]))
    other = load_head(tmp_path / "other", model, quantized=False)
    features = torch.randn(5, 3 * model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    probs = {}
    for name, each in (("quantized", head), ("dense", dense), ("other", other)):
        runner = HeadRunner(each, topk=2, capture=False)
        runner.reserve(0, 8)
        with torch.inference_mode():
            read = runner.read([3, 4, 5, 6, 7], list(range(5)), list(range(5)), [(s + 1, []) for s in range(5)],
                               features.to(torch.bfloat16), True)  # fmt: skip
            probs[name] = torch.softmax(each.draft_logits(read.out).float(), -1)
    near = float((probs["quantized"] - probs["dense"]).abs().sum(-1).max())  # twice the total variation distance
    far = float((probs["other"] - probs["dense"]).abs().sum(-1).max())
    assert near < 0.3 < far
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=head, adaptive=False)
    candidates = 0
    for prompt in prompts(2):
        result, divergence = against_generate(decoder, model, prompt, 40)
        assert divergence is None or divergence.is_tie, (bits, divergence)
        candidates += result.stats.candidates
    assert candidates > 0  # the quantized head drafted: trees were verified


def test_int4_weights_are_their_own_curve_and_bad_settings_are_refused():
    dense = tiny_model("llama", "sdpa").to(torch.bfloat16)
    assert weights_kind(dense) is None and "weights" not in curve_settings(dense)
    assert curve_settings(int4_model("llama"))["weights"] == "int4"
    assert curve_settings(int4_model("llama"))["kernels"] == "direct"  # not the curve measured through the subclass
    assert curve_settings(int4_model("llama", "int8"))["weights"] == "int8"
    with pytest.raises(ValueError, match="quantize must be one of int4"):
        check_quantize("int3", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="computes in bf16"):
        check_quantize("int4", "cpu", torch.float32)
    with pytest.raises(ValueError, match="runs on the CPU"):
        check_quantize("int4", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="quantize must be one of"):
        forerun.load_model("smollm2-135m", quantize="int2")


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_linear_subclasses_with_their_own_product_stay_dense(bits, caplog):
    """Falcon's layers are `FalconLinear`s computing `input @ weight.T`, which a quantized weight does not
    implement: they keep dense weights (a 4-bit one had failed the first forward). Its output matrix stays dense,
    as every model's does, so nothing of it is quantized, which is said; forerun's first differences from its plain
    generate are ties (bf16)."""
    with caplog.at_level(logging.WARNING, logger="forerun.base.weights"):
        model = quantize_weights(tiny_model("falcon", "sdpa").to(torch.bfloat16), bits)
    assert f"quantize='{bits}': no linear layer of FalconForCausalLM can hold it" in caplog.text
    attention = model.transformer.h[0].self_attention
    assert type(attention.query_key_value).__name__ == "FalconLinear" and dense(attention.query_key_value.weight)
    assert dense(model.lm_head.weight) and weights_kind(model) is None
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    for prompt in prompts(2):
        _, divergence = against_generate(decoder, model, prompt, 24)
        assert divergence is None or divergence.is_tie, (bits, divergence)


@pytest.mark.real_model
def test_real_model_with_int4_weights_differs_only_at_ties():
    model, tokenizer = forerun.load_model("smollm2-135m", quantize="int4")
    assert model.dtype == torch.bfloat16 and weights_kind(model) == "int4"
    assert real_model_ties(model, tokenizer, 64) >= 1


def test_int8_weights_are_within_a_step_of_the_dense_ones():
    from forerun.base.int8 import Int8RowTensor

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    quantized = Int8RowTensor.from_hp(weight)
    step = weight.float().abs().amax(1, keepdim=True) / 127
    # half a step from rounding to a code; the bf16 scale and product round too (2^-9 of 127 steps: a quarter each)
    error = (quantized.dequantize().float() - weight.float()).abs()
    assert bool((error <= step).all()) and float((error / step).mean()) < 0.4
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    product = torch.nn.functional.linear(x, quantized)  # PyTorch's int8 kernel, through the subclass
    expected = x.float() @ quantized.dequantize().float().T
    assert float((product.float() - expected).abs().max()) <= 2**-7 * float(expected.abs().max())  # a bf16 step


@w8a8_runs
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gemma", "mistral", "gpt2"])
def test_w8a8_first_differences_are_ties_in_more_families_and_attentions(family, impl):
    texts = [torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model = quantize_weights(tiny_model(family, impl), "w8a8", texts)
    assert weights_kind(model) == "w8a8"
    drafted = 0
    for method in ("prompt_lookup", "jacobi", "auto"):
        decoder = forerun.Decoder(model, None, method, latency=CURVE)
        for prompt in prompts(2):
            result, divergence = against_generate(decoder, model, prompt, 32)
            assert divergence is None or divergence.is_tie, (family, impl, method, divergence)
            drafted += result.stats.accepted
    assert drafted > 0  # trees were verified on the integer products


@w8a8_runs
def test_w8a8_rows_of_a_batch_differ_from_each_prompt_alone_only_at_ties():
    """A batch's rows (padded trees, one ragged cache) against plain generate of each prompt alone; the rows'
    integer products do not depend on the rows beside them."""
    model = int4_model("llama", "w8a8")
    rows = [p[0].tolist() for p in prompts(3)]
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE.with_batches([(2, CURVE), (4, CURVE)]))
    results = decoder.generate(rows, 32, eos_token_id=[])
    for row, result in zip(rows, results, strict=True):
        expected, logits = reference(model, torch.tensor([row]), 32)
        divergence = first_divergence(expected, result.new_tokens, logits, resolution(model))
        assert divergence is None or divergence.is_tie, divergence
    assert sum(result.stats.accepted for result in results) > 0  # trees were verified in the batch


@pytest.mark.real_model
@w8a8_runs
def test_real_model_with_w8a8_differs_only_at_ties():
    model, tokenizer = forerun.load_model("smollm2-135m", quantize="w8a8")
    assert model.dtype == torch.float32 and weights_kind(model) == "w8a8" and resolution(model) == W8A8_EPS
    assert real_model_ties(model, tokenizer, 64) >= 1


@pytest.mark.real_model
def test_real_model_with_int8_weights_differs_only_at_ties():
    model, tokenizer = forerun.load_model("smollm2-135m", quantize="int8")
    assert model.dtype == torch.bfloat16 and weights_kind(model) == "int8"
    assert real_model_ties(model, tokenizer, 64) >= 1


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_layers_call_their_kernel_directly_with_the_subclass_numbers(bits):
    from forerun.base.kernels import KernelLinear, direct_kernels

    model = int4_model("llama", bits)
    layers = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert type(model.lm_head) is torch.nn.Linear and dense(model.lm_head.weight)  # the output matrix stays dense
    layers = [layer for layer in layers if layer is not model.lm_head]
    assert layers and all(type(layer) is KernelLinear for layer in layers)
    assert direct_kernels(model) == 0  # already direct: nothing left to replace
    generator = torch.Generator().manual_seed(0)
    for layer in layers:
        x = torch.randn(2, 3, layer.in_features, generator=generator).to(torch.bfloat16)
        expected = torch.nn.functional.linear(x, layer.weight)  # through torchao's / forerun's tensor subclass
        assert torch.equal(layer(x), expected)
    # a layer's own operands matter: another weight of its shape gives other numbers (the check can fail)
    first, other = next((a, b) for a in layers for b in layers if a is not b and a.weight.shape == b.weight.shape)
    x = torch.randn(4, first.in_features, generator=generator).to(torch.bfloat16)
    assert not torch.equal(KernelLinear(first, first.product, other.operands)(x), first(x))


def test_compiled_buckets_on_4_bit_weights_differ_only_at_ties():
    """The CPU's compiled static base over a quantized model (inductor around the direct 4-bit kernels): drafted
    steps, and every first difference from the same model's plain generate sits on a tie (two buckets, two
    compilations)."""
    from forerun.base.static import StaticBase

    model = int4_model("llama")
    decoder = forerun.Decoder(model, None, "prompt_lookup", max_tree_nodes=4, adaptive=False, draft_len=3,
                              max_branches=1)  # fmt: skip
    decoder.base = StaticBase(model, buckets=(1, 4), compiled=True)
    drafted = 0
    for prompt in prompts(2):
        result, divergence = against_generate(decoder, model, prompt, 40)
        assert divergence is None or divergence.is_tie, divergence
        drafted += result.stats.accepted
    assert decoder.base.steps.keys() == {(1, 1, False), (1, 4, False)} and drafted > 0
