"""Attention computed in fp32 for half-precision weights on the CPU (`forerun.attention`)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import forerun
from forerun.attention import (
    ROWS_FP32,
    ROWS_GROUPED,
    SDPA_FP32,
    SDPA_GROUPED,
    grouped_sdpa,
    pick_attention,
    register,
    row_starts,
    sdpa_in_fp32,
)
from forerun.attention_choice import half_attention_pays
from forerun.forward_inputs import cache_argument
from forerun.latency import curve_settings
from forerun.tree import tree_support

from tiny_models import register_grouped, tiny_model


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


def random_visibility(queries: int, cached: int, seed: int) -> torch.Tensor:
    """A tree's mask [1, 1, queries, cached]: the prefix and each query itself visible, earlier queries at random
    (so no two queries' rows are the same)."""
    generator = torch.Generator().manual_seed(seed)
    earlier = (torch.rand(queries, queries, generator=generator) < 0.5).tril(-1)
    visible = torch.ones(1, 1, queries, cached, dtype=torch.bool)
    visible[..., cached - queries :] = earlier | torch.eye(queries, dtype=torch.bool)
    return visible


@pytest.mark.parametrize("queries", [1, 2, 7, 32])
def test_grouped_heads_read_in_place_give_the_copies_output(queries):
    query, key, value = qkv(queries, torch.float32)
    mask = random_visibility(queries, 40, seed=queries)
    got, _ = grouped_sdpa(Grouped(), query, key, value, mask, scaling=0.125)
    copied, _ = sdpa_attention_forward(Grouped(), query, key, value, mask, scaling=0.125)
    assert got.shape == copied.shape == (1, queries, 9, 64)
    assert torch.allclose(got, copied, rtol=0, atol=1e-6)
    if queries > 1:  # the negative control: each query keeps its own mask row (rows shuffled change the output)
        shuffled, _ = grouped_sdpa(Grouped(), query, key, value, mask.roll(1, dims=2), scaling=0.125)
        assert not torch.allclose(shuffled, copied, rtol=0, atol=1e-3)


def padded_batch(dtype: torch.dtype, lengths=(1500, 300, 40), queries: int = 3):
    """A batch's query [rows, 9, q, 64], left-padded keys/values [rows, 3, longest + q, 64] and bool mask: row r
    sees its last `lengths[r]` cached keys and its queries causally."""
    generator = torch.Generator().manual_seed(1)
    rows, keys = len(lengths), max(lengths) + queries
    query = torch.randn(rows, 9, queries, 64, generator=generator).to(dtype)
    key, value = (torch.randn(rows, 3, keys, 64, generator=generator).to(dtype) for _ in range(2))
    mask = torch.zeros(rows, 1, queries, keys, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, :, :, keys - queries - length : keys - queries] = True
    mask[..., keys - queries :] = torch.ones(queries, queries, dtype=torch.bool).tril()
    return query, key, value, mask


@pytest.mark.parametrize(("by_rows", "alone", "dtype"), [(ROWS_GROUPED, grouped_sdpa, torch.float32),
                                                          (ROWS_FP32, sdpa_in_fp32, torch.bfloat16)])  # fmt: skip
def test_a_batch_with_wide_padding_is_attended_row_by_row_as_each_row_alone(by_rows, alone, dtype):
    query, key, value, mask = padded_batch(dtype)
    assert row_starts(mask, 3) == [0, 1200, 1460]
    got, _ = by_rows(Grouped(), query, key, value, mask, scaling=0.125)
    for row, start in enumerate([0, 1200, 1460]):
        part = (query[row : row + 1], key[row : row + 1, :, start:], value[row : row + 1, :, start:])
        single, _ = alone(Grouped(), *part, mask[row : row + 1, :, :, start:].contiguous(), scaling=0.125)
        assert torch.equal(got[row : row + 1], single), row
    padded, _ = alone(Grouped(), query, key, value, mask, scaling=0.125)
    assert got.shape == padded.shape and torch.allclose(got.float(), padded.float(), rtol=0, atol=1e-2)
    # The negative control: starting a row one visible key late is another attention.
    late, _ = alone(Grouped(), *(t[1:2] for t in (query, key[..., 1201:, :], value[..., 1201:, :])),
                    mask[1:2, ..., 1201:], scaling=0.125)  # fmt: skip
    assert not torch.equal(got[1:2], late)


def test_narrow_padding_single_rows_and_float_masks_are_attended_as_they_are():
    query, key, value, mask = padded_batch(torch.float32, lengths=(300, 250, 280))
    assert row_starts(mask, 3) is None  # 70 keys skipped: less than the extra calls cost
    got, _ = ROWS_GROUPED(Grouped(), query, key, value, mask, scaling=0.125)
    assert torch.equal(got, grouped_sdpa(Grouped(), query, key, value, mask, scaling=0.125)[0])
    _, _, _, wide = padded_batch(torch.float32)
    assert row_starts(wide[:1], 1) is None and row_starts(wide.float(), 3) is None and row_starts(None, 3) is None


def test_grouped_attention_hands_what_it_does_not_fold_to_transformers():
    query, key, value = qkv(4, torch.float32)
    got, _ = grouped_sdpa(Grouped(), query, key, value, None)  # unmasked: sdpa's own grouped kernel
    assert torch.equal(got, sdpa_attention_forward(Grouped(), query, key, value, None)[0])
    per_head = torch.ones(1, 9, 4, 40, dtype=torch.bool)  # a mask per head is not repeated per group
    got, _ = grouped_sdpa(Grouped(), query, key, value, per_head)
    assert torch.equal(got, sdpa_attention_forward(Grouped(), query, key, value, per_head)[0])


def test_auto_picks_fp32_attention_for_half_precision_on_the_cpu_only():
    assert pick_attention("auto", "cpu", torch.bfloat16) == SDPA_FP32
    assert pick_attention("auto", "cpu", torch.float16) == SDPA_FP32
    assert pick_attention("auto", "cpu", torch.float32) == SDPA_GROUPED
    assert pick_attention("auto", "cuda", torch.bfloat16) == SDPA_GROUPED
    assert pick_attention("sdpa", "cpu", torch.float32) == "sdpa"
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
        cache = DynamicCache(config=model.config)
        model(ids[:, :6], use_cache=True, **{cache_argument(model): cache})
        causal = torch.ones(1, 1, 4, 10, dtype=torch.bool).tril(6)
        alone = causal.clone()
        alone[..., 6:] = torch.eye(4, dtype=torch.bool)
        positions = torch.arange(6, 10)[None]
        a = model(ids[:, 6:], **{cache_argument(model): cache}, attention_mask=causal, position_ids=positions).logits
        cache.crop(-4)
        b = model(ids[:, 6:], **{cache_argument(model): cache}, attention_mask=alone, position_ids=positions).logits
    assert torch.equal(a[0, 0], b[0, 0]) and not torch.equal(a[0, 1:], b[0, 1:])


@pytest.mark.real_model
def test_the_real_model_attends_in_bf16_as_this_cpu_measured():
    model, _ = forerun.load_model("smollm2-135m", dtype="bf16")
    half = half_attention_pays(model.config, torch.bfloat16)  # the answer load_model read (or measured)
    assert model.config._attn_implementation == (SDPA_GROUPED if half else SDPA_FP32)


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


def test_a_tree_forward_of_a_grouped_model_reads_the_cache_without_copies(monkeypatch):
    model = tiny_model("llama", register_grouped())  # 4 query heads over 2 key/value heads
    calls = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append((query.shape[1], key.shape[1], kwargs.get("attn_mask") is not None))
        return kernel(query, key, value, **kwargs)

    ids = torch.arange(3, 13)[None]
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids[:, :6], use_cache=True, **{cache_argument(model): cache})
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        visible = torch.ones(1, 1, 4, 10, dtype=torch.bool).tril(6)
        model(
            ids[:, 6:], **{cache_argument(model): cache}, attention_mask=visible, position_ids=torch.arange(6, 10)[None]
        )
    assert calls == [(2, 2, True)] * 2  # per layer: one call on the 2 shared heads, the 4 queries' heads folded


def test_grouped_attention_compiles_without_a_graph_break():
    # A compiled static cache (inductor on the CPU, CUDA graphs on a card) traces the attention whole.
    query, key, value = qkv(1, torch.float32)
    mask = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    compiled = torch.compile(lambda q, k, v, m: grouped_sdpa(Grouped(), q, k, v, m)[0], fullgraph=True)
    eager, _ = grouped_sdpa(Grouped(), query, key, value, mask)
    assert torch.allclose(compiled(query, key, value, mask), eager, rtol=0, atol=1e-6)
