"""A prompt's own tokens scored (`forerun.scoring`, the server's `echo` with `logprobs`): one chunk is exactly the
log-softmax of one forward of the whole prompt; chunks on a growing cache equal it up to float rounding, in families
with attention caches and with recurrent states; a text the model wrote greedily scores as every step's argmax."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import forerun
from forerun.logprobs import TokenLogprob
from forerun.prefixcache import PrefixCache
from forerun.scoring import continuation_logprob, score_prompt, scoring

from tiny_models import COMMON, STATE_SPACE_FAMILIES, prompts, tiny_model

FAMILIES = ("llama", "qwen3", "gemma2", "gpt2", "granite", "mixtral", "qwen3_5_text", "lfm2", "mamba2")
"""Attention caches (gemma2 with its logit softcap, granite with its logit scale), a mixture of experts, and three
hybrids or state-space models whose caches carry recurrent states across chunks."""


def model_of(family: str) -> torch.nn.Module:
    if family in STATE_SPACE_FAMILIES:  # no attention: built without an attention setting
        torch.manual_seed(0)
        config = AutoConfig.for_model(family, **COMMON, **STATE_SPACE_FAMILIES[family])
        return AutoModelForCausalLM.from_config(config).eval()
    return tiny_model(family, "eager")


def reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log-softmax of one forward of the whole prompt: [L - 1, vocab], row i choosing token i + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_chunk_is_one_forwards_log_softmax_and_chunks_equal_it(family):
    model = model_of(family)
    ids = prompts(1, length=40, seed=3)[0]
    expected = reference(model, ids)
    chosen = expected.gather(1, ids[0, 1:, None])[:, 0]
    whole = score_prompt(model, ids, top=3, chunk=None)
    assert whole[0] is None and [e.token for e in whole[1:]] == ids[0, 1:].tolist()
    assert [e.logprob for e in whole[1:]] == chosen.tolist()
    best = expected.topk(3, dim=-1)
    assert [list(e.top) for e in whole[1:]] == [
        list(zip(i, v, strict=True)) for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)
    ]
    for chunk in (1, 7, 39, 40, 512):
        pieces = score_prompt(model, ids, top=3, chunk=chunk)
        assert pieces[0] is None and [e.token for e in pieces[1:]] == ids[0, 1:].tolist()
        got = torch.tensor([e.logprob for e in pieces[1:]])
        torch.testing.assert_close(got, chosen, rtol=0, atol=2e-5, msg=f"{family}, chunks of {chunk}")


def test_scoring_yields_once_per_chunk_and_refuses_bad_arguments():
    model = tiny_model("llama", "sdpa")
    ids = prompts(1, length=10)[0]
    pieces = scoring(model, ids, chunk=4)
    assert [next(pieces), next(pieces), next(pieces), next(pieces)] == [0, 4, 8, 10]
    with pytest.raises(StopIteration) as done:
        next(pieces)
    assert len(done.value.value) == 10
    for bad in ({"chunk": 0}, {"top": -1}, {"top": True}):
        with pytest.raises(ValueError, match="chunk|top"):
            score_prompt(model, ids, **bad)
    with pytest.raises(ValueError, match="one non-empty prompt"):
        score_prompt(model, ids[:, :0])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_greedy_continuation_scores_as_every_steps_likeliest_token(family):
    model = tiny_model(family, "sdpa")
    decoder = forerun.Decoder(model, None, method="auto")
    prompt = prompts(1, length=16, seed=5)[0]
    result = decoder.generate(prompt, 24, eos_token_id=[])
    whole = result.sequences
    entries = decoder.score(whole, top=1)
    total, greedy = continuation_logprob(entries, prompt.shape[1])
    assert greedy and total <= 0
    expected = reference(model, whole)
    assert total == pytest.approx(float(expected[15:].gather(1, whole[0, 16:, None]).sum()), abs=1e-4)
    # the same continuation after another token: no longer every step's likeliest (the negative control)
    changed = whole.clone()
    changed[0, 20] = (changed[0, 20] + 1) % model.config.vocab_size
    assert not continuation_logprob(decoder.score(changed, top=1), prompt.shape[1])[1]


def counting(model: torch.nn.Module) -> list[int]:
    """The token count of every forward `model` runs from now on."""
    fed: list[int] = []
    model.register_forward_pre_hook(lambda _, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    return fed


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_a_head_scored_before_is_read_from_the_prefix_cache_and_scores_alike(family):
    """Four answers to one question score the question once: the second prompt reads the head it shares with the
    first (its keys, values and entries) and feeds the rest from the head's last token; its entries equal a fresh
    scoring's up to rounding, the head's are the first prompt's own. A salt's view, or more alternatives than
    were kept, reads nothing."""
    model = tiny_model(family, "eager")
    context = prompts(1, length=30, seed=1)[0]
    first = torch.cat([context, torch.tensor([[5, 6, 7, 8, 9, 10]])], dim=1)
    second = torch.cat([context, torch.tensor([[11, 12, 13, 14, 15, 16]])], dim=1)
    cache = PrefixCache(4096)
    kept = score_prompt(model, first, top=2, chunk=8, keep=cache)
    fed = counting(model)
    again = score_prompt(model, second, top=1, chunk=8, keep=cache)
    assert sum(fed) == second.shape[1] - 29  # 30 shared tokens: 29 read, the 30th fed again to score the 31st
    fresh = score_prompt(model, second, top=1, chunk=None)
    assert [e.token for e in again[1:]] == [e.token for e in fresh[1:]]
    assert [e.top[0][0] for e in again[1:]] == [e.top[0][0] for e in fresh[1:]]
    got, want = (torch.tensor([e.logprob for e in entries[1:]]) for entries in (again, fresh))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert again[1:30] == [TokenLogprob(e.token, e.logprob, e.top[:1]) for e in kept[1:30]]
    for view, top in ((cache, 3), (cache.scoped("tenant"), 1)):
        fed.clear()
        score_prompt(model, second, top=top, chunk=8, keep=view)
        assert sum(fed) == second.shape[1]


def test_a_sliding_window_or_recurrent_cache_keeps_no_scored_head():
    for family in ("mistral", "qwen3_5_text"):
        model = tiny_model(family, "eager")
        ids = prompts(1, length=20, seed=2)[0]
        cache = PrefixCache(4096)
        score_prompt(model, ids, top=1, keep=cache)
        assert cache.entries == []
        fed = counting(model)
        assert score_prompt(model, ids, top=1, chunk=None, keep=cache)[1:] == score_prompt(model, ids, top=1)[1:]
        assert sum(fed) == 2 * ids.shape[1]
