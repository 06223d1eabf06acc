"""A batch on the static base's places (a GPU's batched path; on a CPU the same bucketed forward, eager or compiled)
gives every row plain generate's tokens: rows at their own prefix lengths, joining into free places, moved down as
others leave, their paths committed in one gather."""

from __future__ import annotations

import functools

import pytest
import torch

import forerun
from forerun.base.rows import RowsLogits
from forerun.base.static import StaticBase
from forerun.base.static_rows import StaticRows
from forerun.batch import batchable
from forerun.costmodel import LatencyCurve
from forerun.tree import TokenTree
from forerun.verify import Sampling

from helpers import OracleDrafter
from tiny_models import FAMILIES, GROUPED, NO_SDPA, VOCAB, prompts, register_grouped, tiny_model

CASES = [(f, impl) for f in FAMILIES for impl in ("eager", "sdpa") if not (impl == "sdpa" and f in NO_SDPA)]
CASES += [(f, register_grouped()) for f in GROUPED if f not in NO_SDPA]  # grouped heads read in place
NEW_TOKENS = 24
CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3))
"""A GPU's shape: wide trees are nearly free, so rows draft and buckets get padded."""
METHODS = {
    "plain": {},
    "prompt_lookup": {"max_ngram": 2, "draft_len": 5, "max_branches": 2},
    "auto": {},
}


@functools.lru_cache(maxsize=4)
def model_of(family: str, impl: str) -> torch.nn.Module:
    return tiny_model(family, impl)


@functools.lru_cache(maxsize=128)
def reference(family: str, impl: str, index: int, length: int, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    prompt = prompts(5, length=length)[index]
    return model_of(family, impl).generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                           pad_token_id=0)  # fmt: skip


def row_steps(decoder: forerun.Decoder, places: int) -> set[tuple[int, int, bool]]:
    return set(decoder.base.siblings[places].steps)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(("family", "impl"), CASES)
