"""Method draft_model: greedy equality across target/draft pairs, rollback, schedules, vocabulary checks, knobs.

The sampled distribution is tested in test_sampling.py, with the other methods.
"""

from __future__ import annotations

import functools

import pytest
import torch

import forerun
from forerun.config import DraftModelConfig
from forerun.drafters.base import DraftContext
from forerun.drafters.draft_cache import GrowingDraftCache, SlotDraftCache
from forerun.drafters.draft_model import DraftModelDrafter, check_same_vocabulary, self_draft

from tiny_models import VOCAB, prompts, tiny_model

NEW_TOKENS = 40
# (target family, draft family): same family with other weights, and drafts of another family (gpt2 has learned
# absolute positions, qwen2 biases in q/k/v): the draft only has to share the token ids.
PAIRS = [("llama", "llama"), ("llama", "gpt2"), ("qwen2", "llama"), ("mistral", "qwen2"), ("gemma", "phi3")]


@functools.lru_cache(maxsize=16)
def model_of(family: str, impl: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    return tiny_model(family, impl, seed)


@functools.lru_cache(maxsize=64)
def reference(family: str, impl: str, index: int) -> torch.Tensor:
    prompt = prompts(3)[index]
    return model_of(family, impl).generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )


def noisy_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """`model` with Gaussian noise on every weight: a draft that agrees often, not always (forced rejections)."""
    import copy

    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in clone.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return clone


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize(("target_family", "draft_family"), PAIRS)
def test_greedy_equals_generate_for_target_draft_pairs(target_family, draft_family, impl):
    target = model_of(target_family, impl)
    draft = model_of(draft_family, "sdpa", seed=1)
    decoder = forerun.Decoder(target, None, "draft_model", draft_model=draft, confidence=0.0, gamma=3)
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(target_family, impl, index)), (index,)
        assert result.stats.candidates > 0  # it did draft
        assert result.stats.fallback_reason is None


@pytest.mark.parametrize(
    "knobs", [{}, {"tree_width": 3}, {"schedule": "grow"}, {"schedule": "fixed", "gamma": 1}, {"lookup": 0}]
)
def test_rollback_under_forced_rejections(knobs):
    """A noisy copy of the target is right about half the time: every step rolls the draft cache back."""
    target = model_of("llama")
    draft = noisy_copy(target, 0.6, seed=3)
    decoder = forerun.Decoder(target, None, "draft_model", draft_model=draft, confidence=0.0, **knobs)
    rates = []
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference("llama", "sdpa", index)), (knobs, index)
        rates.append(result.stats.acceptance_rate)
    assert 0.05 < sum(rates) / len(rates) < 0.95, rates  # both acceptances and rejections happened


@pytest.mark.parametrize("slots", [False, True], ids=["growing", "slots"])
def test_draft_cache_rolls_back_to_exactly_the_shared_prefix(slots):
    """After a rejection the cache holds the shared prefix only, and its logits equal a fresh draft run's."""
    target = model_of("llama")
    drafter = DraftModelDrafter(
        DraftModelConfig(gamma=4, confidence=0.0, schedule="fixed", tree_width=1), target, VOCAB, slots=slots
    )
    tokens = prompts(1)[0][0].tolist()
    ctx = DraftContext(list(tokens), len(tokens), 16, frozenset())
    drafter.start(ctx)
    tree = drafter.propose(ctx)
    drafted = [tree.tokens[i] for i in range(1, len(tree))]
    assert len(drafted) == 4 and drafter.cached == tokens + drafted[:-1]
    # The target takes the first draft token, then says something else: a rejection after one token.
    other = (drafted[1] + 1) % VOCAB
    ctx.tokens.extend([drafted[0], other])
    logits = drafter.catch_up(ctx.tokens)
    assert drafter.cached == ctx.tokens
    assert isinstance(drafter.store, SlotDraftCache if slots else GrowingDraftCache)
    if not slots:
        assert drafter.store.length == len(ctx.tokens)
    with torch.inference_mode():
        fresh = target(torch.tensor([ctx.tokens])).logits[0, -1]
    torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize(("target_family", "draft_family"), [("llama", "llama"), ("qwen2", "gpt2")])
def test_lookup_inside_the_draft_keeps_greedy_equality(target_family, draft_family, impl):
    target = model_of(target_family, impl)
    draft = model_of(draft_family, "sdpa", seed=1)
    decoder = forerun.Decoder(target, None, "draft_model", draft_model=draft, confidence=0.0, gamma=6, lookup=4)
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(target_family, impl, index)), (index,)


