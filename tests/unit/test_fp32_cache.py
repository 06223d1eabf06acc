"""A half-precision model that attends in fp32 on the CPU (`attention.SDPA_FP32`) keeps its growing cache in fp32
(`kvcache.RoomyLayer(upcast=True)`): the attention no longer casts every cached entry up every forward, and it
computes the very numbers it computed before, in every family; a prefix cache keeps the model's own precision."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from forerun.attention import SDPA_FP32, register
from forerun.kvcache import RoomyLayer, keep_accepted, roomy_cache
from forerun.prefixcache import PrefixCache

from tiny_models import FAMILIES, MORE_FAMILIES, NO_SDPA, STATEFUL_FAMILIES, tiny_model

IDS = torch.tensor([[3, 17, 42, 9, 88, 5, 61, 2, 14, 33]])


def half_model(family: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    register()
    return tiny_model(family, SDPA_FP32).to(dtype)


@torch.inference_mode()
def prompt_then_steps(model: torch.nn.Module, cache: DynamicCache) -> list[torch.Tensor]:
    """Logits of the prompt's first 5 tokens, then 3 fed together, then 2 one at a time, all on `cache`."""
    chunks = [IDS[:, :5], IDS[:, 5:8], IDS[:, 8:9], IDS[:, 9:10]]
    return [model(chunk, cache=cache, use_cache=True).logits for chunk in chunks]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_family_computes_the_same_logits_on_an_fp32_cache(dtype):
    families = sorted((FAMILIES | MORE_FAMILIES | STATEFUL_FAMILIES).keys() - NO_SDPA)
    upcast = []
    for family in families:
        model = half_model(family, dtype)
        ours, theirs = roomy_cache(model.config), DynamicCache(config=model.config)
        got, expected = prompt_then_steps(model, ours), prompt_then_steps(model, theirs)
        for step, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(a, b), (family, step)
        if any(layer.keys.dtype == torch.float32 for layer in ours.layers if isinstance(layer, RoomyLayer)):
            upcast.append(family)
    # the cache was kept in fp32 where it could be (a test of nothing would pass too): most families' layers are
    # full-attention ones; sliding-window layers stay as transformers makes them, and so do latents that a layer
    # expands after the cache (in fp32 they failed in the expanding layer)
    assert {"llama", "qwen2", "qwen3", "gemma", "granite", "gpt2"} <= set(upcast), upcast
    assert not {"deepseek_v3", "glm4_moe_lite"} & set(upcast)
    assert len(upcast) >= len(families) // 2, (len(upcast), len(families))


def test_only_fp32_attention_of_half_precision_keeps_fp32():
    register()
    for implementation, dtype, kept in (
        (SDPA_FP32, torch.bfloat16, torch.float32),
        ("sdpa", torch.bfloat16, torch.bfloat16),  # its kernel reads the cache in the model's dtype
        (SDPA_FP32, torch.float32, torch.float32),
    ):
        model = tiny_model("llama", implementation).to(dtype)
        cache = roomy_cache(model.config)
        prompt_then_steps(model, cache)
        assert {layer.keys.dtype for layer in cache.layers} == {kept}, (implementation, dtype)
        assert {layer.values.dtype for layer in cache.layers} == {kept}, (implementation, dtype)


@torch.inference_mode()
def test_an_accepted_path_is_kept_on_an_fp32_cache_as_on_the_models_own():
    model = half_model("llama")
    caches = [roomy_cache(model.config), DynamicCache(config=model.config)]
    for cache in caches:
        model(IDS[:, :6], cache=cache, use_cache=True)
        keep_accepted(cache, 2, [0, 2, 3])  # a tree of the last 4 tokens, its second branch accepted
    ours, theirs = caches
    for mine, their in zip(ours.layers, theirs.layers, strict=True):
        assert mine.keys.dtype == torch.float32 and torch.equal(mine.keys, their.keys.float())
        assert torch.equal(mine.values, their.values.float())
    nxt = IDS[:, 6:7]
    positions = torch.tensor([[5]])
    got, expected = (model(nxt, cache=c, position_ids=positions, use_cache=True).logits for c in caches)
    assert torch.equal(got, expected)


@torch.inference_mode()
def test_a_prefix_cache_keeps_the_models_precision_and_seeds_an_fp32_cache():
    model = half_model("llama")
    source = roomy_cache(model.config)
    model(IDS, cache=source, use_cache=True)
    prefixes = PrefixCache(max_tokens=100)
    tokens = IDS[0].tolist()
    prefixes.store(tokens, source, len(tokens))
    entry, length = prefixes.find(tokens + [7])
    assert entry is not None and length == len(tokens)
    assert {keys.dtype for keys in entry.keys} == {torch.bfloat16}  # half the memory of what the cache holds
    seeded = roomy_cache(model.config)
    assert prefixes.seed(seeded, tokens + [7]) == len(tokens)
    for mine, theirs in zip(seeded.layers, source.layers, strict=True):
        assert mine.keys.dtype == torch.float32 and torch.equal(mine.keys, theirs.keys)
        assert torch.equal(mine.values, theirs.values)