def test_a_batch_on_places_equals_generate(family, impl, method):
    """Three prompts of different lengths (so the rows' prefix lengths differ) in one batch of three places."""
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, method, latency=CURVE, static_cache=True, **METHODS[method])
    lengths = (12, 24, 17)
    batch = [prompts(5, length=length)[i] for i, length in enumerate(lengths)]
    results = decoder.generate([p[0].tolist() for p in batch], NEW_TOKENS, eos_token_id=[])
    for i, (length, result) in enumerate(zip(lengths, results, strict=True)):
        expected = reference(family, impl, i, length)
        assert torch.equal(result.sequences, expected[:, : result.sequences.shape[1]]), (family, impl, method, i)
        assert result.sequences.shape[1] == expected.shape[1] or result.stats.fallback_reason
    if not batchable(model):  # a sliding window's ring or no tree masks: rows one at a time, the single base's
        assert 3 not in decoder.base.siblings
        return
    steps = row_steps(decoder, 3)
    assert any(rows > 1 for rows, _, _ in steps)  # the rows were stepped together
    assert not any(placed for _, _, placed in steps)  # the prompts went in side by side, in the rows' forwards
    if any(result.stats.candidates for result in results):  # drafts were fed: in buckets past the undrafted one
        assert {size for _, size, _ in steps} - {1, 32}, sorted(steps)  # (32: the prompts' forward)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_rows_join_free_places_and_move_down_as_others_leave(family):
    """Five prompts through two places, each with its own length of answer: rows leave at different steps, the
    waiting ones join the freed places, and once one row is left in place 1 it moves to place 0 (one row's
    forward). Every answer is generate's."""
    model = model_of(family, "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=True, max_ngram=2)
    news = (6, 20, 9, 14, 30)
    requests = [
        forerun.GenerationRequest(prompts(5, length=20)[i][0].tolist(), new, eos_token_id=())
        for i, new in enumerate(news)
    ]
    results = decoder.generate(requests, batch_size=2)
    for i, (new, result) in enumerate(zip(news, results, strict=True)):
        assert torch.equal(result.sequences, reference(family, "sdpa", i, 20, new)), (family, i)
    steps = row_steps(decoder, 2)
    assert any(rows == 2 for rows, _, placed in steps if not placed)
    assert any(rows == 1 for rows, _, placed in steps if not placed)  # the last row, moved to place 0


class Oracles(OracleDrafter):
    """An oracle for several rows: the truth whose beginning is the row's text."""

    def __init__(self, truths: list[list[int]], depth: int, vocab: int) -> None:
        super().__init__(truths[0], depth, vocab)
        self.truths = truths

    def propose(self, ctx):
        self.truth = next((t for t in self.truths if t[: len(ctx.tokens)] == list(ctx.tokens)), self.truths[0])
        return super().propose(ctx)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_oracle_drafts_of_rows_on_places_are_gathered_into_place(family):
    """Each row's oracle follows a decoy branch, so every accepted path starts off node 1 and is gathered (in one
    gather for all rows) to the front of the row's new slots; rows of different lengths, generate's output."""
    model = model_of(family, "sdpa")
    lengths = (24, 13, 19)
    truths = [reference(family, "sdpa", i, length, 40) for i, length in enumerate(lengths)]
    oracle = Oracles([t[0].tolist() for t in truths], 6, VOCAB)
    decoder = forerun.Decoder(model, None, "plain", drafters=[oracle], max_tree_nodes=16, latency=CURVE,
                              static_cache=True)  # fmt: skip
    batch = [prompts(5, length=length)[i][0].tolist() for i, length in enumerate(lengths)]
    results = decoder.generate(batch, 40, eos_token_id=[])
    for truth, result in zip(truths, results, strict=True):
        assert torch.equal(result.sequences, truth)
        assert result.stats.tokens_per_forward > 2.5  # several tokens a step, each path off the decoy's node 1
    assert any(rows > 1 for rows, _, _ in row_steps(decoder, 3))


def test_negative_control_rows_that_skip_the_gather_are_caught():
    """Rows whose accepted paths are not gathered into place attend to the decoy branch's keys: the output
    departs from generate's, so the equality tests above can fail."""
    model = model_of("llama", "sdpa")
    truth = reference("llama", "sdpa", 0, 24, 40)[0].tolist()
    decoder = forerun.Decoder(model, None, "plain", drafters=[Oracles([truth], 6, VOCAB)], max_tree_nodes=16,
                              latency=CURVE, static_cache=True)  # fmt: skip
    base = decoder.base.sibling(2)
    base.commit_rows = lambda kept: None  # the paths stay where the tree put them
    prompt = prompts(5, length=24)[0][0].tolist()
    results = decoder.generate([prompt, prompt], 40, eos_token_id=[])
    assert not torch.equal(results[0].sequences, torch.tensor([truth]))


def test_sampled_rows_repeat_with_their_seeds_and_match_the_growing_cache():
    model = model_of("qwen2", "sdpa")
    batch = [p[0].tolist() for p in prompts(3, length=18)]
    texts = []
    for static in (True, True, False):
        decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=static)
        outs = decoder.generate(batch, 24, do_sample=True, seed=3, temperature=1.2, eos_token_id=[])
        texts.append([out.sequences for out in outs])
    for first, again, dynamic in zip(*texts, strict=True):
        assert torch.equal(first, again) and torch.equal(first, dynamic)


def sampled_rows(static: bool, logits_of_row=None, at_once: bool = False) -> list[torch.Tensor]:
    """Four sampled requests of different lengths through two rows: rows leave at different steps and the waiting
    ones take the freed places, so row b is not always place b (`RowsLogits.at`). `logits_of_row`: a replacement
    for `RowsLogits.row` (the negative control); `at_once`: every node drawn at once, as on a card
    (`Sampling.at_once`)."""
    model = model_of("qwen2", "sdpa")
    news = (5, 16, 9, 12)
    requests = [
        forerun.GenerationRequest(p[0].tolist(), new, eos_token_id=(), do_sample=True, seed=7 + i,
                                  generation={"temperature": 1.3})
        for i, (p, new) in enumerate(zip(prompts(4, length=18), news, strict=True))
    ]  # fmt: skip
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=static)
    with pytest.MonkeyPatch.context() as patch:
        if logits_of_row is not None:
            patch.setattr(RowsLogits, "row", logits_of_row)
        if at_once:
            patch.setattr(Sampling, "draws_at_once", lambda self, logits: True)
        return [out.sequences for out in decoder.generate(requests, batch_size=2)]