@pytest.mark.parametrize("slots", [False, True], ids=["growing", "slots"])
def test_lookup_inside_the_draft_drafts_the_same_tokens_with_fewer_draft_forwards(slots):
    """Guesses only save draft forwards: the draft's choices, hence the tree, are those of plain drafting.
    Guesses that have not paid lately are only watched (no wider forward) until they would have paid again.

    The context is the draft's own greedy text, which has entered a loop (24 80 50 ...), so prompt lookup guesses
    its next tokens right; after the step the target rejects a token, so guessed keys/values are dropped again.
    """
    draft = model_of("llama")
    prompt = prompts(2)[1]
    own = draft.generate(prompt, max_new_tokens=25, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    tokens, expected = own[:-10], own[-10:]
    trees, forwards = {}, {}
    for lookup in (0, 8, "watched"):
        config = DraftModelConfig(
            gamma=10, confidence=0.0, schedule="fixed", tree_width=1, lookup=8 if lookup == "watched" else lookup
        )
        drafter = DraftModelDrafter(config, draft, VOCAB, slots=slots)
        if lookup == "watched":  # guesses have not paid lately: they are only watched, and learned from
            drafter.guess_rate = 0.0
        calls: list[int] = []
        drafter.forward = counting(drafter.forward, calls)
        ctx = DraftContext(list(tokens), len(tokens), 16, frozenset())
        drafter.start(ctx)
        trees[lookup] = drafter.propose(ctx).tokens[1:]
        forwards[lookup] = list(calls)  # the proposal's forwards only
        # the target takes 2 drafted tokens and says another third: the cache keeps exactly the shared prefix
        ctx.tokens.extend([expected[0], expected[1], (expected[2] + 1) % VOCAB])
        logits = drafter.catch_up(ctx.tokens)
        assert drafter.cached == ctx.tokens
        with torch.inference_mode():
            fresh = draft(torch.tensor([ctx.tokens])).logits[0, -1]
        torch.testing.assert_close(logits, fresh, rtol=1e-4, atol=1e-4)
        if lookup == "watched":
            assert drafter.guess_rate > 1.0  # learned from guesses it only watched: they confirmed tokens
    assert trees[0] == expected and trees[8] == expected and trees["watched"] == expected
    assert forwards["watched"] == forwards[0]
    assert forwards[0] == [len(tokens)] + [1] * 9  # catch-up, then one forward per drafted token but the last
    assert len(forwards[8]) <= 3 and max(forwards[8]) > 1, forwards  # guesses confirmed: few, wider forwards


def counting(forward, calls: list[int]):
    """`forward` that also records how many tokens each call feeds."""

    def wrapped(ids, keep=None):
        calls.append(len(ids))
        return forward(ids, keep)

    return wrapped


def test_draft_equal_to_target_is_always_accepted():
    target = model_of("llama")
    decoder = forerun.Decoder(
        target, None, "draft_model", draft_model=target, confidence=0.0, schedule="fixed", gamma=4, tree_width=1
    )
    result = decoder.generate(prompts(1)[0], NEW_TOKENS, eos_token_id=[])
    assert torch.equal(result.sequences, reference("llama", "sdpa", 0))
    assert result.stats.acceptance_rate == 1.0
    # Every step, the prefill included: 4 accepted + 1 bonus, so 40 tokens take 40 / 5 forwards.
    assert result.stats.forwards == 8


def test_schedules_move_gamma():
    target = model_of("llama")
    perfect = forerun.Decoder(target, None, "draft_model", draft_model=target, confidence=0.0, gamma=2, max_gamma=9)
    perfect.generate(prompts(1)[0], 30, eos_token_id=[])
    assert perfect.drafters[0].gamma == 9  # +2 per fully accepted step, capped
    stranger = model_of("gpt2", seed=5)
    poor = forerun.Decoder(target, None, "draft_model", draft_model=stranger, confidence=0.0, gamma=6)
    poor.generate(prompts(1)[0], 20, eos_token_id=[])
    assert poor.drafters[0].gamma < 6
    fixed = forerun.Decoder(target, None, "draft_model", draft_model=stranger, schedule="fixed", gamma=6)
    fixed.generate(prompts(1)[0], 20, eos_token_id=[])
    assert fixed.drafters[0].gamma == 6


def test_tree_width_adds_alternatives_at_the_first_position():
    target = model_of("llama")
    config = DraftModelConfig(gamma=3, tree_width=3, confidence=0.0, schedule="fixed")
    drafter = DraftModelDrafter(config, model_of("qwen2", seed=1), VOCAB)
    tokens = prompts(1)[0][0].tolist()
    ctx = DraftContext(list(tokens), len(tokens), 16, frozenset())
    drafter.start(ctx)
    tree = drafter.propose(ctx)
    assert len(tree) == 1 + 3 + 2
    assert len(tree.candidate_children(0)) == 3
    assert max(tree.depths) == 3
    result = forerun.Decoder(target, None, "draft_model", draft_model=model_of("qwen2", seed=1), tree_width=3).generate(
        prompts(1)[0], NEW_TOKENS, eos_token_id=[]
    )
    assert torch.equal(result.sequences, reference("llama", "sdpa", 0))


def test_self_drafting_shares_weights_and_leaves_the_target_untouched():
    target = model_of("qwen2")
    layers_before = len(target.model.layers)
    draft = self_draft(target, 1)
    assert len(draft.model.layers) == 1 and len(target.model.layers) == layers_before
    assert target.config.num_hidden_layers == layers_before
    assert draft.lm_head.weight is target.lm_head.weight
    decoder = forerun.Decoder(target, None, "draft_model", self_draft_layers=1, confidence=0.0)
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference("qwen2", "sdpa", index))
    with pytest.raises(ValueError, match="self_draft_layers must be in"):
        self_draft(target, layers_before)
    with pytest.raises(ValueError, match="decoder layers"):
        self_draft(model_of("gpt2"), 1)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def test_mismatched_vocabularies_are_refused_naming_both_models():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    small_vocab = AutoModelForCausalLM.from_config(config)
    small_vocab.config._name_or_path = "tiny-64"
    target = model_of("llama")
    target.config._name_or_path = "tiny-96"
    with pytest.raises(ValueError, match=r"draft model 'tiny-64' and target 'tiny-96' have different vocabularies"):
        forerun.Decoder(target, None, "draft_model", draft_model=small_vocab)
    # Same rows, different token -> id maps: refused when both tokenizers are known.
    words = {f"t{i}": i for i in range(VOCAB)}
    shuffled = {f"t{i}": (i + 1) % VOCAB for i in range(VOCAB)}
    with pytest.raises(ValueError, match="use different tokenizers"):
        check_same_vocabulary(target, model_of("qwen2"), FakeTokenizer(words), FakeTokenizer(shuffled))
    # A target padded beyond its tokenizer may pair with a draft that has fewer rows.
    check_same_vocabulary(target, small_vocab, FakeTokenizer({f"t{i}": i for i in range(60)}), None)


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"gamma": 0}, "gamma must be an integer >= 1"),
        ({"gamma": 9, "max_gamma": 4}, r"gamma \(9\) must be <= max_gamma \(4\)"),
        ({"schedule": "sometimes"}, "schedule must be fixed, grow or heuristic"),
        ({"confidence": 1.5}, r"confidence must be a number in \[0, 1\)"),
        ({"tree_width": 0}, "tree_width must be an integer >= 1"),
        ({"self_draft_layers": -1}, "self_draft_layers must be an integer >= 0"),
        ({"lookup": 2.5}, "lookup must be an integer >= 0"),
        ({"lookup_min_hits": -1}, "lookup_min_hits must be a number >= 0 and <= 1e\\+06"),
        ({"gamma": 10**6, "max_gamma": 10**6}, "gamma must be an integer >= 1 and <= 256"),
    ],
)
def test_bad_knobs_are_clear_errors(knobs, message):
    with pytest.raises(ValueError, match=message):
        forerun.Decoder(model_of("llama"), None, "draft_model", draft_model=model_of("llama"), **knobs)


