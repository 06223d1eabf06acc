"""One request never hurts another: a failure inside a shared batch step ends only the row it belongs to."""

from __future__ import annotations

import functools

import pytest
import torch

import forerun
from forerun.base.static_rows import static_rows
from forerun.batch import Batch, fork
from forerun.costmodel import LatencyCurve
from forerun.request import GenerationRequest
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


@pytest.mark.parametrize(("family", "static"), [("llama", False), ("llama", True), ("lfm2", False)])
@pytest.mark.parametrize("where", ["propose", "observe", "root"])
def test_a_failing_row_ends_alone_and_its_neighbours_stay_exact(where, family, static):
    """`static`: the rows at places of a static base (a GPU's batch). LFM2's rows feed chains together, their
    windows cut back row by row: a failed row's too."""
    model = model_of(family)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=static)
    honest = prompts(3)
    batch = Batch(model, decoder.budget, shared=static_rows(decoder.base, 4, 24 + NEW_TOKENS + 16))
    assert (batch.shared.__class__.__name__ == "StaticRows") == static
    jobs = []
    for index, prompt in enumerate([*honest, prompts(1, seed=9)[0]]):
        job = decoder.prepare(GenerationRequest(prompt, NEW_TOKENS, eos_token_id=())).job
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
        job = decoder.prepare(GenerationRequest(prompt, NEW_TOKENS, eos_token_id=())).job
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


@pytest.mark.parametrize(("method", "source"), [("trie", "trie"), ("jacobi", "jacobi")])
def test_tenants_never_draft_from_each_others_answers(method, source):
    """Tenant A's answer teaches A's state only: tenant B (another salt) sending A's prompt is drafted exactly as
    a fresh server would draft it, while A itself (and unsalted requests among themselves) profit."""
    model = model_of("llama")
    prompt = prompts(1, length=24, seed=5)[0]
    knobs = {"prompt_weight": 0.0} if method == "trie" else {}

    def accepted(decoder, salt):
        result = decoder.generate(prompt, 32, eos_token_id=[], cache_salt=salt)
        return result.stats.accepted_by.get(source, 0), result.sequences

    fresh = accepted(forerun.Decoder(model, None, method, latency=CURVE, **knobs), "b")
    shared = forerun.Decoder(model, None, method, latency=CURVE, **knobs)
    first_a = accepted(shared, "a")
    again_a = accepted(shared, "a")
    other_b = accepted(shared, "b")
    assert torch.equal(other_b[1], fresh[1]) and torch.equal(first_a[1], fresh[1])  # same text throughout
    assert other_b[0] == fresh[0]  # nothing of A's answer reached B
    assert again_a[0] > first_a[0]  # A learned from its own answer
    unsalted = [accepted(shared, None)[0] for _ in range(2)]
    assert unsalted[1] > unsalted[0] == fresh[0]  # the unsalted share among themselves, apart from A and B


def test_salted_state_is_bounded_and_the_oldest_salt_goes_first():
    from forerun.drafters.tenants import TenantState

    state = TenantState([], list, limit=3)
    for salt in ("a", "b", "c"):
        state.get(salt).append(salt)
    state.get("a")  # used again: "b" is now the least recently used
    state.get("d")
    assert list(state.salted) == ["c", "a", "d"] and state.get("b") == []


class Fuse:
    """A temperature that divides like 0.7 until its `at`-th use, then explodes (a processor failing mid-request)."""

    def __init__(self, at: int) -> None:
        self.uses, self.at = 0, at

    def __rtruediv__(self, scores: torch.Tensor) -> torch.Tensor:
        self.uses += 1
        if self.uses >= self.at:
            raise RuntimeError("processor exploded")
        return scores / 0.7


@pytest.mark.parametrize("static", [False, True])
def test_a_sampled_row_whose_processor_fails_among_rows_drawn_at_once_ends_alone(static, monkeypatch):
    """Rows drawn at once (as on a card) make their draws together; one row's processor failing there ends that row
    alone, and the others write what they write without it."""
    monkeypatch.setattr(forerun.verify.Sampling, "draws_at_once", lambda self, logits: True)
    model = model_of("llama")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=static)

    def run(hostile: bool) -> list:
        batch = Batch(model, decoder.budget, shared=static_rows(decoder.base, 4, 24 + NEW_TOKENS + 16))
        jobs = []
        for seed, prompt in enumerate([*prompts(3), prompts(1, seed=9)[0]][: 4 if hostile else 3]):
            request = GenerationRequest(prompt, NEW_TOKENS, eos_token_id=(), do_sample=True, seed=seed,
                                        generation={"temperature": 0.7})  # fmt: skip
            jobs.append(decoder.prepare(request).job)
            if seed == 3:
                next(p for p in jobs[-1].processor if hasattr(p, "temperature")).temperature = Fuse(at=4)
            batch.add(jobs[-1])
        finished = []
        while batch.rows:
            finished += batch.step()
        return [(job.transcript.sequence, next(r.error for r in finished if r.job is job)) for job in jobs]

    alone, beside = run(False), run(True)
    assert isinstance(beside[3][1], RuntimeError) and "exploded" in str(beside[3][1])
    for (text, error), (text_beside, error_beside) in zip(alone, beside[:3], strict=True):
        assert error is None and error_beside is None
        assert torch.equal(text, text_beside)
