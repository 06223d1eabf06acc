"""A batch of a hybrid's rows (recurrent or convolution states beside attention layers) decodes together (their
chains side by side where their states are recorded: tests/equality/test_batched_chains.py): the attention
layers' keys share the batch's cache as any model's, each row's states are its row of each state tensor. Every row
writes generate's text; rows leave and join; a row that leaves keeps its whole cache for its next turn. Where a
batch gives the rows other logits (the probe, `rowstates.state_rows_support`), they decode one after another."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from random_case import plain_greedy
from transformers import AutoConfig, AutoModelForCausalLM

import forerun
from forerun.base.rows import DynamicRows
from forerun.batch import Batch
from forerun.costmodel import LatencyCurve
from forerun.rowstates import state_rows_support

from helpers import without_recording
from tiny_models import COMMON, STATE_SPACE_FAMILIES, STATEFUL_FAMILIES, prompts, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))

APART = {"recurrent_gemma": 0.036}
"""Hybrids whose rows a batch gives other logits (this share of their spread, measured): one after another."""
BATCHED = sorted(set(STATEFUL_FAMILIES) - set(APART))


def plain(model, prompt, new_tokens):
    """generate's greedy text, every prompt token read as text (a next turn's prompt may hold the pad id 0)."""
    return plain_greedy(model, prompt, new_tokens)


def state_space(family: str) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **COMMON, **STATE_SPACE_FAMILIES[family])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def ragged_requests(model) -> tuple[list[forerun.GenerationRequest], list[torch.Tensor]]:
    """Five prompts of 10-30 tokens wanting 9-30 tokens each, and generate's texts for them."""
    lengths, news = (10, 24, 17, 30, 12), (20, 9, 30, 14, 25)
    texts = [prompts(1, length, seed=i)[0] for i, length in enumerate(lengths)]
    requests = [forerun.GenerationRequest(text, new, eos_token_id=[]) for text, new in zip(texts, news, strict=True)]
    return requests, [plain(model, text, new) for text, new in zip(texts, news, strict=True)]


@pytest.mark.parametrize("family", [*BATCHED, *sorted(STATE_SPACE_FAMILIES)])
def test_a_hybrids_rows_decode_together_exactly(family):
    """Five ragged requests through three rows: rows leave as they finish and the next joins into a vacant place
    (its states written into that row), the cache's holes compacted; every row is generate's, sdpa. State-space
    models (no attention layer) are fed without a mask: Mamba's layers read one as the hidden states' padding."""
    model = state_space(family) if family in STATE_SPACE_FAMILIES else tiny_model(family)
    requests, expected = ragged_requests(model)
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    assert decoder.batches
    results = dict(decoder.generate_each(requests, batch_size=3))
    for index, want in enumerate(expected):
        assert torch.equal(results[index].sequences, want), index
        reason = results[index].stats.fallback_reason  # states cut back row by row: chains together
        assert reason is None if family != "zamba" else "other logits than one forward" in reason
    if family == "zamba":  # its chains are another computation: one token per forward, alone or not
        return
    # rows feed chains side by side (Jamba's and Mamba's too: their chains' tokens are fed as their steps are,
    # their states recorded)
    assert any(r.stats.fed_tokens > r.stats.forwards for r in results.values())
    alone = decoder.generate(requests[0].prompt, 20, eos_token_id=[])  # a lone row verifies chains where it can
    assert torch.equal(alone.sequences, expected[0])
    assert alone.stats.fallback_reason is None


@pytest.mark.parametrize("family", ["qwen3_5_text", "jamba", "lfm2"])
def test_a_hybrids_rows_decode_together_with_eager_attention(family):
    model = tiny_model(family, attn_implementation="eager")
    requests, expected = ragged_requests(model)
    results = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None).generate(requests)
    assert all(torch.equal(r.sequences, want) for r, want in zip(results, expected, strict=True))


@pytest.mark.parametrize("family", sorted(APART))
def test_a_model_whose_batch_differs_decodes_its_rows_one_after_another(family):
    """RecurrentGemma's batch gives its rows other logits (3.6e-2 of their spread): the probe finds
    it, and its rows are decoded one after another, exactly."""
    model = tiny_model(family)
    reason = state_rows_support(model)
    assert reason is not None and type(model).__name__ in reason
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    assert not decoder.batches
    requests, expected = ragged_requests(model)
    results = decoder.generate(requests[:3])
    assert all(torch.equal(r.sequences, want) for r, want in zip(results, expected[:3], strict=True))


