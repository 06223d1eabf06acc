"""Models outside forerun's cache contract: hybrids with recurrent states decode one token per forward, exactly,
alone, batched and through the drop-in; models keeping a state of their own are refused by name; a decoder that
takes no position ids verifies no trees."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import forerun
from forerun.costmodel import LatencyCurve
from forerun.forward_inputs import forward_parameters

from tiny_models import COMMON, STATEFUL_FAMILIES, prompts, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))
"""A flat curve: wherever trees can be verified, the cost model feeds them."""


def plain(model, prompt, new_tokens=24):
    return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("family", sorted(STATEFUL_FAMILIES))
def test_a_hybrid_with_recurrent_states_decodes_plainly_and_exactly(family):
    """Jamba, Bamba, Granite 4, Nemotron-H, Qwen3-Next, Qwen3.5, OLMo hybrid, RecurrentGemma: their recurrent
    states cannot step back to a rejected guess (transformers' assisted generation refuses them too). forerun
    raised while building the Decoder (timing forwards crops the cache) or at the first commit; now `auto` (its
    default, no latency curve given) decodes one token per forward and says why."""
    model = tiny_model(family)
    texts = prompts(3, length=24)
    expected = [plain(model, p) for p in texts]
    decoder = forerun.Decoder(model, None, "auto", latency_cache=None)
    result = decoder.generate(texts[0], 24, eos_token_id=[])
    assert torch.equal(result.sequences, expected[0])
    assert type(model).__name__ in result.stats.fallback_reason and "recurrent" in result.stats.fallback_reason
    assert result.stats.forwards == 24
    batch = decoder.generate(texts, 24, eos_token_id=[])
    assert all(torch.equal(r.sequences, want) for r, want in zip(batch, expected, strict=True))
    dropin = model.generate(
        texts[1], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
        custom_generate=forerun.hf_generate,
    )  # fmt: skip
    assert torch.equal(dropin, expected[1])


OWN_STATE = {
    "mamba": (dict(hidden_size=64, num_hidden_layers=2, state_size=8), "cache_params"),
    "rwkv": (dict(hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, context_length=512), "state"),
}


@pytest.mark.parametrize("family", sorted(OWN_STATE))
def test_a_model_keeping_a_state_of_its_own_is_refused_by_name(family):
    """Mamba keeps its state in `cache_params`, RWKV in `state`: forerun passed its cache as `past_key_values`,
    which their forwards ignore, so every step saw only its own tokens (other text than generate, silently)."""
    settings, own = OWN_STATE[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **COMMON, **settings)).eval()
    for make in (
        lambda: forerun.Decoder(model, None, "plain"),
        lambda: model.generate(prompts(1)[0], max_new_tokens=4, custom_generate=forerun.hf_generate),
    ):
        with pytest.raises(ValueError, match=rf"{type(model).__name__}\.forward takes no past_key_values.*`{own}`"):
            make()


def test_a_stateful_draft_model_is_refused_by_name():
    target, draft = tiny_model("llama"), tiny_model("jamba")
    with pytest.raises(ValueError, match="draft model JambaForCausalLM keeps recurrent states"):
        forerun.Decoder(target, None, "draft_model", draft_model=draft)


def test_a_decoder_counting_positions_from_its_cache_verifies_no_trees():
    """TrOCR's decoder takes no position ids: it places each token fed at the cache's length, so a tree's second
    branch was placed one further than its depth (its logits off by about the spread of the logits)."""
    config = AutoConfig.for_model("trocr", **COMMON, d_model=64, decoder_layers=2, decoder_attention_heads=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    texts = prompts(2, length=24)
    decoder = forerun.Decoder(model, None, "prompt_lookup+jacobi", latency=CURVE)
    for text in texts:
        result = decoder.generate(text, 24, eos_token_id=[])
        assert torch.equal(result.sequences, plain(model, text))
        assert "TrOCRForCausalLM.forward takes no position_ids" in result.stats.fallback_reason


def test_wrappers_are_read_through_to_the_model_they_hold():
    """A PEFT model forwards `*args, **kwargs` to the model it wraps (`get_base_model`), as `torch.compile`'s
    module does to `_orig_mod`: the wrapped model's arguments are the ones read."""
    model = tiny_model("llama")

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_base_model(self):
            return self.inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    assert {"past_key_values", "position_ids"} <= forward_parameters(Wrapper(model))
    assert forward_parameters(torch.compile(model)) == forward_parameters(model)
    bare = torch.nn.Module()
    bare.forward = lambda *args, **kwargs: None
    assert forward_parameters(bare) is None


def test_the_reason_is_told_once_per_decoder_not_per_request(caplog):
    """A server on a hybrid model had logged the same warning for every request."""
    model = tiny_model("qwen3_5_text")
    with caplog.at_level("WARNING", logger="forerun"):
        decoder = forerun.Decoder(model, None, "auto", latency_cache=None)
        built = [record.getMessage() for record in caplog.records if record.name.startswith("forerun")]
        caplog.clear()
        for text in prompts(3):
            decoder.generate(text, 8, eos_token_id=[])
        decoder.generate(prompts(2), 8, eos_token_id=[])
    assert len(built) == 1 and "auto decodes one token per forward" in built[0] and "Qwen3_5ForCausalLM" in built[0]
    assert [record.getMessage() for record in caplog.records if record.name.startswith("forerun")] == []