@pytest.mark.parametrize("at_once", [False, True])
def test_sampled_rows_read_their_own_places_logits_after_rows_leave(at_once):
    """Sampling reads each row's logits (greedy reads only the copied argmaxes): rows on places draw what the
    growing cache's rows draw, seed for seed, walking or drawn at once; reading row b's logits at place b instead
    is caught."""
    dynamic = sampled_rows(False)
    assert all(torch.equal(a, b) for a, b in zip(sampled_rows(True, at_once=at_once), dynamic, strict=True))
    by_index = sampled_rows(True, lambda out, b, nodes: out.logits[b, :nodes], at_once)
    assert not all(torch.equal(a, b) for a, b in zip(by_index, dynamic, strict=True))


def test_compiled_rows_give_the_eager_rows_tokens():
    """A batch's (rows, bucket) forwards through torch.compile (inductor on this CPU), the joining prompts' one-place
    forwards too: generate's tokens for every row, in a batch of 2 and then of 3 rows (two siblings sharing one
    program; a few compilations: about a minute). The 3 rows' answers end at different steps: the last row left,
    at place 0, is fed as a placed row (`StaticBase.lone_placed`: no program of its own)."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", max_tree_nodes=4, adaptive=False, draft_len=3,
                              max_branches=1, static_cache=True, compile_buckets=True)  # fmt: skip
    decoder.base = StaticBase(model, buckets=(1, 4), compiled=True)
    for lengths, news in (((12, 24), (NEW_TOKENS,) * 2), ((17, 12, 24), (NEW_TOKENS, 8, 14))):
        batch = [forerun.GenerationRequest(prompts(5, length=length)[i][0].tolist(), new, eos_token_id=())
                 for i, (length, new) in enumerate(zip(lengths, news, strict=True))]  # fmt: skip
        results = decoder.generate(batch)
        for i, (length, new, result) in enumerate(zip(lengths, news, results, strict=True)):
            assert torch.equal(result.sequences, reference("llama", "sdpa", i, length, new)), (lengths, i)
    two, three = decoder.base.siblings[2], decoder.base.siblings[3]
    assert two.compiled and any(rows == 2 for rows, _, _ in two.steps) and any(rows == 3 for rows, _, _ in three.steps)
    assert two.program is three.program is not decoder.base.program
    assert (1, 1, True) in three.steps and not any(rows == 1 and not placed for rows, _, placed in three.steps)


@torch.inference_mode()
def test_a_second_row_count_compiles_little_or_nothing():
    """Every row count's base (a sibling) shares its maker's compiled program: warming 4 places after 2 compiles
    fewer programs than 2 did (nothing, here), where a program per sibling compiled the whole set again (a 16-row
    warm-up on a card met ~26 programs of tens of seconds each, and did not finish in 8 minutes)."""
    from torch._dynamo.utils import counters

    base = StaticBase(model_of("llama", "sdpa"), buckets=(1, 4), compiled=True)
    base.warm(48)

    def compiled_by_warming(places: int) -> int:
        before = counters["stats"]["unique_graphs"]
        sibling = base.sibling(places)
        sibling.warm(48, sibling.row_buckets, placed=True)
        return counters["stats"]["unique_graphs"] - before

    first = compiled_by_warming(2)
    assert first >= 2 and compiled_by_warming(4) < first


def test_a_compiled_16_row_warm_up_stays_compiled():
    """What a server with compiled buckets does at start: its batch budget times siblings of 2, 4 and 8 places, its
    warm-up makes every (rows, bucket) of 16. The programs the siblings share stay under dynamo's limit of 8 per
    function, past which every new variant runs eagerly: no program traces the cache's first allocation (a variant
    for each sibling's empty cache and place count took them past it). They are four: a placed row and many rows,
    each for one node and for more; a lone row is fed as a placed one (one family fewer, two programs of tens of
    seconds each on a card's host), and every count of many rows shares one program from the first."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    decoder = forerun.Decoder(model_of("llama", "sdpa"), None, "auto", static_cache=True, compile_buckets=True,
                              latency_cache=None)  # fmt: skip
    decoder.batch_budget()
    decoder.warm_up(48, batch_size=16)
    shared = decoder.base.sibling(16).program
    assert shared is decoder.base.sibling(2).program
    assert len(_debug_get_cache_entry_list(shared._torchdynamo_orig_callable.__code__)) == 4
    assert not any(rows == 1 and not placed for rows, _, placed in decoder.base.sibling(16).steps)


