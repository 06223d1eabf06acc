"""Attention computed in fp32 for half-precision weights on the CPU (`forerun.attention`)."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import forerun
from forerun.attention import SDPA_FP32, pick_attention, register, sdpa_in_fp32
from forerun.latency import curve_settings
from forerun.tree import tree_support

from tiny_models import tiny_model


class Grouped(torch.nn.Module):
    """What transformers' sdpa reads off an attention module: 9 query heads over 3 key/value heads."""

    num_key_value_groups = 3
    is_causal = True


def qkv(queries: int, dtype: torch.dtype, cached: int = 40):
    generator = torch.Generator().manual_seed(0)
    shapes = ((1, 9, queries, 64), (1, 3, cached, 64), (1, 3, cached, 64))
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


@pytest.mark.parametrize("queries", [1, 5])
def test_fp32_attention_is_sdpa_on_upcast_inputs_and_returns_the_query_dtype(queries):
    query, key, value = qkv(queries, torch.bfloat16)
    visible = torch.ones(1, 1, queries, 40, dtype=torch.bool).tril(40 - queries)
    mask = visible if queries > 1 else None
    got, _ = sdpa_in_fp32(Grouped(), query, key, value, mask, scaling=0.125)
    exact, _ = sdpa_attention_forward(Grouped(), query.float(), key.float(), value.float(), mask, scaling=0.125)
    assert got.dtype == torch.bfloat16 and got.shape == (1, queries, 9, 64)
    assert torch.equal(got, exact.to(torch.bfloat16))
    # The negative control: bf16 sdpa is another computation (its rounding differs somewhere).
    half, _ = sdpa_attention_forward(Grouped(), query, key, value, mask, scaling=0.125)
    assert not torch.equal(got, half)


def test_auto_picks_fp32_attention_for_half_precision_on_the_cpu_only():
    assert pick_attention("auto", "cpu", torch.bfloat16) == SDPA_FP32
    assert pick_attention("auto", "cpu", torch.float16) == SDPA_FP32
    assert pick_attention("auto", "cpu", torch.float32) == "sdpa"
    assert pick_attention("auto", "cuda", torch.bfloat16) == "sdpa"
    assert pick_attention("eager", "cpu", torch.bfloat16) == "eager"


def test_a_model_with_fp32_attention_verifies_trees_and_has_its_own_curve():
    register()
    model = tiny_model("llama", SDPA_FP32).to(torch.bfloat16)
    assert tree_support(model) is None
    assert curve_settings(model)["attention"] == SDPA_FP32
    assert curve_settings(model) != curve_settings(tiny_model("llama", "sdpa").to(torch.bfloat16))


def test_a_tree_mask_reaches_the_fp32_kernel():
    # A chain fed with a 4-D mask that hides everything but the prefix and the node itself must change the logits
    # of the later nodes (the mask is used, not dropped for an implementation transformers does not know).
    register()
    model = tiny_model("llama", SDPA_FP32).to(torch.bfloat16)
    ids = torch.arange(3, 13)[None]
    with torch.inference_mode():
        cache = model(ids[:, :6], use_cache=True).past_key_values
        causal = torch.ones(1, 1, 4, 10, dtype=torch.bool).tril(6)
        alone = causal.clone()
        alone[..., 6:] = torch.eye(4, dtype=torch.bool)
        positions = torch.arange(6, 10)[None]
        a = model(ids[:, 6:], past_key_values=cache, attention_mask=causal, position_ids=positions).logits
        cache.crop(-4)
        b = model(ids[:, 6:], past_key_values=cache, attention_mask=alone, position_ids=positions).logits
    assert torch.equal(a[0, 0], b[0, 0]) and not torch.equal(a[0, 1:], b[0, 1:])


@pytest.mark.real_model
def test_the_real_model_loads_with_fp32_attention_in_bf16():
    model, _ = forerun.load_model("smollm2-135m", dtype="bf16")
    assert model.config._attn_implementation == SDPA_FP32


def test_padding_reaches_the_fp32_kernel():
    # A left-padded batch's 2-D mask becomes sdpa's own 4-D mask only if transformers knows which mask the name
    # takes (registered beside the attention); unregistered, it would silently attend to the padding. In fp32 the
    # two implementations are one computation, so their logits must be equal.
    register()
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        ours = tiny_model("llama", SDPA_FP32)(ids, attention_mask=mask).logits
        theirs = tiny_model("llama", "sdpa")(ids, attention_mask=mask).logits
        unmasked = tiny_model("llama", "sdpa")(ids).logits
    assert torch.equal(ours, theirs) and not torch.equal(ours[0, 2:], unmasked[0, 2:])
