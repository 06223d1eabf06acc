"""A hybrid's rows feed chains of guesses together where their states are recorded through the step: LFM2's short
convolution windows, and the recurrent states that Qwen3.5's, Jamba's, Nemotron-H's and Mamba's forwards write
after each token where asked (`forerun.base.chain.records_states`). The batch cuts each row's states back to its
own last kept token (`forerun.rowstates.cut_states`), as the rows' rejected keys are left as holes. A shorter chain
is padded at its end (what follows a token never reaches it through a causal layer). Every row writes generate's
text; a hybrid whose forward does not record (Zamba) still feeds one token per row a step
(tests/equality/test_hybrid_batches.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_hybrid_batches import CURVE, plain, ragged_requests, state_space

import forerun
from forerun.base.chain import chain_of
from forerun.base.rows import DynamicRows
from forerun.base.static_rows import static_rows
from forerun.batch import Batch
from forerun.rowstates import state_rows_support
from forerun.tree import TokenTree

from helpers import without_recording
from tiny_models import LetterTokenizer, tiny_model


def predicted(requests, expected, every: list[int]) -> list[forerun.GenerationRequest]:
    """Each request with generate's answer as its prediction, every `every[i]`-th token of it wrong (and its
    logprobs asked for): rows accept chains of their own lengths."""
    out = []
    for request, want, k in zip(requests, expected, every, strict=True):
        answer = want[0, request.prompt.shape[1] :].tolist()
        wrong = [t if i % k != k - 1 else 3 + (t - 2) % 90 for i, t in enumerate(answer)]
        out.append(replace(request, prediction=wrong, logprobs=1))
    return out


def together(model, decoder, requests) -> tuple[list[forerun.GenerationResult], list[list[int]]]:
    """The requests in one batch: their results and, per step while every row is in it, the tokens each wrote."""
    prepared = [decoder.prepare(request) for request in requests]
    batch, gains = Batch(model, decoder.budget, shared=static_rows(decoder.base, len(prepared), 64)), []
    rows = [batch.add(each.job) for each in prepared]
    while batch.rows:
        before = [len(each.job.transcript.sources) for each in prepared]
        full = len(batch.rows) == len(prepared)
        batch.step()
        if full:
            gains.append([len(each.job.transcript.sources) - b for each, b in zip(prepared, before, strict=True)])
    return [decoder.result(each, row.stats) for each, row in zip(prepared, rows, strict=True)], gains


def logprob_gap(model, results, requests) -> float:
    """The largest gap between the rows' logprobs and a plain run's reading each text whole."""
    read = forerun.Decoder(model, None, "plain", prefix_cache=0)
    gaps = []
    for result, request in zip(results, requests, strict=True):
        alone = read.generate(replace(request, prediction=None)).logprobs
        gaps += [abs(a.logprob - b.logprob) for a, b in zip(result.logprobs, alone, strict=True)]
    return max(gaps)


RECORDED = [("lfm2", "sdpa"), ("lfm2", "eager"), ("qwen3_5_text", "sdpa"), ("qwen3_5_text", "eager"), ("jamba", "sdpa"),
            ("nemotron_h", "sdpa"), ("falcon_h1", "sdpa"), ("mamba", None), ("mamba2", None)]  # fmt: skip
"""Families whose rows chain together, and an attention implementation (None: a state-space model, none)."""


def recorded_model(family: str, attention: str | None) -> torch.nn.Module:
    return state_space(family) if attention is None else tiny_model(family, attn_implementation=attention)


@pytest.mark.parametrize(("family", "attention"), RECORDED)
def test_a_hybrids_rows_feed_chains_together_each_cut_back_to_its_own(family, attention):
    """Three rows predicted wrong every 3rd, 4th and 5th token: steps where the rows keep chains of different
    lengths together, each row's text generate's, its logprobs within 1e-5 of reading the text whole (a state
    cut back a token off reads another text)."""
    model = recorded_model(family, attention)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    requests, expected = ragged_requests(model)
    asked = predicted(requests[2:], expected[2:], [3, 4, 5])
    results, gains = together(model, decoder, asked)
    assert any(len(set(step)) > 1 and min(step) > 1 for step in gains), gains  # chains of their own lengths
    for result, want in zip(results, expected[2:], strict=True):
        assert torch.equal(result.sequences, want)
    assert logprob_gap(model, results, asked) < 1e-5


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5_text"])
def test_states_cut_back_alike_read_another_text(family, monkeypatch):
    """The negative control: every row's states cut back by the first row's count (as transformers' `crop` cuts
    a batch) read another text for some row, and the probe finds it."""
    model = tiny_model(family)
    requests, expected = ragged_requests(model)
    cut = forerun.base.rows.cut_states
    alike = lambda layer, rejected: cut(layer, [rejected[0]] * len(rejected))  # noqa: E731
    monkeypatch.setattr("forerun.base.rows.cut_states", alike)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    asked = predicted(requests[2:], expected[2:], [3, 4, 5])
    assert logprob_gap(model, together(model, decoder, asked)[0], asked) > 1e-4
    assert "other logits than their own" in state_rows_support(model, family != "lfm2")


def test_recurrent_states_left_uncut_read_another_text(monkeypatch):
    """The negative control for recurrent states: each row's windows cut back but its recurrent state left after
    the whole padded step (its history dropped) reads another text."""
    model = tiny_model("qwen3_5_text")

    def windows_only(layer, rejected) -> None:
        layer.recurrent_states_history = {index: [] for index in layer.recurrent_states_history}
        forerun.rowstates.cut_windows(layer, rejected)

    monkeypatch.setattr("forerun.base.rows.cut_states", windows_only)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    requests, expected = ragged_requests(model)
    asked = predicted(requests[2:], expected[2:], [3, 4, 5])
    assert logprob_gap(model, together(model, decoder, asked)[0], asked) > 1e-2


@pytest.mark.parametrize("family", ["lfm2", "qwen3_5_text"])
def test_sampled_rows_drafting_together_write_their_seeds_text(family):
    """Seeded sampled rows feeding chains together write what each writes alone with its seed."""
    model = tiny_model(family)
    decoder = forerun.Decoder(model, None, "auto", latency=CURVE, latency_cache=None, prefix_cache=0)
    requests, _ = ragged_requests(model)
    sampled = [forerun.GenerationRequest.of(r.prompt, 24, eos_token_id=[], do_sample=True, seed=7 + i,
                                            temperature=0.7) for i, r in enumerate(requests[:3])]  # fmt: skip
    rows = decoder.generate(sampled)
    assert any(r.stats.fed_tokens > r.stats.forwards for r in rows)
    assert all(r.stats.fallback_reason is None for r in rows)
    for request, row in zip(sampled, rows, strict=True):
        assert torch.equal(row.sequences, decoder.generate(request).sequences)


def test_lfm2_rows_on_a_static_budget_share_its_nodes_as_chains():
    """Without the cost model (`adaptive=False`), each row of a batch feeds a chain of its share of the nodes: the
    first drafter's line, where `auto`'s drafters and the prediction propose several."""
    model = tiny_model("lfm2")
    decoder = forerun.Decoder(model, None, "auto", adaptive=False, max_tree_nodes=32, latency_cache=None)
    requests, expected = ragged_requests(model)
    results, gains = together(model, decoder, predicted(requests[2:], expected[2:], [3, 4, 5]))
    assert max(max(step) for step in gains) > 1
    assert all(torch.equal(r.sequences, want) for r, want in zip(results, expected[2:], strict=True))


def test_a_hybrid_whose_forward_does_not_record_keeps_to_one_token_a_row(monkeypatch):
    """Where a model's forward writes no token's recurrent state (`helpers.without_recording`), its rows feed one
    token each, and a forward of chains on its rows is refused, not decoded wrong."""
    without_recording(monkeypatch)
    model = tiny_model("qwen3_5_text")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE, latency_cache=None)
    requests, expected = ragged_requests(model)
    results, gains = together(model, decoder, predicted(requests[2:], expected[2:], [3, 4, 5]))
    assert all(step == [1, 1, 1] for step in gains)
    assert all(torch.equal(r.sequences, want) for r, want in zip(results, expected[2:], strict=True))
    rows = DynamicRows(model)
    with torch.inference_mode():
        for text in ([3, 4, 5, 6], [7, 8, 9]):
            own, _ = rows.open(None, text, 16)
            rows.feed(own, TokenTree.rooted_at(text[-1]), len(text) - 1, text[:-1])
            rows.admit(own, len(text) - 1, [0], None, text)
        assert not rows.chains_together
        with pytest.raises(RuntimeError, match="only where their states are recorded"):
            rows.forward([4, 3], [chain_of([1, 2]), chain_of([5])], 2)


def test_a_row_whose_stop_string_completes_inside_its_chain_leaves_no_windows_behind():
    """A row of a batch accepts a chain past its end (its stop string completes inside it) while another row
    drafts beside it: its cache read tokens its text does not hold, so it is not kept for a next turn, which writes
    generate's text with logprobs within 1e-5 of reading it whole; the other row is generate's."""
    model = tiny_model("lfm2")
    requests, expected = ragged_requests(model)
    decoder = forerun.Decoder(model, LetterTokenizer(), "prompt_lookup", latency=CURVE, latency_cache=None)
    text, answer = requests[2].prompt, expected[2][0, requests[2].prompt.shape[1] :].tolist()
    words = LetterTokenizer().decode(answer)
    stop, new_tokens = words[6:9], words.find(words[6:9]) + 3
    first = replace(requests[2], prediction=answer, stop=stop)
    beside = predicted(requests[3:4], expected[3:4], [3])[0]
    cut, other = decoder.generate([first, beside])
    assert torch.equal(cut.sequences, plain(model, text, new_tokens)) and cut.stats.forwards <= 3
    assert torch.equal(other.sequences, expected[3])
    following = torch.cat([cut.sequences, torch.tensor([[5, 6, 7, 8, 9]])], dim=1)
    second = decoder.generate(following, 16, eos_token_id=[], logprobs=1)
    assert torch.equal(second.sequences, plain(model, following, 16))
    read = forerun.Decoder(model, None, "plain", prefix_cache=0).generate(following, 16, eos_token_id=[], logprobs=1)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(second.logprobs, read.logprobs, strict=True)) < 1e-5
