"""Sampling keeps the exact distribution of `model.generate(do_sample=True)`: chi-square tests that can fail.

Setup: a tiny llama with a 32-token vocabulary whose LM head is scaled so next-token distributions are peaked
(top token ~0.5), a repetitive prompt so every drafter proposes often, 10,000 samples of 4 new tokens per setting.
Statistic: the joint distribution of the 4 new tokens (the first draft is verified in the prefill forward, so
token 1 is drafted too), cells with fewer than 5 expected samples pooled; chi-square test of homogeneity against
plain batched sampling.
Significance level: alpha = 0.001 per setting (13 settings; family-wise false alarm rate about 1.3%).
A biased verifier (accept every drafted token that has any probability) must fail the same test: the power check.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
)

import forerun
from forerun.costmodel import LatencyCurve
from forerun.engine import decode
from forerun.noise import GumbelNoise
from forerun.penalties import OccurrencePenalty
from forerun.row import RowJob
from forerun.transcript import Transcript
from forerun.tree import TokenTree
from forerun.verify import Sampling, Verdict, verify_greedy, verify_sampled

from tiny_models import char_tokenizer


def json_mask(prompt_length: int):
    """A response format's mask ({"type": "json_object"}) for a prompt of `prompt_length` tokens, EOS id 2."""
    from forerun.structured import Grammars

    return Grammars(char_tokenizer(32), 32, 2).constraint({"type": "json_object"}, prompt_length, frozenset({2}))


SAMPLES = 10_000
PROMPT_LENGTH = 18
"""`PROMPT`'s length (seed, 12 greedy tokens, seed), asserted where it is made."""
NEW = 4
ALPHA = 1e-3
SETTINGS = {
    "T0.7": dict(temperature=0.7),
    "T1.3-top_k5": dict(temperature=1.3, top_k=5),
    "top_p0.9": dict(top_p=0.9),
    "T1.3": dict(temperature=1.3),
    "rep1.3": dict(repetition_penalty=1.3),
    # OpenAI's penalties: forerun's processor, given to plain generate as its own (the answer's tokens counted)
    "freq-presence-T1.3": dict(
        temperature=1.3, logits_processor=LogitsProcessorList([OccurrencePenalty(2.0, 2.0, PROMPT_LENGTH)])
    ),
    # a response format's mask: JSON only (a forced "{", then a key's letters drawn among the ones left)
    "json-T1.3": dict(temperature=1.3, logits_processor=LogitsProcessorList([json_mask(PROMPT_LENGTH)])),
}
CASES = [
    ("plain", "T0.7"),
    ("prompt_lookup", "T0.7"),
    ("prompt_lookup", "T1.3-top_k5"),
    ("jacobi", "T1.3"),
    ("jacobi", "rep1.3"),
    ("trie", "top_p0.9"),
    ("trie", "freq-presence-T1.3"),
    ("auto", "json-T1.3"),
    ("draft_model", "T0.7"),
    ("draft_model-wide", "top_p0.9"),  # the runners-up of the draft's noisy scores as extra leaves
    ("draft_model-lookup", "T1.3"),
    ("auto", "T1.3-top_k5"),  # the cost model picks each step's tree from the calibration of earlier draws
    ("prompt_lookup+draft_model", "T0.7"),  # deterministic and sampled drafts under one root
]
KNOBS = {
    "plain": {},
    "prompt_lookup": {"draft_len": 4},
    "jacobi": {"window": 3, "ngram": 3},
    "trie": {},
    "draft_model": {"gamma": 3, "confidence": 0.0, "lookup": 0},
    "draft_model-wide": {"gamma": 3, "confidence": 0.0, "lookup": 0, "tree_width": 3},
    "draft_model-lookup": {"gamma": 3, "confidence": 0.0, "lookup": 3},  # q drawn from rows of guessed forwards
    "auto": {},
    "prompt_lookup+draft_model": {"draft_model.gamma": 3, "draft_model.confidence": 0.0, "draft_model.lookup": 0},
}
FLAT = LatencyCurve((1, 64), (0.010, 0.011))
"""A GPU-like latency curve: drafting nearly always pays, so the combined methods draft (the test has power)."""


