"""Contracts of the edges: models forerun cannot verify trees on fall back to plain decoding (reason named, text
identical); the KV cache keeps exactly the accepted path."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import forerun
from forerun.costmodel import LatencyCurve
from forerun.kvcache import keep_accepted

from tiny_models import COMMON, FAMILIES, prompts, tiny_model

CURVE = LatencyCurve((1, 8, 32), (1.0, 1.1, 1.5))


def plain(model, prompt, new_tokens=40):
    return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("method", ["prompt_lookup", "auto"])
def test_an_attention_that_takes_no_tree_mask_falls_back_with_the_reason(method):
    # A user's own kernel, registered through transformers' public AttentionInterface: forerun cannot know that it
    # honours a 4-D tree mask, so it decodes plainly. (flex_attention was the example here until it returned NaN
    # logits now and then on an AVX2 CPU, in plain generate as well.)
    AttentionInterface.register("users_own_attention", sdpa_attention_forward)
    model = tiny_model("llama", "users_own_attention")
    prompt = prompts(1)[0]
    result = forerun.Decoder(model, None, method, latency=CURVE).generate(prompt, 40, eos_token_id=[])
    assert torch.equal(result.sequences, plain(model, prompt))
    reason = result.stats.fallback_reason
    assert "LlamaForCausalLM" in reason and "users_own_attention" in reason and "eager" in reason
    assert result.stats.forwards == 40  # plain decoding: one token per forward


def test_flash_attention_is_refused_by_name_before_any_forward():
    from forerun.engine import tree_support

    model = tiny_model("qwen2")
    model.config._attn_implementation = "flash_attention_2"  # what a CUDA user loads; only the config is read
    reason = tree_support(model)
    assert "Qwen2ForCausalLM" in reason and "flash_attention_2" in reason


def test_a_sliding_window_shorter_than_the_text_falls_back():
    config = AutoConfig.for_model("mistral", **COMMON, **{**FAMILIES["mistral"], "sliding_window": 16})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    prompt = prompts(1)[0]
    result = forerun.Decoder(model, None, "auto", latency=CURVE).generate(prompt, 40, eos_token_id=[])
    assert torch.equal(result.sequences, plain(model, prompt))
    reason = result.stats.fallback_reason
    assert "MistralForCausalLM" in reason and "sliding window of 16 tokens" in reason


ALIBI = {
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4),
    "falcon": {**FAMILIES["falcon"], "alibi": True},  # falcon-rw
    "mpt": dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=512),  # ALiBi by default
}


@pytest.mark.parametrize("family", sorted(ALIBI))
def test_alibi_models_fall_back_alone_batched_and_through_the_dropin(family):
    """Bloom, MPT and Falcon with ALiBi build their position biases from where keys sit, not from position ids:
    a tree's 4-D mask raised inside Bloom's and Falcon's forward (already while measuring the latency curve), and
    MPT's trees gave other tokens than generate. They decode plainly, exactly."""
    config = AutoConfig.for_model(family, **COMMON, **ALIBI[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    texts = prompts(3)
    decoder = forerun.Decoder(model, None, "auto")
    result = decoder.generate(texts[0], 40, eos_token_id=[])
    assert torch.equal(result.sequences, plain(model, texts[0]))
    assert "ALiBi" in result.stats.fallback_reason and type(model).__name__ in result.stats.fallback_reason
    batch = decoder.generate(texts, 40, eos_token_id=[])
    assert all(torch.equal(r.sequences, plain(model, p)) for r, p in zip(batch, texts, strict=True))
    dropin = model.generate(
        texts[1],
        max_new_tokens=40,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        custom_generate=forerun.hf_generate,
    )
    assert torch.equal(dropin, plain(model, texts[1]))


def test_keep_accepted_on_a_hand_worked_example():
    """Prefix p0 p1, tree n0..n4 in the cache; the accepted path is nodes [0, 3, 4]: the cache becomes
    p0 p1 n0 n3 n4 in every layer, keys and values alike."""
    cache = DynamicCache()
    seq = torch.arange(7, dtype=torch.float32)  # positions: p0 p1 n0 n1 n2 n3 n4
    for layer in range(2):
        keys = (seq + 100 * layer).view(1, 1, 7, 1).expand(1, 2, 7, 3).contiguous()
        cache.update(keys, -keys, layer)
    keep_accepted(cache, prefix_len=2, kept_nodes=[0, 3, 4])
    for layer in range(2):
        kept = cache.layers[layer].keys[0, 0, :, 0].tolist()
        assert kept == [100 * layer + x for x in (0, 1, 2, 5, 6)]
        assert torch.equal(cache.layers[layer].values, -cache.layers[layer].keys)
    assert cache.get_seq_length() == 5
    keep_accepted(cache, prefix_len=3, kept_nodes=[0, 1])  # a contiguous path: a plain truncation
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 5, 6]
