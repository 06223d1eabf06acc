"""Exact equality with plain greedy `model.generate` for every method, family and attention implementation."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteriaList

import forerun
from forerun import head as head_module
from forerun.batch import Batch, RowJob
from forerun.costmodel import LatencyCurve
from forerun.transcript import Transcript

from helpers import OracleDrafter, RandomDrafter
from tiny_models import FAMILIES, GROUPED, NO_SDPA, VOCAB, prompts, register_grouped, tiny_model

CASES = [(f, impl) for f in FAMILIES for impl in ("eager", "sdpa") if not (impl == "sdpa" and f in NO_SDPA)]
CASES += [(f, register_grouped()) for f in GROUPED if f not in NO_SDPA]  # grouped heads read in place
NEW_TOKENS = 40
METHOD_KNOBS = {
    "plain": {},
    "prompt_lookup": {"max_ngram": 2, "draft_len": 5, "max_branches": 2},
    "jacobi": {"window": 3, "ngram": 3, "max_candidates": 3},
    "trie": {"decoding_length": 8, "branch_length": 4},
    "auto": {},
    "prompt_lookup+trie": {"prompt_lookup.draft_len": 5, "trie.decoding_length": 8},
    "jacobi+trie": {"jacobi.window": 2, "jacobi.ngram": 3},
}
CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))
"""This CPU's bf16 shape: the cost model feeds trees often, and the root alone when drafts look poor."""


@functools.lru_cache(maxsize=4)
def model_of(family: str, impl: str) -> torch.nn.Module:
    return tiny_model(family, impl)


@functools.lru_cache(maxsize=64)
def reference(family: str, impl: str, index: int, eos: int | None) -> torch.Tensor:
    model = model_of(family, impl)
    prompt = prompts(3)[index]
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0)


def eos_inside(family: str, impl: str, index: int) -> int:
    """A token that plain greedy produces about half-way, used as EOS so the run stops early."""
    return int(reference(family, impl, index, None)[0, prompts(3)[index].shape[1] + NEW_TOKENS // 2])


@pytest.mark.parametrize("method", list(METHOD_KNOBS))
@pytest.mark.parametrize(("family", "impl"), CASES)
def test_greedy_equals_generate(family, impl, method):
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, method, latency=CURVE, **METHOD_KNOBS[method])
    for index, prompt in enumerate(prompts(3)):
        # EOS disabled: long runs.
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(family, impl, index, None)), (
            family,
            impl,
            method,
            index,
        )
        assert result.stats.fallback_reason is None
        # EOS enabled: stops exactly where plain generate stops.
        eos = eos_inside(family, impl, index)
        expected = reference(family, impl, index, eos)
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=eos)
        assert torch.equal(result.sequences, expected), (family, impl, method, index, "eos")
        assert result.sequences.shape[1] < prompt.shape[1] + NEW_TOKENS


TALL_CASES = [("llama", "sdpa"), ("gpt2", "eager"), ("qwen3", "sdpa"), ("phi3", "eager")]


@pytest.mark.parametrize("method", ["plain", "prompt_lookup", "auto"])
@pytest.mark.parametrize(("family", "impl"), TALL_CASES)
def test_greedy_equals_generate_with_the_output_matrix_tall_at_every_size(family, impl, method, monkeypatch):
    """As on a CPU where the tall product measured faster at every size (`forerun.head`: 1 to 16 positions, one
    position as its row written twice): single runs and a batch of rows still equal plain generate. Tiny output
    matrices measure F.linear faster, so the other tests here run the model's own call."""
    every = frozenset(range(1, head_module.TALL_MAX_POSITIONS + 1))
    monkeypatch.setattr(head_module, "tall_sizes_for", lambda weight, cache_dir=None: every)
    sizes = []
    product = head_module.tall_product
    monkeypatch.setattr(head_module, "tall_product", lambda w, flat: sizes.append(flat.shape[0]) or product(w, flat))
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, method, latency=CURVE, **METHOD_KNOBS[method])
    expected = [reference(family, impl, index, None) for index in range(3)]
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, expected[index]), (family, impl, method, index)
    # the product ran; undrafted steps are one position (`auto` pads every step to a cheaper size on this curve)
    assert sizes and (method == "auto" or 1 in sizes)
    rows = decoder.generate([p[0].tolist() for p in prompts(3)], NEW_TOKENS, eos_token_id=[])
    for index, row in enumerate(rows):
        assert torch.equal(row.sequences, expected[index]), (family, impl, method, index, "batched")
    assert method != "plain" or 3 in sizes  # undrafted: three rows of one position each, one product