@functools.lru_cache(maxsize=1)
def peaked_model() -> torch.nn.Module:
    """A 32-token llama with its LM head scaled x40: the top next token has probability ~0.5."""
    config = AutoConfig.for_model(
        "llama",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked next-token distributions: drafts get accepted, tests get power
    return model


def likely_prompt() -> torch.Tensor:
    """seed + the model's greedy continuation + seed: drafters then propose what the model tends to say next."""
    seed = torch.tensor([[5, 6, 7]])
    greedy = peaked_model().generate(seed, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    return torch.cat([greedy, seed], dim=1)


PROMPT = likely_prompt()
assert PROMPT.shape[1] == PROMPT_LENGTH


@functools.lru_cache(maxsize=1)
def peaked_draft() -> torch.nn.Module:
    """The peaked model with noise on its weights: q close to p, not equal (accepts and residual draws both)."""
    import copy

    draft = copy.deepcopy(peaked_model())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3 * parameter.std())
    return draft


def decoder_for(method: str) -> forerun.Decoder:
    """'draft_model-wide' -> a draft_model Decoder with the noisy draft and the case's knobs."""
    name = method.partition("-")[0]
    draft = peaked_draft() if "draft_model" in name else None
    return forerun.Decoder(peaked_model(), None, name, draft_model=draft, latency=FLAT, **KNOBS[method])


def transformers_processors(model, settings):
    """The exact processor list `model.generate(do_sample=True, **settings)` builds (captured, not rebuilt)."""

    def capture(model, input_ids, logits_processor, **kwargs):
        return logits_processor

    return model.generate(
        PROMPT,
        do_sample=True,
        max_new_tokens=NEW,
        eos_token_id=None,
        pad_token_id=0,
        custom_generate=capture,
        **settings,
    )


@functools.lru_cache(maxsize=8)
def plain_counts(setting: str) -> Counter:
    torch.manual_seed(1234)
    out = peaked_model().generate(
        PROMPT.repeat(SAMPLES, 1),
        do_sample=True,
        max_new_tokens=NEW,
        eos_token_id=None,
        pad_token_id=0,
        **SETTINGS[setting],
    )
    return Counter(tuple(row) for row in out[:, PROMPT.shape[1] :].tolist())


def forerun_counts(method: str, setting: str, verifier=None) -> tuple[Counter, float]:
    model = peaked_model()
    processors = transformers_processors(model, SETTINGS[setting])
    decoder = decoder_for(method)
    generator = torch.Generator().manual_seed(99)
    counts, accepted, steps = Counter(), 0, 0
    with torch.inference_mode():
        for _ in range(SAMPLES):
            sampling = Sampling(GumbelNoise.drawn(generator), *([verifier] if verifier else []))
            transcript = Transcript(PROMPT.clone(), StoppingCriteriaList([MaxLengthCriteria(PROMPT.shape[1] + NEW)]))
            job = RowJob(PROMPT, transcript, decoder.drafters, frozenset(), NEW, processors, sampling)
            stats = decode(model, job, decoder.budget, decoder.engine_config.draft_in_prefill)
            counts[tuple(transcript.sequence[0, PROMPT.shape[1] :].tolist())] += 1
            accepted, steps = accepted + stats.accepted, steps + stats.forwards
    return counts, accepted / max(1, steps)


def homogeneity_pvalue(a: Counter, b: Counter) -> float:
    """Chi-square test that two samples come from one distribution; rare cells pooled into one."""
    total = a + b
    common = [cell for cell, n in total.items() if n * min(a.total(), b.total()) / total.total() >= 5]
    rows = [
        [a[c] for c in common] + [a.total() - sum(a[c] for c in common)],
        [b[c] for c in common] + [b.total() - sum(b[c] for c in common)],
    ]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return float(chi2_contingency(rows)[1])


@pytest.mark.parametrize(("method", "setting"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_sampled_distribution_matches_plain_generate(method, setting):
    counts, accepted_per_step = forerun_counts(method, setting)
    assert counts.total() == SAMPLES
    if method != "plain":
        assert accepted_per_step > 0.05, "drafts were hardly ever accepted: the test would have no power"
    assert homogeneity_pvalue(counts, plain_counts(setting)) > ALPHA


def biased_verifier(tree: TokenTree, scores_at, noise: GumbelNoise, position: int) -> Verdict:
    """WRONG on purpose: accepts any drafted token with non-zero probability (ignores p's actual value)."""
    return verify_greedy(
        tree,
        lambda node: next(
            (tree.tokens[c] for c in tree.candidate_children(node) if scores_at(node)[tree.tokens[c]] > -math.inf),
            noise.draw(scores_at(node), position + tree.depths[node]),
        ),
    )


def test_negative_control_biased_verifier_fails_the_same_test():
    counts, _ = forerun_counts("prompt_lookup", "T0.7", biased_verifier)
    assert homogeneity_pvalue(counts, plain_counts("T0.7")) < ALPHA


def test_same_seed_same_output_and_greedy_processors_match():
    model = peaked_model()
    decoder = forerun.Decoder(model, None, "prompt_lookup")
    first = decoder.generate(PROMPT, 12, do_sample=True, seed=7, temperature=0.9, eos_token_id=[])
    again = decoder.generate(PROMPT, 12, do_sample=True, seed=7, temperature=0.9, eos_token_id=[])
    other = decoder.generate(PROMPT, 12, do_sample=True, seed=8, temperature=0.9, eos_token_id=[])
    assert torch.equal(first.sequences, again.sequences)
    assert not torch.equal(first.sequences, other.sequences)
    for settings in (dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2)):
        expected = model.generate(
            PROMPT, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, **settings
        )
        assert torch.equal(decoder.generate(PROMPT, 12, eos_token_id=[], **settings).sequences, expected), settings


def test_verify_sampled_on_hand_built_distributions():
    """Over seeds: a zero-probability draft is never accepted, a p = 0.5 draft half the time, and the token after
    the root follows p either way."""
    tree = TokenTree.rooted_at(0)
    tree.add(0, 1)  # node 1: a zero-probability draft
    tree.add(0, 2)  # node 2: p = 0.5, and certain to be followed by 3
    scores = {0: torch.tensor([0.5, 0.0, 0.5, 0.0]).log(), 2: torch.tensor([0.0, 0.0, 0.0, 1.0]).log()}
    outcomes = Counter()
    for seed in range(2000):
        verdict = verify_sampled(tree, scores.__getitem__, GumbelNoise(seed), 10)
        outcomes[(tuple(verdict.accepted_nodes), verdict.bonus_token)] += 1
    assert set(outcomes) == {((2,), 3), ((), 0)}
    assert abs(outcomes[((2,), 3)] / 2000 - 0.5) < 0.05


SEEDED = ("plain", "prompt_lookup", "trie", "jacobi", "auto", "draft_model")


def test_a_seed_writes_the_same_text_with_every_method_and_batch():
    """The noise depends on the seed and the position only: what is drafted, fed and learned in between never
    changes a seeded answer; batch row i draws with seed + i, as `generate` documents."""
    second = torch.tensor([[3, 9, 4, 9, 4, 9]])
    seeds = (0, 1, 2)
    reference = {}
    for method in SEEDED:
        decoder = decoder_for(method)
        for seed in seeds:
            for prompt in (PROMPT, second):
                for _ in range(2):  # again: the trie and the cost model have learned from the first run
                    out = decoder.generate(prompt, 12, do_sample=True, seed=seed, temperature=1.3, eos_token_id=[])
                    key = (seed, tuple(prompt[0].tolist()))
                    assert torch.equal(reference.setdefault(key, out.sequences), out.sequences), (method, seed)
        rows = decoder.generate([PROMPT, second], 12, do_sample=True, seed=1, temperature=1.3, eos_token_id=[])
        assert torch.equal(rows[0].sequences, reference[(1, tuple(PROMPT[0].tolist()))]), method
        assert torch.equal(rows[1].sequences, reference[(2, tuple(second[0].tolist()))]), method
    assert len({tuple(out[0].tolist()) for out in reference.values()}) == len(reference)  # seeds differ


def test_a_draft_model_guesses_the_target_draws():
    """With the target as its own draft, the draft's noisy argmax is the target's draw: every drafted token is
    accepted (noise read at the wrong position would reject most of them)."""
    model = peaked_model()
    knobs = dict(gamma=3, schedule="fixed", confidence=0.0, lookup=0, tree_width=1)
    decoder = forerun.Decoder(model, None, "draft_model", draft_model=model, **knobs)
    stats = decoder.generate(PROMPT, 24, do_sample=True, seed=3, temperature=1.3, eos_token_id=[]).stats
    assert stats.accepted == stats.candidates >= 18, stats  # 6 forwards of 3 drafts + a bonus


@pytest.mark.parametrize("setting", ["T1.3-top_k5", "rep1.3"])
def test_draws_made_at_once_write_the_walks_text_alone_and_in_a_batch(setting, monkeypatch):
    """Drawing at every node at once (an accelerator's way, `Sampling.at_once`, forced here on the CPU) writes the
    walk's text with every method, a row alone and the rows of a batch; the draws were made at once (counted), a
    batch's in one copy per step for all its rows."""
    from forerun import batch as batch_module
    from forerun import row as row_module
    from forerun.batched import decode_batch

    model, second = peaked_model(), torch.tensor([[3, 9, 4, 9, 4, 9]])
    processors = transformers_processors(model, SETTINGS[setting])
    made, copied = Counter(), Counter()
    drawn, to_host = row_module.drawn_at_once, batch_module.to_host
    monkeypatch.setattr(row_module, "drawn_at_once", lambda *a: made.update([(out := drawn(*a)) is not None]) or out)
    monkeypatch.setattr(
        batch_module, "to_host", lambda rows: copied.update([sum(r is not None for r in rows)]) or to_host(rows)
    )

    def job(prompt: torch.Tensor, drafters, seed: int, at_once: bool) -> RowJob:
        transcript = Transcript(prompt.clone(), StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + 12)]))
        return RowJob(
            prompt, transcript, drafters, frozenset(), 12, processors, Sampling(GumbelNoise(seed), at_once=at_once)
        )

    for method in SEEDED:
        texts = {}
        for at_once in (False, True):
            decoder = decoder_for(method)
            alone = [job(prompt, decoder.drafters, seed, at_once) for seed in (0, 1) for prompt in (PROMPT, second)]
            for one in alone:
                decode(model, one, decoder.budget, decoder.engine_config.draft_in_prefill)
            rows = [
                job(prompt, forerun.batch.fork(decoder.drafters), seed, at_once)
                for seed, prompt in ((2, PROMPT), (3, second))
            ]
            decode_batch(model, rows, decoder.budget)
            texts[at_once] = [one.transcript.sequence.tolist() for one in alone + rows]
        assert texts[True] == texts[False], method
    assert made[True] > 0 and made[False] == 0
    assert copied[2] > 0  # a batch step's two sampled rows: one copy


def test_a_seed_writes_the_same_penalised_text_with_every_method():
    """Under OpenAI's penalties too, a seeded answer is the seed's whatever drafts it; the penalties change it."""
    for seed in (0, 2):
        settings = dict(do_sample=True, seed=seed, temperature=1.3, eos_token_id=[])
        penalised = dict(settings, frequency_penalty=2.0, presence_penalty=2.0)
        reference = decoder_for("plain").generate(PROMPT, 12, **penalised).sequences
        assert not torch.equal(reference, decoder_for("plain").generate(PROMPT, 12, **settings).sequences)
        for method in SEEDED:
            got = decoder_for(method).generate(PROMPT, 12, **penalised).sequences
            assert torch.equal(got, reference), (method, seed)