def test_a_batch_budget_on_the_static_base_times_its_siblings(tmp_path):
    """A static base's batches are priced on its own batched steps (siblings of 2, 4 and 8 places), stored with
    the static base's curve; the single row's curve stays the static base's."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", static_cache=True, latency_cache=tmp_path)
    single = decoder.budget.curve
    assert single.sizes == tuple(range(1, 65))  # the buckets' curve
    curve = decoder.batch_budget().curve
    assert curve.sizes == single.sizes and [rows for rows, _ in curve.batched] == [2, 4, 8]
    assert {2, 4, 8} <= set(decoder.base.siblings)
    assert all(rows_curve.seconds[0] > 0 for _, rows_curve in curve.batched)
    again = forerun.Decoder(model, None, "prompt_lookup", static_cache=True, latency_cache=tmp_path)
    assert again.batch_budget().curve == curve and not again.base.siblings  # read back, not measured


@torch.inference_mode()
def test_a_base_that_grows_while_it_holds_rows_keeps_their_slots():
    """A longer request joining allocates more slots: the rows already held keep theirs, so their next step's
    logits are those of a base that never grew (and a fresh buffer's would not be)."""
    model = model_of("llama", "sdpa")
    prompt = prompts(5, length=20)[0][0].tolist()
    logits = []
    for grow in (False, True):
        base = StaticBase(model, places=2)
        base.begin(100)
        base.forward(TokenTree.rooted_at(prompt[-1]), len(prompt) - 1, prompt[:-1], place=1)
        if grow:
            length = base.length
            base.begin(length + 1)
            assert base.length > length and not base.steps  # the graphs of the old buffer are gone
        step, _ = base.forward_rows({1: (TokenTree.rooted_at(prompt[0]), len(prompt))})
        logits.append(step[1])
    assert torch.equal(logits[0], logits[1])


def test_rows_started_afresh_keep_the_places_of_rows_still_joining():
    """A server's batch whose step failed starts afresh; a request still reading its prompt keeps its place, so
    a new request never takes it (it would write over that prompt's slots)."""
    model = model_of("llama", "sdpa")
    rows = StaticRows(StaticBase(model, places=3))
    first, _ = rows.open(None, [5, 6, 7], 64)
    second, _ = rows.open(None, [5, 6, 7], 64)
    rows.admit(first, 2, [0], None, [5, 6, 7])
    fresh = rows.without_rows()
    assert fresh.held == [] and fresh.open(None, [5, 6], 64)[0] not in {second}
    fresh.admit(second, 2, [0], None, [5, 6, 7])
    assert fresh.held == [second]


@pytest.mark.parametrize("static", [False, True])
def test_a_batch_budget_measured_without_a_store_keeps_the_single_rows_curve(static):
    """latency_cache=None: the batched rows are measured and added; the single row's curve is kept as it was
    measured (measuring it again would change the choices a single row already made on it)."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", static_cache=static, latency_cache=None)
    single = decoder.budget.curve
    curve = decoder.batch_budget().curve
    assert (curve.sizes, curve.seconds) == (single.sizes, single.seconds) and curve.batched
