"""A draft model on slots (a card's way, run eagerly here): its forwards through a static base of its own.

On a card each bucket's forward is a captured graph; on the CPU the same bucketed forwards run eagerly, which is
what these tests check: the text is plain generate's, a draft equal to the target is always accepted (its logits
are right at every position, after rollbacks and after its slots grew), each row of a batch drafts on slots of its
own, and the seeded sampled text is the same whatever drafted it.
"""

from __future__ import annotations

import functools

import pytest
import torch

import forerun
from forerun.batch import fork
from forerun.config import DraftModelConfig
from forerun.drafters.base import DraftContext
from forerun.drafters.draft_cache import SlotDraftCache
from forerun.drafters.draft_model import DraftModelDrafter

from tiny_models import VOCAB, prompts, tiny_model

NEW_TOKENS = 40


@functools.lru_cache(maxsize=16)
def model_of(family: str, impl: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    return tiny_model(family, impl, seed)


def reference(target: torch.nn.Module, prompt: torch.Tensor, new: int = NEW_TOKENS) -> torch.Tensor:
    return target.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)


def on_slots(target, draft, static_target: bool = False, **knobs) -> tuple[forerun.Decoder, DraftModelDrafter]:
    """A draft_model Decoder whose drafter's forwards go on slots (`slots=True`: the CPU's default is a growing
    cache), and that drafter."""
    config = DraftModelConfig(**{"confidence": 0.0, **knobs})
    drafter = DraftModelDrafter(config, draft, VOCAB, slots=True)
    decoder = forerun.Decoder(
        target, None, "draft_model", draft_model=draft, drafters=[drafter], static_cache=static_target, **knobs
    )
    return decoder, drafter


@pytest.mark.parametrize("static_target", [False, True], ids=["growing-target", "static-target"])
@pytest.mark.parametrize(
    ("target_family", "draft_family", "impl"),
    [("llama", "llama", "sdpa"), ("qwen2", "gpt2", "sdpa"), ("gemma", "phi3", "eager"), ("mistral", "qwen2", "eager")],
)
def test_a_draft_on_slots_keeps_greedy_equality(target_family, draft_family, impl, static_target):
    target, draft = model_of(target_family, impl), model_of(draft_family, "sdpa", seed=1)
    decoder, drafter = on_slots(target, draft, static_target, gamma=3)
    for prompt in prompts(3):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(target, prompt))
        assert result.stats.candidates > 0
    # one request at a time: one static base, handed back after each request and taken again (its graphs kept)
    assert drafter.store is None and len(drafter.pool.free) == 1


def test_a_draft_equal_to_the_target_on_slots_is_always_accepted():
    target = model_of("llama")
    decoder, _ = on_slots(target, target, schedule="fixed", gamma=4, tree_width=1)
    result = decoder.generate(prompts(1)[0], NEW_TOKENS, eos_token_id=[])
    assert torch.equal(result.sequences, reference(target, prompts(1)[0]))
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.forwards == 8  # 4 accepted + 1 bonus a step, the prefill's included: 40 / 5


def test_slots_that_grow_mid_request_are_fed_again_and_stay_right():
    """A text that outgrows its slots moves to a larger cache (graphs captured again on a card); the draft reads
    the text again there, and a draft equal to the target is still always accepted."""
    target = model_of("llama")
    decoder, drafter = on_slots(target, target, schedule="fixed", gamma=4, tree_width=1, lookup=0)
    prompt = prompts(1)[0]
    result = decoder.generate(prompt, 300, eos_token_id=[])
    assert torch.equal(result.sequences, reference(target, prompt, 300))
    assert result.stats.acceptance_rate == 1.0
    (base,) = drafter.pool.free
    assert base.length >= 1024  # it began with 512 slots


