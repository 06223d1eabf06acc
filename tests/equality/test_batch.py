"""Batched decoding: each row of a batch equals plain greedy `model.generate` of that prompt alone (fp32), for
every method, across the family matrix, with ragged prompts, ragged acceptance and rows that end apart."""

from __future__ import annotations

import functools
import time
from collections import Counter

import pytest
import torch
from transformers import MaxLengthCriteria, StoppingCriteriaList

import forerun
from forerun.base.static_rows import static_rows
from forerun.batch import Batch, RowJob
from forerun.batched import decode_batch
from forerun.costmodel import CostModel, LatencyCurve, StaticBudget, best_shared_count
from forerun.forward_inputs import cache_argument
from forerun.noise import GumbelNoise
from forerun.rowcache import RowCache
from forerun.transcript import Transcript
from forerun.tree import TokenTree
from forerun.verify import Sampling

from helpers import OracleDrafter, RandomDrafter
from tiny_models import FAMILIES, NO_SDPA, VOCAB, prompts, tiny_model

CASES = [(f, impl) for f in FAMILIES for impl in ("eager", "sdpa") if not (impl == "sdpa" and f in NO_SDPA)]
NEW_TOKENS = 32
CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64, 128), (1.0, 1.0, 1.0, 1.1, 1.3, 1.7, 2.6, 4.4))
"""A flat-then-rising curve (this CPU's bf16 shape): trees pay for small batches, less so for large ones."""
METHODS = {
    "plain": {},
    "prompt_lookup": {"max_ngram": 2, "draft_len": 5},
    "trie": {"decoding_length": 8, "branch_length": 4},
    "auto": {},
}


def ragged_prompts() -> list[torch.Tensor]:
    """Four prompts [1, L] of lengths 24, 10, 17 and 1 (a one-token prompt has nothing to prefill)."""
    base = prompts(3)
    return [base[0], base[1][:, :10], base[2][:, :17], prompts(4, seed=3)[3][:, :1]]


@functools.lru_cache(maxsize=4)
def model_of(family: str, impl: str) -> torch.nn.Module:
    return tiny_model(family, impl)


@functools.lru_cache(maxsize=256)
def single(family: str, impl: str, index: int, eos: int | None, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    prompt = ragged_prompts()[index]
    return model_of(family, impl).generate(
        prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(("family", "impl"), CASES)
def test_each_row_equals_generate_of_its_prompt_alone(family, impl, method):
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, method, latency=CURVE, **METHODS[method])
    batch = [p[0].tolist() for p in ragged_prompts()]
    results = decoder.generate(batch, NEW_TOKENS, eos_token_id=[])
    assert len(results) == len(batch)
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, single(family, impl, index, None)), (family, impl, method, index)
        assert result.prompt_len == len(batch[index]) and result.stats.new_tokens == NEW_TOKENS
    # An EOS that row 0 meets half-way: row 0 leaves the batch early, the others go on, each as alone.
    eos = int(single(family, impl, 0, None)[0, len(batch[0]) + NEW_TOKENS // 2])
    results = decoder.generate(batch, NEW_TOKENS, eos_token_id=eos)
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, single(family, impl, index, eos)), (family, impl, method, index, "eos")
    assert results[0].stats.new_tokens < NEW_TOKENS


@pytest.mark.parametrize("method", ["jacobi", "prompt_lookup+trie", "jacobi+trie"])
@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("gpt2", "eager"), ("qwen3", "eager")])
def test_other_methods_batched_equal_generate(family, impl, method):
    decoder = forerun.Decoder(model_of(family, impl), None, method, latency=CURVE)
    results = decoder.generate([p[0].tolist() for p in ragged_prompts()], NEW_TOKENS, eos_token_id=[])
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, single(family, impl, index, None)), (family, impl, method, index)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_draft_model_batched_equals_generate(impl):
    target = model_of("llama", impl)
    draft = tiny_model("llama", impl, seed=1)
    decoder = forerun.Decoder(target, None, "draft_model", draft_model=draft, gamma=4)
    results = decoder.generate([p[0].tolist() for p in ragged_prompts()], NEW_TOKENS, eos_token_id=[])
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, single("llama", impl, index, None)), (impl, index)


