"""An EAGLE-3 drafter's head forwards on preallocated slots (`forerun.drafters.eagle3.runner`): rows padded as a
card's graphs pad them draft exactly as unpadded ones, a prompt longer than one chunk is read in chunks, a cache
that grows keeps what it held, a batch's copy of the drafter gets slots of its own, and on a card a captured
forward equals the eager one."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch

from forerun.config import Eagle3Config
from forerun.drafters.base import DraftContext, StepOutcome
from forerun.drafters.eagle3.drafter import Eagle3Drafter
from forerun.drafters.eagle3.runner import LENGTH_STEP, ROWS, HeadRunner
from forerun.tree import TokenTree
from forerun.verify import Verdict

from eagle3_heads import random_head
from tiny_models import prompts, tiny_model

PROMPT = 70
"""Tokens of the test prompt: read as a chunk of the largest row count and one of 6 rows (padded to 8)."""


def drafted(head, features: torch.Tensor, tokens: list[int], pad: bool, device: str = "cpu", capture: bool = False):
    """A drafter whose runner pads (or not), after reading `tokens`' features; its first tree, and the row count of
    every head forward it made."""
    drafter = Eagle3Drafter(Eagle3Config(depth=4, topk=3, width=3, min_prob=0.0), head)
    runner = drafter.runner = HeadRunner(head, 3, capture=capture, pad=pad)
    rows, forward = [], runner.forward
    runner.forward = lambda inputs, *rest: rows.append(inputs.shape[0]) or forward(inputs, *rest)
    ctx = DraftContext(tokens, len(tokens), 64, frozenset())
    outcome = StepOutcome(TokenTree.rooted_at(tokens[-1]), Verdict([], 0), torch.empty(0), [], {}, features)
    with torch.inference_mode():
        drafter.observe(ctx, outcome)
    return drafter, drafter.propose(ctx), rows


def prompt_and_features(model, length: int = PROMPT) -> tuple[list[int], torch.Tensor]:
    tokens = prompts(1, length, seed=5)[0][0].tolist()
    generator = torch.Generator().manual_seed(1)
    return tokens, torch.randn(len(tokens) - 1, 3 * model.config.hidden_size, generator=generator)


def test_padded_rows_draft_exactly_as_unpadded_ones():
    """The same prompt read and drafted with rows padded to a card's row counts and without: the same tree (tokens,
    parents, scores) and the same cache entries at every committed slot, though every padded forward had a row count
    of `ROWS` and the unpadded ones had others."""
    model = tiny_model("llama")
    head = random_head(model).float()
    tokens, features = prompt_and_features(model)
    padded, tree, rows = drafted(head, features, tokens, pad=True)
    plain, want, plain_rows = drafted(head, features, tokens, pad=False)
    assert set(rows) <= set(ROWS) and not set(plain_rows) <= set(ROWS)
    assert len(want) > 4 and tree.tokens == want.tokens and tree.parents == want.parents  # a tree several levels deep
    assert torch.allclose(torch.tensor(tree.scores), torch.tensor(want.scores), atol=1e-6)
    committed = len(tokens) - 1
    assert padded.committed == plain.committed == committed
    keys, plain_keys = padded.runner.slots.keys, plain.runner.slots.keys
    assert torch.allclose(keys[:, :committed], plain_keys[:, :committed], atol=1e-6)


def test_a_long_prompt_reads_in_chunks_as_in_one():
    """A prompt longer than the largest row count is read in chunks; the last position's output and guesses equal
    a read of the first tokens only up to that point's own (the causal mask is kept across chunks)."""
    model = tiny_model("llama")
    head = random_head(model).float()
    tokens, features = prompt_and_features(model)
    assert len(features) > ROWS[-1]
    chunked, _, _ = drafted(head, features, tokens, pad=False)
    runner = HeadRunner(head, 3, capture=False)
    runner.reserve(0, len(tokens))
    with torch.inference_mode():
        slots = list(range(len(features)))
        whole = runner.forward(
            torch.from_numpy(runner.inputs_of(tokens[1:], slots, slots, [(s + 1, []) for s in slots], len(slots))),
            features,
            True,
            True,
        )
    assert torch.allclose(chunked.last.out, whole[0][-1:], atol=1e-5)
    assert chunked.last.ids.tolist() == whole[2].tolist()


def test_a_growing_cache_keeps_what_it_held():
    """Slots reserved for a short text, then for one longer than their capacity: a larger cache, the entries
    committed so far carried over, and the next read equal to one on a cache that was large from the start. A
    cache grown without carrying them (`keep=0`) reads differently (the control)."""
    model = tiny_model("llama")
    head = random_head(model).float()
    tokens, features = prompt_and_features(model, 12)
    grown, forgetful, large = (HeadRunner(head, 3, capture=False) for _ in range(3))
    rest = list(range(8, 11))
    with torch.inference_mode():
        for runner in (grown, forgetful, large):
            runner.reserve(0, 8 if runner is not large else 3 * LENGTH_STEP)
            assert runner.slots.capacity == (LENGTH_STEP if runner is not large else 4 * LENGTH_STEP)
            first = list(range(8))
            runner.read(tokens[1:9], first, first, [(s + 1, []) for s in first], features[:8], True)
        grown.reserve(8, 2 * LENGTH_STEP)
        forgetful.reserve(0, 2 * LENGTH_STEP)
        assert grown.slots.capacity == 3 * LENGTH_STEP
        reads = [runner.read(tokens[9:12], rest, rest, [(s + 1, []) for s in rest], features[8:11], True, True)
                 for runner in (grown, forgetful, large)]  # fmt: skip
    assert torch.allclose(reads[0].out, reads[2].out, atol=1e-6)
    assert not torch.allclose(reads[1].out, reads[2].out, atol=1e-3)