def test_each_row_of_a_batch_drafts_on_slots_of_its_own():
    """Rows forked from one drafter take a static base each from the shared pool: a draft equal to the target is
    accepted in full in every row (rows sharing slots would overwrite each other's entries)."""
    target = model_of("llama")
    decoder, drafter = on_slots(target, target, schedule="fixed", gamma=3, tree_width=1)
    rows = prompts(3)
    results = decoder.generate(rows, NEW_TOKENS, eos_token_id=[])
    for prompt, result in zip(rows, results, strict=True):
        assert torch.equal(result.sequences, reference(target, prompt))
        assert result.stats.acceptance_rate == 1.0
    assert len({id(base) for base in drafter.pool.free}) == 3


def test_a_fork_has_its_own_draft_cache_and_guess_index():
    """A batch's row views share the draft model, its pool and the schedule, and have their own cache and prompt
    lookup index (a shared index was extended with every row's text and guessed from other rows')."""
    drafter = DraftModelDrafter(DraftModelConfig(lookup=4), model_of("llama"), VOCAB, slots=True)
    (twin,) = fork([drafter])
    assert twin.draft is drafter.draft and twin.pool is drafter.pool and twin.head is drafter.head
    assert twin.lookup is not drafter.lookup and twin.store is None and twin.cached is not drafter.cached


def test_warm_up_makes_the_drafts_buckets_before_the_first_request():
    target = model_of("llama")
    decoder, drafter = on_slots(target, model_of("llama", seed=1), static_target=True, gamma=3)
    assert decoder.warm_up(128) > 0
    (base,) = drafter.pool.free
    assert {size for _, size, _ in base.steps} == set(base.buckets) and isinstance(base.length, int)
    decoder.generate(prompts(1)[0], 16, eos_token_id=[])
    assert drafter.pool.free == [base]  # the warmed base served the request


def test_warm_up_for_a_batch_makes_a_draft_base_for_each_row():
    """Each row of a batch drafts on a base of its own: a warm-up for 3 rows makes and warms 3, and a 3-row batch
    after it takes those, no new one (on a card a new base captures its graphs inside the request)."""
    target = model_of("llama")
    decoder, drafter = on_slots(target, model_of("llama", seed=1), static_target=True, gamma=3)
    decoder.warm_up(128, batch_size=3, single=False)
    warmed = list(drafter.pool.free)
    assert len({id(base) for base in warmed}) == 3
    assert all({size for _, size, _ in base.steps} == set(base.buckets) for base in warmed)
    rows = prompts(3)
    results = decoder.generate(rows, 16, eos_token_id=[])
    for prompt, result in zip(rows, results, strict=True):
        assert torch.equal(result.sequences, reference(target, prompt, 16))
    assert {id(base) for base in drafter.pool.free} == {id(base) for base in warmed}


def test_a_seeded_sample_is_the_same_whether_the_draft_grows_or_sits_on_slots():
    target, draft = model_of("llama"), model_of("llama", seed=1)
    slotted, _ = on_slots(target, draft, gamma=3)
    growing = forerun.Decoder(target, None, "draft_model", draft_model=draft, gamma=3, confidence=0.0)
    plain = forerun.Decoder(target, None, "plain")
    options = dict(do_sample=True, seed=11, temperature=0.8, eos_token_id=[])
    texts = [d.generate(prompts(1)[0], 24, **options).sequences for d in (slotted, growing, plain)]
    assert torch.equal(texts[0], texts[1]) and torch.equal(texts[0], texts[2])


def test_a_slot_cache_hands_its_base_back_even_after_a_request_failed_midway():
    """A request whose decoding fails leaves its slots with its drafter; the next request's start hands them back
    to the pool before taking its own, so a failure costs no base."""
    drafter = DraftModelDrafter(DraftModelConfig(confidence=0.0), model_of("llama"), VOCAB, slots=True)
    tokens = prompts(1)[0][0].tolist()
    drafter.start(DraftContext(list(tokens), len(tokens), 8, frozenset()))
    first = drafter.store
    assert isinstance(first, SlotDraftCache) and not drafter.pool.free
    drafter.start(DraftContext(list(tokens), len(tokens), 8, frozenset()))  # no finish in between
    assert drafter.store.base is first.base and not drafter.pool.free