def jobs_for(model, rows, drafters_per_row, max_new=NEW_TOKENS):
    jobs = []
    for prompt, drafters in zip(rows, drafters_per_row, strict=True):
        criteria = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + max_new)])
        jobs.append(RowJob(prompt, Transcript(prompt.clone(), criteria), drafters, frozenset(), max_new))
    return jobs


@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("gpt2", "eager"), ("falcon", "sdpa")])
def test_rows_that_accept_very_different_lengths_stay_exact(family, impl):
    """An oracle on row 0 (5 tokens accepted per step), a drafter that is always wrong on row 1: the cache gets
    holes every step, is compacted, and both rows still equal their single runs."""
    model = model_of(family, impl)
    rows = ragged_prompts()[:2]
    truths = [single(family, impl, i, None)[0].tolist() for i in range(2)]
    drafters = [[OracleDrafter(truths[0], 5, VOCAB)], [RandomDrafter(truths[1], VOCAB)]]
    jobs = jobs_for(model, rows, drafters)
    stats = decode_batch(model, jobs, StaticBudget(24))
    for index, job in enumerate(jobs):
        assert job.transcript.sequence[0].tolist() == truths[index], (family, impl, index)
    assert stats[0].accepted_by["oracle"] >= NEW_TOKENS // 2 and stats[1].accepted == 0
    assert stats[0].forwards < stats[1].forwards


def test_row_cache_keeps_each_rows_path_and_compacts_holes():
    """The module docstring's picture, by hand: keys hold each slot's own number so the gathers can be read."""
    cache = RowCache(tiny_model("llama").config)
    cache.visible = torch.tensor([[True] * 4, [False, True, True, True]])
    for layer in cache.cache.layers:
        keys = torch.arange(2 * 7, dtype=torch.float32).reshape(2, 1, 7, 1)  # 4 slots + 3 tree nodes per row
        layer.lazy_initialization(keys, keys)
        layer.keys, layer.values = keys, keys.clone()
    cache.keep([[0, 2, 1], [0]], nodes=3)  # row 0 keeps root, node 2, node 1; row 1 the root alone
    layer = cache.cache.layers[0]
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 5]
    assert layer.keys[1, 0, 4:, 0].tolist() == [11, 11, 11]  # holes repeat the last kept node, never seen
    assert cache.visible.tolist() == [[True] * 7, [False, True, True, True, True, False, False]]
    cache.compact(force=True)
    assert cache.visible.tolist() == [[True] * 7, [False, False, False, True, True, True, True]]
    assert layer.keys[1, 0, 3:, 0].tolist() == [8, 9, 10, 11] and layer.keys[0, 0, :, 0].tolist() == [
        0,
        1,
        2,
        3,
        4,
        6,
        5,
    ]


def test_compacting_happens_only_when_it_frees_slots():
    """Holes beside a much longer row (its padding) cannot be squeezed out: no copy of the cache for nothing;
    once the long row leaves, its slots go."""
    cache = RowCache(tiny_model("llama").config)
    cache.visible = torch.tensor([[True] * 10, [False] * 8 + [True] * 2, [False] * 9 + [True]])
    for layer in cache.cache.layers:
        keys = torch.arange(3 * 10, dtype=torch.float32).reshape(3, 1, 10, 1)
        layer.lazy_initialization(keys, keys)
        layer.keys, layer.values = keys, keys.clone()
    before = cache.cache.layers[0].keys
    cache.compact()  # 17 holes of 30 slots, but the first row needs all 10: nothing to free
    assert cache.cache.layers[0].keys is before and cache.slots == 10
    cache.drop([1, 2])  # the long row leaves: 8 of 10 slots are nobody's
    assert cache.slots == 2 and cache.visible.tolist() == [[True, True], [False, True]]
    keys = cache.cache.layers[0].keys[:, 0, :, 0]
    assert keys[0].tolist() == [18, 19] and keys[1, 1] == 29  # each row's own slots, right-aligned


def one_row_cache(config, numbers: list[float]) -> forerun.batch.DynamicCache:
    """A one-row cache whose keys (and values) in every layer are `numbers`, one per slot."""
    row = forerun.batch.DynamicCache(config=config)
    for index in range(len(row.layers)):
        keys = torch.tensor(numbers).reshape(1, 1, len(numbers), 1)
        row.update(keys, keys.clone(), index)
    return row