def test_the_probe_finds_a_row_whose_states_went_elsewhere(monkeypatch):
    """A negative control: a joining row written into a vacant place without its states (the left row's stay)."""
    model = tiny_model("qwen3_5_text")
    assert state_rows_support(model) is None
    monkeypatch.setattr("forerun.rowcache.write_states", lambda mine, theirs, place: None)
    assert "gives a batch's rows other logits than their own" in state_rows_support(model)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_row_that_leaves_a_batch_seeds_its_next_turn(family):
    """Each row leaves its whole cache (states included) to the prefix cache: a next turn, batched again, reads
    only its new message, and writes generate's text with logprobs within 1e-5 of reading it whole; another salt
    reads it all."""
    model = tiny_model(family)
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    texts = [prompts(1, 20 + 4 * i, seed=i)[0] for i in range(3)]
    first = decoder.generate(texts, 12, eos_token_id=[])
    following = [torch.cat([r.sequences, torch.tensor([[5, 6, 7 + i]])], dim=1) for i, r in enumerate(first)]
    second = decoder.generate(following, 12, eos_token_id=[], logprobs=1)
    for text, result, turn in zip(texts, second, following, strict=True):
        assert result.stats.cached_prompt_tokens == text.shape[1] + 11  # all it read: the last token never fed
        assert torch.equal(result.sequences, plain(model, turn, 12))
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(following[1], 12, eos_token_id=[], logprobs=1)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(second[1].logprobs, read.logprobs, strict=True)) < 1e-5
    salted = decoder.generate(following, 12, eos_token_id=[], cache_salt="other")
    assert [r.stats.cached_prompt_tokens for r in salted] == [0, 0, 0]


@pytest.mark.parametrize("family", ["qwen3_5_text", "granitemoehybrid"])
def test_a_hybrids_prompt_fed_in_chunks_joins_while_a_row_steps(family):
    """A server's long prompt joins in chunks (a causal forward of its own cache each, the running row stepping in
    between), then its states are appended: both rows write generate's text."""
    model = tiny_model(family)
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    requests, expected = ragged_requests(model)
    running, long = (decoder.prepare(request).job for request in (requests[0], requests[3]))  # 10 and 30 tokens
    batch = Batch(model, decoder.budget)
    batch.add(running)
    joining, steps = batch.begin(long), 0
    while (row := batch.feed(joining, chunk=7)) is None:
        batch.step()
        steps += 1
    assert steps == 4 and row.stats.prefill_chunks == 5  # 29 tokens before the root: 4 chunks of 7, then 1
    while batch.rows:
        batch.step()
    assert torch.equal(running.transcript.sequence, expected[0])
    assert torch.equal(long.transcript.sequence, expected[3])


def test_a_hybrids_sampled_rows_and_the_drop_ins_batch_are_each_rows_own():
    """Seeded sampled rows write in a batch what each writes alone with its seed (the noise is per seed and
    position); `model.generate` of a left-padded batch through the drop-in writes each row's generate text."""
    model = tiny_model("qwen3_5_text")
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None)
    texts = [prompts(1, length, seed=i)[0] for i, length in enumerate((10, 24, 17))]
    sampled = dict(do_sample=True, seed=5, temperature=0.8, eos_token_id=[])
    together = decoder.generate(texts, 20, **sampled)
    assert all(r.stats.fallback_reason is None for r in together)  # their chains side by side
    for i, (text, row) in enumerate(zip(texts, together, strict=True)):
        assert torch.equal(row.sequences, decoder.generate(text, 20, **{**sampled, "seed": 5 + i}).sequences)
    padded = torch.cat([torch.nn.functional.pad(t, (24 - t.shape[1], 0)) for t in texts])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(t), (24 - t.shape[1], 0)) for t in texts])
    out = model.generate(
        padded, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
        custom_generate=forerun.hf_generate, forerun_decoder=decoder,
    )  # fmt: skip
    for row, text in enumerate(texts):
        assert torch.equal(out[row, 24 - text.shape[1] :], plain(model, text, 16)[0])


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h"])
def test_a_lone_row_verifies_chains_and_feeds_its_waiting_tokens_before_a_row_joins(family, monkeypatch):
    """A row alone in a batch of a hybrid whose states are not recorded feeds chains of guesses; where one is
    accepted in part its states are put back and the accepted tokens wait. A row joining then finds them fed first
    (`DynamicRows.flush`), and both rows, one token each a step, write generate's text."""
    without_recording(monkeypatch)
    model = tiny_model(family)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    requests, expected = ragged_requests(model)
    lone, joining = (decoder.prepare(request).job for request in (requests[2], requests[4]))  # 30 and 25 new
    batch = Batch(model, decoder.budget)
    row = batch.add(lone)
    while not batch.shared.waiting:
        assert batch.step() == [], "no chain was accepted in part"
    assert row.stats.fed_tokens > row.stats.forwards and row.stats.fallback_reason is None
    other = batch.add(joining)
    assert batch.shared.waiting == 0 and len(batch.rows) == 2
    while batch.rows:
        batch.step()
    assert torch.equal(lone.transcript.sequence, expected[2])
    assert torch.equal(joining.transcript.sequence, expected[4])
    assert "one token each a step" in other.stats.fallback_reason