def test_a_batch_rows_copy_has_slots_of_its_own():
    """`copy.copy` (how a batch forks a row's drafters) gives a drafter with its own runner, never captured."""
    model = tiny_model("llama")
    head = random_head(model).float()
    drafter = Eagle3Drafter(Eagle3Config(), head)
    twin = copy.copy(drafter)
    assert twin.runner is not drafter.runner and not twin.runner.capture and twin.head is head


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a card")
def test_a_captured_head_drafts_as_the_eager_one_on_a_card():
    """On a card: the head's forwards captured as CUDA graphs draft the same tree as the eager, padded ones."""
    model = tiny_model("llama").cuda()
    head = random_head(model).float().cuda()
    tokens, features = prompt_and_features(model)
    captured, tree, _ = drafted(head, features.cuda(), tokens, pad=True, capture=True)
    _, want, _ = drafted(head, features.cuda(), tokens, pad=True)
    assert captured.runner.graphs and captured.runner.capture
    assert tree.tokens == want.tokens and tree.parents == want.parents


def steps_of(tokens: list[int], features: torch.Tensor, cuts: list[int]):
    """The committed text after each of a few steps: (context, outcome) with the features of the positions that
    step committed, `cuts[k-1]` .. `cuts[k]` - 1."""
    for before, after in itertools.pairwise(cuts):
        outcome = StepOutcome(TokenTree.rooted_at(tokens[after]), Verdict([], 0), torch.empty(0), [], {},
                              features[before:after])  # fmt: skip
        yield DraftContext(tokens[: after + 1], 1, 64, frozenset()), outcome


def test_a_head_that_sat_out_reads_what_waited_and_drafts_as_if_it_had_read_every_step():
    """Three steps' committed positions, read as they come, or the first read and the next two kept while the head
    sat out: when it drafts again it reads them in one forward, and its first tree is the same (tokens, parents,
    scores within rounding). A head that read only the step it drafts in (the control: what a fresh cache knows)
    drafts otherwise."""
    model = tiny_model("llama")
    head = random_head(model).float()
    tokens, features = prompt_and_features(model, 24)
    steps = list(steps_of(tokens, features, [0, 16, 19, 23]))
    config = Eagle3Config(depth=4, topk=3, width=3, min_prob=0.0)
    every, waited, forgot = (Eagle3Drafter(config, head) for _ in range(3))
    with torch.inference_mode():
        for index, (ctx, outcome) in enumerate(steps):
            every.observe(ctx, outcome)
            (waited.observe if index == 0 else waited.sit_out)(ctx, outcome)
        forgot.observe(*steps[-1])
        assert waited.committed == 16 and len(waited.pending) == 2
        trees = [drafter.propose(steps[-1][0]) for drafter in (every, waited, forgot)]
    assert waited.committed == every.committed == 23 and not waited.pending
    assert len(trees[0]) > 4 and trees[1].tokens == trees[0].tokens and trees[1].parents == trees[0].parents
    assert torch.allclose(torch.tensor(trees[1].scores), torch.tensor(trees[0].scores), atol=1e-5)
    assert torch.allclose(waited.last.out, every.last.out, atol=1e-5)
    assert not torch.allclose(forgot.last.out, every.last.out, atol=1e-3)


def test_a_long_wait_keeps_the_newest_positions_on_a_fresh_cache():
    """More positions than `catch_up` waiting: the newest `catch_up` are kept and read into a cache that starts
    over (no gap in what the head sees); a step that tapped nothing starts it over too, and `catch_up=0` keeps
    nothing: the head's first step back drafts no tree (the control)."""
    model = tiny_model("llama")
    head = random_head(model).float()
    tokens, features = prompt_and_features(model, 24)
    steps = list(steps_of(tokens, features, [0, 10, 14, 18, 23]))
    drafter = Eagle3Drafter(Eagle3Config(depth=2, topk=2, width=2, catch_up=6), head)
    forgetful = Eagle3Drafter(Eagle3Config(depth=2, topk=2, width=2, catch_up=0), head)
    with torch.inference_mode():
        drafter.observe(*steps[0])
        drafter.sit_out(*steps[1])
        assert drafter.committed == 10 and drafter.last is not None
        drafter.sit_out(*steps[2])  # 8 waiting: the newest 6 kept, the cache starts over
        assert drafter.committed == 0 and drafter.last is None
        assert [positions for _, positions, _ in drafter.pending] == [[12, 13, 14, 15, 16, 17]]
        drafter.sit_out(*steps[3])  # 11 waiting: positions 17 .. 22
        assert len(drafter.propose(steps[3][0])) > 1
        assert drafter.committed == 6 and not drafter.pending
        ctx, outcome = steps[3]
        drafter.sit_out(ctx, replace(outcome, features=None))
        assert drafter.committed == 0 and drafter.last is None and not drafter.pending
        forgetful.observe(*steps[0])
        forgetful.sit_out(*steps[1])
        assert forgetful.committed == 0 and not forgetful.pending and len(forgetful.propose(steps[1][0])) == 1