def test_a_joining_row_takes_a_leaving_rows_place_in_place():
    """A row that leaves keeps its place until the next step: a row joining before then is written into it (no copy
    of the other rows), right-aligned, growing the cache on the left only when it is the longer; places still
    vacant at the next step go. Keys hold readable numbers."""
    config = tiny_model("llama").config
    cache = RowCache(config)
    for numbers in ([1.0, 2, 3, 4], [5.0, 6, 7], [8.0, 9, 10, 11]):
        assert cache.add(one_row_cache(config, numbers), len(numbers)) == cache.visible.shape[0] - 1
    before = cache.cache.layers[0].keys
    cache.vacate([1])
    assert cache.places() == [0, 2] and not cache.visible[1].any()
    assert cache.add(one_row_cache(config, [20.0, 21]), 2) == 1  # the second row of the batch again
    layer = cache.cache.layers[0]
    assert layer.keys is before and layer.keys[1, 0, 2:, 0].tolist() == [20, 21]
    assert cache.visible.tolist() == [[True] * 4, [False, False, True, True], [True] * 4]
    cache.vacate([0])
    assert cache.add(one_row_cache(config, [30.0, 31, 32, 33, 34, 35]), 6) == 0  # longer: every row is left-padded
    assert cache.slots == 6 and layer.keys[0, 0, :, 0].tolist() == [30, 31, 32, 33, 34, 35]
    assert layer.keys[2, 0, 2:, 0].tolist() == [8, 9, 10, 11] and layer.keys[1, 0, 4:, 0].tolist() == [20, 21]
    assert cache.visible.tolist() == [[True] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4]
    cache.vacate([2])
    cache.settle()  # nobody took the place: it goes
    assert cache.places() == [0, 1] and cache.visible.shape == (2, 6) and not cache.vacant
    assert layer.keys.shape[0] == 2 and cache.cache.layers[0].keys[1, 0, 4:, 0].tolist() == [20, 21]


def test_a_batch_measures_again_when_its_cache_changes_length_manyfold():
    """What drafting cost beside a long row (paused proposals, slow drafted forwards) is forgotten once the cache is
    more than twice or less than half as long; within that it stands."""
    model = model_of("llama", "sdpa")
    batch = Batch(model, forerun.Decoder(model, None, "auto", latency=CURVE).budget)
    batch.shared.cache.visible = torch.ones(2, 2000, dtype=torch.bool)
    batch.policy.rebase(batch.shared.slots)  # a long row joined: from 1 slot to 2000
    batch.policy.switch.paused, batch.policy.measured[True] = 64, 5.0
    batch.shared.cache.visible = torch.ones(2, 1100, dtype=torch.bool)
    batch.policy.rebase(batch.shared.slots)
    assert batch.policy.switch.paused == 64 and batch.policy.measured[True] == 5.0
    batch.shared.cache.visible = torch.ones(2, 900, dtype=torch.bool)  # the long row left: under half
    batch.policy.rebase(batch.shared.slots)
    policy = batch.policy
    assert policy.switch.drafting() and policy.measured == {False: 1.0, True: 1.0} and policy.measured_at == 900


