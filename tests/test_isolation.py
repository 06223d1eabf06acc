"""One request never hurts another: a failure inside a shared batch step ends only the row it belongs to."""

from __future__ import annotations

import functools

import pytest
import torch

import forerun
from forerun.batch import Batch, fork
from forerun.costmodel import LatencyCurve
from forerun.tree import TokenTree

from tiny_models import prompts, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16), (1.0, 1.0, 1.0, 1.1, 1.3))
NEW_TOKENS = 24


class Faulty:
    """A drafter that proposes nothing until step `at`, then fails where it is told to (`propose`, `observe`), or
    returns a tree rooted at the wrong token (`root`: the budget's merge refuses it)."""

    name = "faulty"

    def __init__(self, where: str, at: int = 3) -> None:
        self.where, self.at, self.steps = where, at, 0

    def start(self, ctx) -> None:
        pass

    def propose(self, ctx) -> TokenTree:
        self.steps += 1
        if self.steps >= self.at and self.where == "propose":
            raise RuntimeError("drafter exploded in propose")
        if self.steps >= self.at and self.where == "root":
            return TokenTree.rooted_at(ctx.tokens[-1] + 1)
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        tree.add(0, 5)
        return tree

    def observe(self, ctx, outcome) -> None:
        if self.steps >= self.at and self.where == "observe":
            raise RuntimeError("drafter exploded in observe")

    def finish(self, ctx) -> None:
        pass


@functools.lru_cache(maxsize=2)
def model_of(family: str) -> torch.nn.Module:
    return tiny_model(family, "sdpa")


def plain(model, prompt: torch.Tensor) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize("where", ["propose", "observe", "root"])
def test_a_failing_row_ends_alone_and_its_neighbours_stay_exact(where):
    model = model_of("llama")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    honest = prompts(3)
    batch = Batch(model, decoder.budget)
    jobs = []
    for index, prompt in enumerate([*honest, prompts(1, seed=9)[0]]):
        job, _ = decoder.prepare(prompt, NEW_TOKENS, eos_token_id=[])
        if index == 3:  # the hostile row
            job.drafters = [Faulty(where)]
        else:
            job.drafters = fork(decoder.drafters)
        jobs.append(job)
        batch.add(job)
    finished = []
    while batch.rows:
        finished += batch.step()
    errors = {id(row.job): row.error for row in finished}
    assert isinstance(errors[id(jobs[3])], (RuntimeError, ValueError)), errors
    for prompt, job in zip(honest, jobs[:3], strict=True):
        assert errors[id(job)] is None
        assert torch.equal(job.transcript.sequence, plain(model, prompt))


def test_without_isolation_the_whole_batch_would_fail():
    """The negative control: the same hostile row through `Batch.choose` directly raises for every row."""
    model = model_of("llama")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    batch = Batch(model, decoder.budget)
    for prompt in prompts(2):
        job, _ = decoder.prepare(prompt, NEW_TOKENS, eos_token_id=[])
        batch.add(job)
    hostile = [TokenTree.rooted_at(batch.rows[0].ctx.tokens[-1] + 1)]
    honest = [TokenTree.rooted_at(batch.rows[1].ctx.tokens[-1])]
    with pytest.raises(ValueError, match="cannot graft"):
        batch.choose([hostile, honest])
    selections = batch.choose_apart([hostile, honest])  # apart: the hostile row alone is failed
    assert isinstance(batch.rows[0].error, ValueError) and batch.rows[1].error is None
    assert len(selections) == 2


def test_a_library_batch_still_raises_the_failing_rows_error():
    model = model_of("llama")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, drafters=[Faulty("propose", at=2)])
    with pytest.raises(RuntimeError, match="exploded"):
        decoder.generate(prompts(2), NEW_TOKENS, eos_token_id=[])


@pytest.mark.parametrize("knob", ["prompt_weight", "output_weight"])
def test_trie_weights_have_a_ceiling(knob):
    with pytest.raises(ValueError, match=f"TrieConfig.{knob} must be a number >= 0 and <= 1e\\+06"):
        forerun.TrieConfig(**{knob: 1e308})
    forerun.TrieConfig(**{knob: 1e6})


def test_a_non_finite_score_is_no_guess_for_the_cost_model():
    from forerun.costmodel import Calibration

    calibration = Calibration()
    for score in (float("inf"), float("-inf"), float("nan")):
        assert calibration.estimate("trie", 1, score) == 0.0