@pytest.mark.parametrize("method", ["prompt_lookup", "jacobi", "trie", "auto"])
@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("gpt2", "eager"), ("qwen3", "sdpa")])
def test_separate_prefill_equals_generate(family, impl, method):
    """draft_in_prefill=False: generate's own prefill for the first token, then trees."""
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, method, draft_in_prefill=False, latency=CURVE, **METHOD_KNOBS[method])
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(family, impl, index, None)), (family, impl, method, index)


JACOBI_EDGES = [
    {"window": 1, "ngram": 2, "max_candidates": 1},
    {"window": 4, "ngram": 2, "max_candidates": 4, "pool_policy": "frequency"},
    {"window": 2, "ngram": 5, "max_candidates": 2, "pool_from_prompt": False},
    {"window": 7, "ngram": 5, "max_candidates": 7, "pool_from_output": False},  # lade's defaults
    {"window": 1, "ngram": 4, "max_candidates": 3, "lazy_window": True},  # the CPU defaults
    {"window": 3, "ngram": 3, "max_candidates": 2, "lazy_window": False, "pool_from_output": False},
]


@pytest.mark.parametrize(
    "knobs",
    JACOBI_EDGES,
    ids=lambda k: "W{window}N{ngram}G{max_candidates}".format(**k) + ("-lazy" if k.get("lazy_window") else ""),
)
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3", "gemma2"])
def test_jacobi_settings_equal_generate(family, knobs):
    impl = "eager" if family in NO_SDPA else "sdpa"
    decoder = forerun.Decoder(model_of(family, impl), None, "jacobi", adaptive=False, **knobs)  # as lade runs
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(family, impl, index, None)), (family, knobs, index)


@pytest.mark.parametrize("draft_in_prefill", [True, False])
@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon", "gpt_neox"])
def test_oracle_reaches_full_depth_every_step(family, draft_in_prefill):
    model = model_of(family, "eager")
    prompt = prompts(1)[0]
    truth = reference(family, "eager", 0, None)[0].tolist()
    depth = 5
    oracle = OracleDrafter(truth, depth, VOCAB)
    decoder = forerun.Decoder(model, None, "plain", drafters=[oracle], draft_in_prefill=draft_in_prefill)
    result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    # With draft_in_prefill the prefill forward is the first step (its draft verified with the prompt).
    steps = result.stats.forwards - (0 if draft_in_prefill else 1)
    # every step but the last accepts the whole oracle branch (depth) plus the bonus token
    assert result.stats.accepted_hist[depth] == steps - 1
    assert result.stats.accepted_by["oracle"] == result.stats.accepted
    assert result.stats.accepted_by.get("decoy", 0) == 0


@pytest.mark.parametrize(("length", "tree_in_prefill"), [(200, True), (300, False)])
def test_a_long_prompt_is_prefilled_causally_and_drafts_from_the_next_step(length, tree_in_prefill):
    """A lead over PREFILL_TREE_MAX_LEAD (256) tokens is read as generate reads it (a tree's mask would cost the
    whole prompt the causal kernel); the oracle's first branch is then verified at the next step. Alone and as a
    batch row that would draft at its prefill."""
    model = model_of("llama", "sdpa")
    prompt = prompts(1, length=length)[0]
    truth = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    truth = truth[0].tolist()
    decoder = forerun.Decoder(model, None, "plain", drafters=[OracleDrafter(truth, 5, VOCAB)])
    result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    steps = result.stats.forwards - (0 if tree_in_prefill else 1)
    assert result.stats.accepted_hist[5] == steps - 1  # every step but the last takes the whole branch
    criteria = StoppingCriteriaList([MaxLengthCriteria(length + NEW_TOKENS)])
    job = RowJob(prompt, Transcript(prompt.clone(), criteria), [OracleDrafter(truth, 5, VOCAB)], frozenset(), 40)
    row = Batch(model, decoder.budget).add(job, draft=True)
    assert len(job.transcript.sources) == (6 if tree_in_prefill else 1) and row.stats.forwards == 1


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_random_drafter_accepts_nothing_and_output_is_identical(family):
    model = model_of(family, "sdpa")
    prompt = prompts(1)[0]
    truth = reference(family, "sdpa", 0, None)[0].tolist()
    result = forerun.Decoder(model, None, "plain", drafters=[RandomDrafter(truth, VOCAB)]).generate(
        prompt, NEW_TOKENS, eos_token_id=[]
    )
    assert result.sequences[0].tolist() == truth
    assert result.stats.accepted == 0 and result.stats.candidates > 0
    assert result.stats.forwards == NEW_TOKENS