def test_an_lfm2_lone_row_cuts_its_windows_back_and_nothing_waits():
    """LFM2's states are convolution windows: a lone row's chain accepted in part has them cut back, as its keys
    are, so no token waits for the next forward, a row joins without a flush, and the lone row's next turn is
    seeded with all it read. Every text is generate's."""
    model = tiny_model("lfm2")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    requests, expected = ragged_requests(model)
    answer = expected[2][0, requests[2].prompt.shape[1] :].tolist()
    wrong = [t if i % 4 != 3 else 3 + (t - 2) % 90 for i, t in enumerate(answer)]
    prepared = decoder.prepare(replace(requests[2], prediction=wrong, logprobs=1))
    lone, joining = prepared.job, decoder.prepare(requests[4]).job
    batch = Batch(model, decoder.budget)
    row = batch.add(lone)
    for _ in range(4):  # chains accepted in part (every fourth guess wrong)
        assert batch.step() == [] and batch.shared.waiting == 0
    assert row.stats.fed_tokens > row.stats.forwards and row.stats.fed_again == 0
    batch.add(joining)
    while batch.rows:
        batch.step()
    assert torch.equal(lone.transcript.sequence, expected[2]) and torch.equal(joining.transcript.sequence, expected[4])
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(replace(requests[2], logprobs=1))
    got = decoder.result(prepared, row.stats).logprobs  # windows cut back a token off would read another text
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got, read.logprobs, strict=True)) < 1e-5
    turn = torch.cat([lone.transcript.sequence, torch.tensor([[5, 6, 7]])], dim=1)
    follow = decoder.generate(turn, 12, eos_token_id=[])
    assert follow.stats.cached_prompt_tokens == expected[2].shape[1] - 1  # all it read: the last token never fed
    assert torch.equal(follow.sequences, plain(model, turn, 12))


def test_a_lone_rows_whole_cache_seeds_its_next_turn_though_tokens_wait():
    """A lone row that ends on a chain accepted in part (a prediction right for two tokens, then wrong, where the
    target writes its EOS) leaves the cache for the text it did read: the next turn reads the rest, and writes
    generate's text with logprobs within 1e-5 of reading it whole."""
    model = tiny_model("qwen3_5_text")
    decoder = forerun.Decoder(model, None, "plain", latency=CURVE, latency_cache=None)
    text = prompts(1, 24, seed=3)[0]
    answer = plain(model, text, 3)[0, 24:].tolist()
    assert answer[2] not in answer[:2]
    wrong = (answer[2] + 1) % model.config.vocab_size
    request = forerun.GenerationRequest(text, 16, eos_token_id=[answer[2]], prediction=[*answer[:2], wrong])
    first = decoder.prepare(request)
    batch = Batch(model, decoder.budget)
    row = batch.add(first.job)
    while batch.rows:
        batch.step()
    assert row.stats.fed_again == 2 and row.stats.forwards == 2  # the prefill, then a chain of 3 accepted in part
    turn = torch.cat([first.job.transcript.sequence, torch.tensor([[5, 6, 7]])], dim=1)
    follow = decoder.prepare(forerun.GenerationRequest(turn, 12, eos_token_id=[], logprobs=1))
    batch = Batch(model, decoder.budget)
    row = batch.add(follow.job)
    while batch.rows:
        batch.step()
    assert row.stats.cached_prompt_tokens == 24  # the prompt: the answer's first two tokens were never read
    result = decoder.result(follow, row.stats)
    assert torch.equal(result.sequences, plain(model, turn, 12))
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(turn, 12, eos_token_id=[], logprobs=1)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(result.logprobs, read.logprobs, strict=True)) < 1e-5


