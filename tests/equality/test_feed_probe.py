"""Models of families forerun's tests do not cover are probed once per Decoder: where forerun's feed gives other
logits than the model's own forward a step at a time, the Decoder refuses by name instead of writing other text than
generate; where only a tree's do, it decodes one token per forward and a batch's rows one after another."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Cache, LlamaConfig, LlamaForCausalLM

import forerun
from forerun.costmodel import LatencyCurve
from forerun.feed_probe import TESTED_FAMILIES

from tiny_models import COMMON, FAMILIES, LLAMA_LIKE, MORE_FAMILIES, STATE_SPACE_FAMILIES, STATEFUL_FAMILIES, prompts

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))


def built(family: str, **settings) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **COMMON, **settings)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def plain(model, prompt, new_tokens=24):
    return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_the_tested_families_are_the_ones_the_tests_decode():
    tested = set(FAMILIES) | set(MORE_FAMILIES) | set(STATEFUL_FAMILIES) | set(STATE_SPACE_FAMILIES)
    assert TESTED_FAMILIES == tested | {"bloom", "mpt", "trocr"}


@pytest.mark.parametrize("family", ["helium", "internlm3", "hunyuan_v1_dense"])
def test_an_untested_family_that_takes_the_feed_decodes_exactly(family):
    model = built(family, **LLAMA_LIKE, head_dim=16)
    assert model.config.model_type not in TESTED_FAMILIES
    decoder = forerun.Decoder(model, None, "prompt_lookup+jacobi", latency=CURVE)
    for text in prompts(2):
        result = decoder.generate(text, 24, eos_token_id=[])
        assert torch.equal(result.sequences, plain(model, text))
    assert result.stats.new_tokens > result.stats.forwards  # it drafts


def test_a_model_with_positions_and_segments_of_its_own_is_refused():
    """CPM-Ant takes a cache but builds positions and segments of its own around it: fed a step at a time it
    wrote other text than generate from the second token."""
    model = built("cpmant", **LLAMA_LIKE)
    with pytest.raises(ValueError, match=r"CpmAntForCausalLM \(cpmant\) gives other logits when fed a step"):
        forerun.Decoder(model, None, "plain")


def test_an_encoder_loaded_without_is_decoder_is_refused():
    """BERT as a causal LM without is_decoder=True attends both ways: its logits at a token depend on later ones,
    which no cached feed reproduces (transformers only warns)."""
    model = built("megatron-bert", **LLAMA_LIKE)
    with pytest.raises(ValueError, match="MegatronBertForCausalLM .* fed a step at a time"):
        forerun.Decoder(model, None, "auto")
    decoder = forerun.Decoder(built("megatron-bert", **LLAMA_LIKE, is_decoder=True), None, "auto", latency=CURVE)
    text = prompts(1)[0]
    assert torch.equal(decoder.generate(text, 24, eos_token_id=[]).sequences, plain(decoder.model, text))


class OwnPositionsConfig(LlamaConfig):
    model_type = "own_positions_llama"


class OwnPositionsLlama(LlamaForCausalLM):
    """Takes position_ids but places tokens by the cache's length (as TrOCR does): chains are right, trees not."""

    config_class = OwnPositionsConfig

    def forward(self, input_ids=None, position_ids=None, cache: Cache | None = None, **kwargs):
        return super().forward(input_ids=input_ids, cache=cache, **kwargs)


def test_a_model_that_misplaces_a_trees_nodes_decodes_one_token_per_forward(caplog):
    torch.manual_seed(0)
    model = OwnPositionsLlama(OwnPositionsConfig(**COMMON, **LLAMA_LIKE)).eval()
    with caplog.at_level(logging.WARNING, logger="forerun"):
        decoder = forerun.Decoder(model, None, "auto", latency=CURVE)
    assert "auto decodes one token per forward: OwnPositionsLlama (own_positions_llama) gives a tree" in caplog.text
    text = prompts(1)[0]
    want = plain(model, text)
    result = decoder.generate(text, 24, eos_token_id=[], prediction=want[0, 24:].tolist())  # not drafted either
    assert torch.equal(result.sequences, want)
    assert result.stats.forwards == 24 and "a tree's tokens other logits" in result.stats.fallback_reason


def test_a_model_that_misplaces_a_trees_nodes_decodes_a_batchs_rows_one_after_another():
    """Its positions come from the cache's length: in a shared cache, a shorter row's would be the longest's. The
    tokens of this random model hardly tell (its logits are nearly flat); the logprobs do (up to 1.4e-3 apart)."""
    torch.manual_seed(0)
    model = OwnPositionsLlama(OwnPositionsConfig(**COMMON, **LLAMA_LIKE)).eval()
    decoder = forerun.Decoder(model, None, "plain")
    assert not decoder.batches
    texts = [prompts(1, 10)[0], prompts(1, 24, seed=1)[0]]
    together = decoder.generate(texts, 8, eos_token_id=[], logprobs=0)
    for text, row in zip(texts, together, strict=True):
        alone = decoder.generate(text, 8, eos_token_id=[], logprobs=0)
        assert torch.equal(row.sequences, alone.sequences)
        assert [t.logprob for t in row.logprobs] == pytest.approx([t.logprob for t in alone.logprobs], abs=1e-6)
