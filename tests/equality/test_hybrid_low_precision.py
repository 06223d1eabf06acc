"""Hybrids in bf16 and with 4-bit weights: every first difference from plain generate of the same model sits on a
numerical tie (`forerun.exactness`), alone (chains) and in batches. A model whose chains or batch rows are computed
another way (RecurrentGemma: 4e-2 of the logits' spread, below the tolerance of a feed in low precision) is found by
the probes' closer tolerance for states, and decodes one token per forward, its rows one after another; with the
feeds' tolerance it wrote other text past ties (the negative control)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_hybrid_batches import state_space
from test_low_precision import reference

import forerun
from forerun.base.chain import chain_support
from forerun.base.weights import quantize_weights, weights_kind
from forerun.costmodel import LatencyCurve
from forerun.exactness import first_divergence
from forerun.feed_probe import TOLERANCE
from forerun.rowstates import state_rows_support

from tiny_models import STATE_SPACE_FAMILIES, STATEFUL_FAMILIES, prompts, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))
NEW_TOKENS = 30


@functools.lru_cache(maxsize=4)
def low(family: str, dtype: str) -> torch.nn.Module:
    model = (state_space(family) if family in STATE_SPACE_FAMILIES else tiny_model(family)).to(torch.bfloat16)
    if dtype == "int4":
        quantize_weights(model, "int4")  # in place
    return model


def texts() -> list[torch.Tensor]:
    """Three prompts that repeat their own head: prompt lookup finds guesses, so chains are fed."""
    return [torch.cat([t, t[:, :10]], dim=1) for t in (prompts(1, 20 + 5 * i, seed=i)[0] for i in range(3))]


def divergences(model: torch.nn.Module, decoder: forerun.Decoder) -> list:
    """Each text's first difference from plain generate (None: none), alone and then in one batch."""
    results = [decoder.generate(text, NEW_TOKENS, eos_token_id=[]) for text in texts()]
    results += decoder.generate(texts(), NEW_TOKENS, eos_token_id=[])
    found = []
    for text, result in zip(texts() * 2, results, strict=True):
        expected, logits = reference(model, text, NEW_TOKENS)
        found.append(first_divergence(expected, result.new_tokens, logits, model.dtype))
    return found


@pytest.mark.parametrize("family", sorted(STATEFUL_FAMILIES) + sorted(STATE_SPACE_FAMILIES))
def test_a_hybrid_in_bf16_differs_from_generate_only_at_ties(family):
    """Every chain but RecurrentGemma's is verified, its tokens fed as steps and their states recorded (Falcon-Mamba's
    chains, scanned at once, had differed by 0.17 of the spread and it decoded one token per forward)."""
    model = low(family, "bf16")
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    found = divergences(model, decoder)
    assert all(d is None or d.is_tie for d in found), found
    assert (decoder.fallback_reason is None) == (family != "recurrent_gemma")


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "lfm2", "recurrent_gemma"])
def test_a_hybrid_with_4_bit_weights_differs_from_generate_only_at_ties(family):
    model = low(family, "int4")
    assert weights_kind(model) == "int4"
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    assert all(d is None or d.is_tie for d in divergences(model, decoder))


def test_recurrent_gemmas_chains_in_bf16_are_found_and_were_not_ties_with_the_feeds_tolerance(monkeypatch):
    model = low("recurrent_gemma", "bf16")
    assert "other logits" in chain_support(model) and "other logits" in state_rows_support(model)
    monkeypatch.setitem(TOLERANCE, "rounded states", TOLERANCE["rounded"])
    assert chain_support(model) is None  # what the feeds' tolerance let through
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    found = divergences(model, decoder)
    assert any(d is not None and not d.is_tie for d in found), found