def test_a_sampled_lone_row_in_a_batch_writes_its_seeds_text():
    """A seeded sampled request alone in a batch (chains drafted, put back where accepted in part) writes what the
    same request writes in a single run."""
    model = tiny_model("qwen3_5_text")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None, prefix_cache=0)
    text = prompts(1, 24, seed=5)[0]
    request = forerun.GenerationRequest.of(text, 40, eos_token_id=[], do_sample=True, seed=11, temperature=0.7)
    prepared = decoder.prepare(request)
    batch = Batch(model, decoder.budget)
    row = batch.add(prepared.job)
    while batch.rows:
        batch.step()
    assert row.stats.fed_tokens > row.stats.forwards
    assert torch.equal(decoder.result(prepared, row.stats).sequences, decoder.generate(request).sequences)


def random_requests(rng: random.Random) -> list[forerun.GenerationRequest]:
    """1-4 requests of 5-60 tokens (half repeating their own head, so that prompt lookup finds guesses), 1-30 new
    tokens each, a third of them sampled with a seed."""
    requests = []
    for _ in range(rng.choice([1, 2, 3, 4])):
        text = prompts(1, rng.choice([5, 12, 30]), seed=rng.randrange(1000))[0]
        if rng.random() < 0.5:
            text = torch.cat([text, text[:, : rng.randrange(1, text.shape[1] + 1)]], dim=1)
        sampled = dict(do_sample=True, seed=rng.randrange(100), temperature=0.8) if rng.random() < 0.3 else {}
        requests.append(forerun.GenerationRequest.of(text, rng.choice([1, 5, 17, 30]), eos_token_id=[], **sampled))
    return requests


def run_arrivals(rng: random.Random, model, decoder, requests) -> list:
    """The requests joining one batch at random steps, as a server's arrive: whole, or in chunks of 3 or 7 tokens
    between the running rows' steps. Returns them prepared, their rows' transcripts filled."""
    batch, waiting, joined, joining = Batch(model, decoder.budget), [decoder.prepare(r) for r in requests], [], None
    while waiting or batch.rows or joining:
        if joining is None and waiting and (not batch.rows or rng.random() < 0.3):
            prepared = waiting.pop(0)
            if rng.random() < 0.5:
                joining = (prepared, batch.begin(prepared.job))
            else:
                batch.add(prepared.job)
                joined.append(prepared)
        if joining is not None and batch.feed(joining[1], chunk=rng.choice([3, 7, None])) is not None:
            joined.append(joining[0])
            joining = None
        if batch.rows:
            batch.step()
    return joined


@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_in_a_hybrids_batch_keep_each_rows_text(seed, monkeypatch):
    """Random hybrids, methods and arrivals (rows joining a lone row's chains, whole or in chunks, leaving at their
    own lengths, greedy and seeded sampling): every row is its own plain text, and some joins found tokens waiting
    (the lone row's chains were accepted in part)."""
    flushes, flush = [], DynamicRows.flush

    def counted(rows: DynamicRows) -> None:
        flushes.append(rows.waiting)
        flush(rows)

    monkeypatch.setattr(DynamicRows, "flush", counted)
    rng = random.Random(seed)
    for _ in range(12):
        model = tiny_model(rng.choice(["qwen3_5_text", "nemotron_h", "granitemoehybrid", "lfm2", "falcon_h1"]))
        method = rng.choice(["prompt_lookup", "auto", "jacobi", "trie"])
        decoder = forerun.Decoder(model, None, method, latency=CURVE, latency_cache=None)
        for prepared in run_arrivals(rng, model, decoder, random_requests(rng)):
            request = prepared.request
            if request.do_sample:  # its seed's undrafted text
                want = forerun.Decoder(model, None, "plain").generate(request).sequences
            else:
                want = plain(model, request.prompt, request.max_new_tokens)
            assert torch.equal(prepared.job.transcript.sequence, want), (method, request)
    assert any(flushes)