def test_rows_join_a_running_batch_and_leave_on_their_own():
    """Continuous batching: a row added after two steps of another still equals its single run."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    rows = ragged_prompts()
    batch = Batch(model, decoder.budget)
    jobs = jobs_for(model, rows[:3], [forerun.batch.fork(decoder.drafters) for _ in range(3)])
    batch.add(jobs[0])
    batch.step()
    batch.step()
    batch.add(jobs[1])
    batch.step()
    batch.add(jobs[2])
    finished = []
    while batch.rows:
        finished += batch.step()
    assert len(finished) == 3
    for index, job in enumerate(jobs):
        assert torch.equal(job.transcript.sequence, single("llama", "sdpa", index, None)), index


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("gpt2", "eager"), ("qwen2", "eager")])
def test_a_prompt_fed_in_chunks_joins_while_the_running_row_steps(family, impl, static):
    """`begin` + `feed(chunk=5)`: the 24-token prompt goes in 4 causal chunks of 5 and a last forward of 3 with
    its first token; the running row steps between chunks (as the server interleaves them); both rows, and a
    prompt whose head came from the prefix cache before its chunks, equal their single runs. On the growing cache
    and on the static base's places (a GPU's server batch)."""
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, static_cache=static)

    def new_batch() -> Batch:
        return Batch(model, decoder.budget, shared=static_rows(decoder.base, 3, 128) if static else None)

    rows = ragged_prompts()
    batch = new_batch()
    running, long = jobs_for(model, [rows[1], rows[0]], [forerun.batch.fork(decoder.drafters) for _ in range(2)])
    batch.add(running)
    joining = batch.begin(long)
    steps = 0
    while (row := batch.feed(joining, chunk=5)) is None:
        batch.step()
        steps += 1
    assert steps == 4 and row.stats.prefill_chunks == 5 and batch.rows[1] is row
    with pytest.raises(ValueError, match="chunk must be"):
        batch.feed(batch.begin(jobs_for(model, [rows[2]], [[]])[0]), chunk=0)
    assert len(running.transcript.sources) >= 1 + steps  # the running row wrote a token or more per chunk
    while batch.rows:
        batch.step()
    assert torch.equal(running.transcript.sequence, single(family, impl, 1, None))
    assert torch.equal(long.transcript.sequence, single(family, impl, 0, None))
    # a head from the prefix cache, the rest in chunks: 8 tokens seeded, 15 left before the root: 2 chunks of 5 and
    # a last forward of 5 with the first token
    prefixes = forerun.prefixcache.PrefixCache()
    seed_job = jobs_for(model, [rows[0][:, :8]], [[]], max_new=1)[0]
    seed_job.prefixes = prefixes
    new_batch().add(seed_job)
    (again,) = jobs_for(model, [rows[0]], [forerun.batch.fork(decoder.drafters)])
    again.prefixes = prefixes
    batch = new_batch()
    joining = batch.begin(again)
    assert joining.fed == 8 and joining.left == 16
    while (row := batch.feed(joining, chunk=5)) is None:
        pass
    assert row.stats.prefill_chunks == 3 and row.stats.cached_prompt_tokens == 8
    while batch.rows:
        batch.step()
    assert torch.equal(again.transcript.sequence, single(family, impl, 0, None))


def test_the_per_row_budget_shrinks_as_the_batch_grows():
    """On a curve that turns linear past 16 tokens (compute-bound), big batches stop drafting altogether."""
    steep = LatencyCurve((1, 8, 16, 128), (1.0, 1.2, 2.0, 16.0))
    chances = [0.6, 0.4, 0.2]
    counts = [best_shared_count([chances] * rows, steep) for rows in (1, 2, 4, 8, 16, 32)]
    assert counts == sorted(counts, reverse=True) and counts[0] == 3 and counts[-1] == 0, counts


def test_left_padded_batch_through_custom_generate_equals_plain_batched_generate():
    model = model_of("llama", "sdpa")
    rows = ragged_prompts()[:3]
    width = max(p.shape[1] for p in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - p.shape[1] :], mask[i, width - p.shape[1] :] = p[0], 1
    eos = int(single("llama", "sdpa", 1, None)[0, rows[1].shape[1] + 5])  # row 1 ends early: padded after EOS
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = model.generate(**common, eos_token_id=eos)
    got = model.generate(**common, eos_token_id=eos, custom_generate=forerun.hf_generate, forerun_method="auto")
    assert torch.equal(got, expected)
    right = torch.flip(mask, [1])
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(
            input_ids=ids, attention_mask=right, max_new_tokens=4, pad_token_id=0, custom_generate=forerun.hf_generate
        )


def test_seeded_batched_sampling_repeats_and_rows_differ():
    model = model_of("llama", "sdpa")
    batch = [ragged_prompts()[0][0].tolist()] * 3
    runs = [
        [
            r.new_tokens
            for r in forerun.Decoder(model, None, "prompt_lookup").generate(batch, 12, do_sample=True, seed=7)
        ]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]  # a fresh Decoder and the same seed: the same samples
    assert len({tuple(row) for row in runs[0]}) > 1  # row i draws from seed + i


@pytest.mark.parametrize(
    ("prompts_given", "kwargs", "message"),
    [
        ([], {}, "empty"),
        (["hi", [{"role": "user", "content": "hi"}]], {}, "mixes raw text prompts and chat"),
        ([[5, 6], []], {}, "prompt 1: prompt is empty"),
        ([[5, 6], [7, 10_000]], {}, "prompt 1: prompt has token ids outside"),
        ([[5, 6], [7, 8]], {"streamer": object()}, "streamer"),
        ([[5, 6], [7, 8]], {"prediction": [5, 6]}, "prediction"),
        ([[5, 6], [7, 8]], {"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_batches_are_clear_errors(prompts_given, kwargs, message):
    decoder = forerun.Decoder(model_of("llama", "sdpa"), None, "prompt_lookup", latency=CURVE)
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        decoder.generate(prompts_given, **kwargs)


def test_batched_sampling_keeps_the_distribution_per_row():
    """Rows of one batch sample independently from plain generate's distribution (chi-square per row and pooled);
    a biased verifier fails the same pooled test (the negative control, so the test has power)."""
    from test_sampling import (
        ALPHA,
        NEW,
        PROMPT,
        SAMPLES,
        biased_verifier,
        decoder_for,
        homogeneity_pvalue,
        peaked_model,
        plain_counts,
        transformers_processors,
    )

    rows = 4
    model = peaked_model()
    processors = transformers_processors(model, {"temperature": 0.7})

    def counts(verifier=None) -> tuple[list[Counter], int]:
        decoder = decoder_for("prompt_lookup")
        generator = torch.Generator().manual_seed(11)
        per_row, accepted = [Counter() for _ in range(rows)], 0
        for _ in range(SAMPLES // rows):
            jobs = jobs_for(model, [PROMPT] * rows, [forerun.batch.fork(decoder.drafters) for _ in range(rows)], NEW)
            for job in jobs:
                noise = GumbelNoise.drawn(generator)
                job.processor, job.sampling = processors, Sampling(noise, *([verifier] if verifier else []))
            stats = decode_batch(model, jobs, decoder.budget)
            for row, job in enumerate(jobs):
                per_row[row][tuple(job.transcript.sequence[0, PROMPT.shape[1] :].tolist())] += 1
            accepted += sum(s.accepted for s in stats)
        return per_row, accepted

    per_row, accepted = counts()
    assert accepted > SAMPLES * 0.05  # drafts were accepted: the test has something to check
    reference = plain_counts("T0.7")
    assert homogeneity_pvalue(sum(per_row, Counter()), reference) > ALPHA
    for row in per_row:
        assert homogeneity_pvalue(row, reference) > ALPHA
    biased, _ = counts(biased_verifier)
    assert homogeneity_pvalue(sum(biased, Counter()), reference) < ALPHA


def test_a_batch_that_drafts_dearer_than_one_long_row_stops_drafting_sooner():
    """Priced as one row of rows x nodes tokens, 8 rows draft; the measured 8-row curve (every row reads its own
    cache) says a second token per row costs +60%, and the same chances no longer pay for it."""
    single = LatencyCurve((1, 8, 16, 32), (1.0, 1.2, 1.4, 2.0))
    rows8 = LatencyCurve((1, 2, 4), (1.2, 1.9, 2.6))
    chances = [[0.5, 0.25]] * 8
    assert best_shared_count(chances, single) == 1
    assert best_shared_count(chances, single.with_batches([(8, rows8)])) == 0


def test_rows_finished_by_their_prefill_leave_at_the_next_step_without_a_forward():
    """The prefill verifies a row's first tree: a row whose first token is its EOS (or whose max_new_tokens is 1)
    is finished on joining, and leaves the batch while the others go on, each as alone."""
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    rows = ragged_prompts()[:3]
    first = int(single("llama", "sdpa", 1, None)[0, rows[1].shape[1]])  # row 1's first new token
    results = decoder.generate([p[0].tolist() for p in rows], NEW_TOKENS, eos_token_id=first)
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, single("llama", "sdpa", index, first)), index
    assert results[1].new_tokens == [first] and results[1].stats.forwards == 1
    ones = decoder.generate([p[0].tolist() for p in rows], 1, eos_token_id=[])
    assert [r.stats.forwards for r in ones] == [1, 1, 1]  # the prefill alone, never a step
    for index, result in enumerate(ones):
        assert torch.equal(result.sequences, single("llama", "sdpa", index, None, 1)), index


def test_a_closed_batch_drafts_for_the_rows_that_decide_when_it_ends():
    """Weights: a row that will finish first anyway (weight 0) cannot make the batch draft; the slowest row can."""
    curve = LatencyCurve((1, 2, 4), (1.0, 1.1, 1.2), ((2, LatencyCurve((1, 2, 4), (1.2, 1.6, 2.0))),))
    sure, hopeless = [0.95, 0.9, 0.85], [0.0, 0.0, 0.0]
    assert best_shared_count([sure, hopeless], curve) == 3  # every row's progress alike (an open batch)
    assert best_shared_count([sure, hopeless], curve, weights=[0.0, 1.0]) == 0  # only the slow row counts
    assert best_shared_count([hopeless, sure], curve, weights=[0.0, 1.0]) == 3


def test_closed_batch_weights_follow_each_rows_steps_left():
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    closed, open_batch = Batch(model, decoder.budget, closed=True), Batch(model, decoder.budget)
    for batch in (closed, open_batch):
        for job in jobs_for(model, ragged_prompts()[:2], [forerun.batch.fork(decoder.drafters) for _ in range(2)]):
            batch.add(job)
    assert open_batch.policy.weights([row.steps_left() for row in open_batch.rows]) is None
    ahead = closed.rows[0]
    ahead.job.transcript.sources.extend(["model"] * 8)  # as if row 0 had made 8 more tokens in one more step
    ahead.stats.forwards += 1
    weights = closed.policy.weights([row.steps_left() for row in closed.rows])
    assert weights[1] == 1.0 and 0.0 < weights[0] < 0.5, weights


@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("gpt2", "eager")])
def test_a_narrower_batch_refills_finished_rows_with_waiting_prompts(family, impl):
    """batch_size 2 for 4 prompts: never more than 2 rows in a forward, a finished row's place goes to the next
    prompt at once (so a 2-row forward follows the first row's finish), results come in finishing order from
    `generate_each` and in input order from `generate`, each row as alone."""
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    batch = [p[0].tolist() for p in ragged_prompts()]
    eos = int(single(family, impl, 0, None)[0, len(batch[0]) + 3])  # row 0 ends early: its place is refilled
    expected = [single(family, impl, index, eos) for index in range(len(batch))]
    rows_fed = []

    def spy(_, args, kwargs):  # (rows, prefill?): a joining row's prefill runs alone on a fresh cache
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        rows_fed.append((input_ids.shape[0], kwargs[cache_argument(model)].get_seq_length() == 0))

    # on the body: every forward runs it, also those whose logits forerun computes itself (forerun.head)
    hook = model.base_model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        order = []
        for index, result in decoder.generate_each(batch, NEW_TOKENS, batch_size=2, eos_token_id=eos):
            order.append(index)
            assert torch.equal(result.sequences, expected[index]), (family, impl, index)
    finally:
        hook.remove()
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 0  # row 0 finishes first
    assert max(rows for rows, _ in rows_fed) == 2
    prefills = [i for i, (_, prefill) in enumerate(rows_fed) if prefill]
    assert len(prefills) == 4 and rows_fed[prefills[2] + 1] == (2, False)  # the third prompt joined the running row
    results = decoder.generate(batch, NEW_TOKENS, batch_size=2, eos_token_id=eos)
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, single(family, impl, index, eos)), (family, impl, index, "list")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        decoder.generate(batch, 4, batch_size=0)


def test_one_seed_per_prompt():
    """seed=[s0, s1, ...]: row i draws from s_i (the same prompt with the same seed in one batch samples alike);
    one integer seeds row i with seed + i; a list of the wrong length or a bad seed is a clear error."""
    decoder = forerun.Decoder(model_of("llama", "sdpa"), None, "prompt_lookup", latency=CURVE)
    prompt = ragged_prompts()[0][0].tolist()
    same = decoder.generate([prompt, prompt], 16, do_sample=True, seed=[5, 5], eos_token_id=[])
    assert same[0].new_tokens == same[1].new_tokens
    apart = decoder.generate([prompt, prompt], 16, do_sample=True, seed=5, eos_token_id=[])
    assert apart[0].new_tokens != apart[1].new_tokens
    for seed, message in [([5], "one per prompt"), ([5, -1], "seed must be"), ("55", "seed must be")]:
        with pytest.raises(ValueError, match=message):
            decoder.generate([prompt, prompt], 4, do_sample=True, seed=seed)


class SlowDrafter(RandomDrafter):
    """Never right, and 20 ms to propose: drafting costs more wall time than any forward it could save."""

    calls = 0

    def propose(self, ctx):
        self.calls += 1
        time.sleep(0.02)
        return super().propose(ctx)


class CountedOracle(OracleDrafter):
    calls = 0

    def propose(self, ctx):
        self.calls += 1
        return super().propose(ctx)


def test_a_batch_stops_proposing_while_drafting_measures_slower_and_keeps_it_while_it_pays():
    """The draft switch compares measured rates: slow useless proposals are paused (proposed on well under half
    the row-steps), an oracle's are kept (after one short plain probe); both batches stay exact."""
    model = model_of("llama", "sdpa")
    rows = ragged_prompts()[:2]
    new = 64
    truths = [single("llama", "sdpa", i, None, new)[0].tolist() for i in range(2)]
    for drafter_class, paused in ((SlowDrafter, True), (CountedOracle, False)):
        drafters = [
            SlowDrafter(truth, VOCAB) if drafter_class is SlowDrafter else CountedOracle(truth, 3, VOCAB)
            for truth in truths
        ]
        jobs = jobs_for(model, rows, [[d] for d in drafters], new)
        stats = decode_batch(model, jobs, CostModel(CURVE, 16))
        for index, job in enumerate(jobs):
            assert job.transcript.sequence[0].tolist() == truths[index], (drafter_class, index)
        row_steps = sum(s.forwards for s in stats)
        calls = sum(d.calls for d in drafters)
        assert (calls < row_steps / 2) if paused else (calls > row_steps / 2), (drafter_class, calls, row_steps)


class CountedRandom(RandomDrafter):
    """Never right, and quick: what its proposals cost is only what the batch does with them."""

    calls = 0

    def propose(self, ctx):
        self.calls += 1
        return super().propose(ctx)


LINEAR = LatencyCurve((1, 2, 4, 8, 16, 32, 64, 128), tuple(float(n) for n in (1, 2, 4, 8, 16, 32, 64, 128)))
"""Every token fed costs a whole forward: no candidate ever pays, however likely."""


def test_a_reproducible_batch_stops_proposing_where_the_cost_model_feeds_none_of_it():
    """Reproducible choices read no clock, so the batch pauses proposals on what the cost model fed: on a curve
    where no candidate pays, the rows propose on under a quarter of their steps, as many run after run; an oracle
    on a flat curve keeps proposing (the negative control); every row stays exact."""
    model = model_of("llama", "sdpa")
    rows = ragged_prompts()[:2]
    new = 64
    truths = [single("llama", "sdpa", i, None, new)[0].tolist() for i in range(2)]
    seen = []
    for curve, drafter_class in ((LINEAR, CountedRandom), (LINEAR, CountedRandom), (CURVE, CountedOracle)):
        drafters = [
            CountedRandom(truth, VOCAB) if drafter_class is CountedRandom else CountedOracle(truth, 3, VOCAB)
            for truth in truths
        ]
        jobs = jobs_for(model, rows, [[d] for d in drafters], new)
        stats = decode_batch(model, jobs, CostModel(curve, 16, times=None, reproducible=True))
        for index, job in enumerate(jobs):
            assert job.transcript.sequence[0].tolist() == truths[index], (drafter_class, index)
        seen.append(([d.calls for d in drafters], sum(s.forwards for s in stats)))
    (random_calls, random_steps), again, (oracle_calls, oracle_steps) = seen
    assert sum(random_calls) < random_steps / 4, seen
    assert again == seen[0]  # as many proposals every run: no clock decides them
    assert sum(oracle_calls) > oracle_steps * 0.9, seen


@pytest.mark.parametrize("method", ["prompt_lookup", "auto"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_rows_stay_exact_when_transformers_keeps_key_value_heads_grouped(family, method, monkeypatch):
    """TRANSFORMERS_SDPA_FORCE_GQA=1, transformers' own switch (docs/benchmarks.md: on CPU it spares masked multi-token
    forwards the copy of every cached key and value per query head, -21 ms of a 181 ms 8-row x 4-node fp32 step):
    each batched row still equals plain `model.generate` of its prompt alone, run without the switch."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    truths = [single(family, "sdpa", index, None) for index in range(4)]  # plain generate, the switch off
    keys, mask = torch.zeros(1, 2, 3, 16), torch.ones(1, 1, 1, 3, dtype=torch.bool)
    assert not use_gqa_in_sdpa(mask, keys, keys)  # without the switch a mask means the copy
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    assert use_gqa_in_sdpa(mask, keys, keys)  # the other kernel path really is taken
    model = model_of(family, "sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads: the path matters
    decoder = forerun.Decoder(model, None, method, latency=CURVE, **METHODS[method])
    results = decoder.generate([p[0].tolist() for p in ragged_prompts()], NEW_TOKENS, eos_token_id=[])
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, truths[index]), (family, method, index)


class BudgetedOracle(OracleDrafter):
    """The true continuation as one chain, as long as the row's budget lets it propose; remembers each budget."""

    def __init__(self, truth: list[int], vocab: int) -> None:
        super().__init__(truth, 64, vocab)
        self.budgets: set[int] = set()

    def propose(self, ctx):
        self.budgets.add(ctx.budget)
        n = len(ctx.tokens)
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        tree.add_chain(0, self.truth[n : n + ctx.budget - 1], source=self.name)
        return tree


def test_a_batch_rows_drafters_share_its_cap_and_a_row_alone_gives_each_the_whole():
    """On a flat curve a batch row may propose 64 nodes; its three drafters share them (21 each: ranking what is
    never fed is host work), while a row decoded alone gives each drafter all 64 (the negative control); every row
    stays exact."""
    model = model_of("llama", "sdpa")
    flat = LatencyCurve((1, 64), (1.0, 1.0))
    truths = [single("llama", "sdpa", i, None, 48)[0].tolist() for i in range(2)]
    for rows, share in ((2, 21), (1, 64)):
        drafters = [[BudgetedOracle(truths[i], VOCAB) for _ in range(3)] for i in range(rows)]
        jobs = jobs_for(model, ragged_prompts()[:rows], drafters, 48)
        decode_batch(model, jobs, CostModel(flat, 64, times=None, reproducible=True))
        for index, job in enumerate(jobs):
            assert job.transcript.sequence[0].tolist() == truths[index], (rows, index)
        assert {budget for row in drafters for d in row for budget in d.budgets} == {share}, rows


class CountingCostModel(CostModel):
    """A cost model that counts the rows it ranks (`rank`: merging and ordering a row's proposals), over the
    copies a batch makes of it (one per row)."""

    ranked: list[int] = []  # noqa: RUF012 - shared by the copies on purpose

    def rank(self, root, proposals):
        self.ranked.append(root)
        return super().rank(root, proposals)


def test_rows_without_drafters_propose_and_rank_nothing():
    """`plain` rows in a batch feed their roots without a proposing step's work (nothing to merge or rank: host
    work between a card's forwards; each row's first choice at its join remains); rows with a drafter are ranked
    every step (the negative control); every row stays exact."""
    model = model_of("llama", "sdpa")
    truths = [single("llama", "sdpa", i, None, 24)[0].tolist() for i in range(3)]
    for drafted in (False, True):
        budget = CountingCostModel(CURVE, 16, times=None, reproducible=True)
        CountingCostModel.ranked.clear()
        drafters = [[RandomDrafter(truths[i], VOCAB, seed=i)] if drafted else [] for i in range(3)]
        jobs = jobs_for(model, ragged_prompts()[:3], drafters, 24)
        decode_batch(model, jobs, budget)
        for index, job in enumerate(jobs):
            assert job.transcript.sequence[0].tolist() == truths[index], (drafted, index)
        assert (len(CountingCostModel.ranked) > len(jobs)) == drafted, (drafted, len(CountingCostModel.ranked))
