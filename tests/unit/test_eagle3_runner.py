"""An EAGLE-3 drafter's head forwards on preallocated slots (`forerun.drafters.eagle3.runner`): rows padded as a
card's graphs pad them draft exactly as unpadded ones, a prompt longer than one chunk is read in chunks, a cache
that grows keeps what it held, a batch's copy of the drafter gets slots of its own, and on a card a captured
forward equals the eager one."""

from __future__ import annotations

import copy

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
