"""More model families: `auto` alone and a batch of three equal plain greedy `model.generate`, eager and sdpa, on
the growing cache and on the static one (a card's default).

(The methods one by one, sampling and the rest run on the families of `tiny_models.FAMILIES`.)"""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.costmodel import LatencyCurve

from tiny_models import MORE_FAMILIES, NO_SDPA, prompts, tiny_model

CASES = [(f, impl) for f in MORE_FAMILIES for impl in ("eager", "sdpa") if not (impl == "sdpa" and f in NO_SDPA)]
CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))
"""A flat curve: the cost model feeds trees often."""


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(("family", "impl"), CASES)
def test_auto_alone_and_batched_equals_generate(family, impl, static):
    model = tiny_model(family, impl)
    texts = prompts(3, length=30)
    expected = [model.generate(p, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0) for p in texts]
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, static_cache=static)
    alone = [decoder.generate(p, 40, eos_token_id=[]) for p in texts]
    assert all(torch.equal(r.sequences, want) for r, want in zip(alone, expected, strict=True))
    assert all(r.stats.fallback_reason is None for r in alone)
    assert sum(r.stats.new_tokens for r in alone) > 1.2 * sum(r.stats.forwards for r in alone)  # drafts accepted
    batched = decoder.generate(texts, 40, eos_token_id=[])
    assert all(torch.equal(r.sequences, want) for r, want in zip(batched, expected, strict=True))