def test_missing_or_misplaced_draft_model_is_a_clear_error():
    with pytest.raises(ValueError, match="needs draft_model="):
        forerun.Decoder(model_of("llama"), None, "draft_model")
    with pytest.raises(ValueError, match="not both"):
        forerun.Decoder(model_of("llama"), None, "draft_model", draft_model=model_of("llama"), self_draft_layers=1)
    with pytest.raises(ValueError, match="knob of method 'draft_model'"):
        forerun.Decoder(model_of("llama"), None, "prompt_lookup", draft_model=model_of("llama"))


def test_the_draft_models_forwards_keep_off_cudnn_on_a_card(monkeypatch):
    """Every forward of the draft model runs inside `planless_attention` with its inputs' device (a card would
    otherwise plan cuDNN's attention for every new cache length; `forerun.attention.planless_attention`)."""
    from forerun.drafters import draft_cache as module

    asked, real = [], module.planless_attention
    monkeypatch.setattr(module, "planless_attention", lambda device: asked.append(device) or real(device))
    target, draft = model_of("llama"), model_of("llama", "sdpa", seed=1)
    result = forerun.Decoder(target, None, "draft_model", draft_model=draft, gamma=3).generate(
        prompts(1)[0], 8, eos_token_id=[]
    )
    assert result.stats.candidates > 0 and asked and set(asked) == {torch.device("cpu")}
