"""EAGLE-3 heads: exact greedy output with random heads across families, alone and combined, single and batched;
an oracle head reaches full depth (the head reads the target's features at the right positions); sampling seeds
repeat."""

from __future__ import annotations

import pytest
import torch
from test_equality_families import CURVE, NEW_TOKENS, model_of, reference

import forerun
from forerun.costmodel.switch import DRAFT_MARGIN
from forerun.drafters.eagle3 import Eagle3Head
from forerun.drafters.eagle3.costs import HeadCosts

from eagle3_heads import random_head
from helpers import OracleDrafter, RandomDrafter
from tiny_models import VOCAB, prompts

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "granite"]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_random_head_equals_generate(family, impl):
    model = model_of(family, impl)
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model), latency=CURVE)
    drafted = 0
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(family, impl, index, None)), (family, impl, index)
        drafted += result.stats.candidates
    assert drafted > 0  # the head drafted: trees were verified


@pytest.mark.parametrize("method", ["eagle3+prompt_lookup+trie", "auto"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_combined_and_auto_with_a_head_equal_generate(family, method):
    model = model_of(family, "sdpa")
    decoder = forerun.Decoder(model, None, method, draft_head=random_head(model), latency=CURVE)
    assert "eagle3" in decoder.plan.names  # 'auto' drafts with the head whenever one is given
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(family, "sdpa", index, None)), (family, method, index)


def test_a_batch_with_a_head_equals_generate():
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model), latency=CURVE)
    results = decoder.generate_batch(prompts(3), NEW_TOKENS, eos_token_id=[])
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, reference("llama", "sdpa", index, None)), index


class OracleHead(Eagle3Head):
    """A head whose output at head position i names the target's token at i + 2 (what a perfect head predicts
    there): its forward runs as a head's (cache and all) and then writes the position into its output, which its
    logits read back as a one-hot of the true token."""

    def __init__(self, base: Eagle3Head, truth: list[int]) -> None:
        super().__init__(base.config, base.embed_tokens, base.aux_layers)
        self.load_state_dict(base.state_dict())
        self.truth = truth

    def forward(self, tokens, hidden, positions, cache, visible=None):
        out = super().forward(tokens, hidden, positions, cache, visible).clone()
        out[:, 0] = positions.to(out.dtype)
        return out

    def draft_logits(self, out):
        logits = torch.full((out.shape[0], self.config.draft_vocab_size), -10.0)
        for row, position in enumerate(out[:, 0].round().long().tolist()):
            token = self.truth[position + 2] if position + 2 < len(self.truth) else 0
            logits[row, token] = 10.0
        return logits


class CountedOracle(OracleHead):
    """The oracle, counting its forwards (reading the committed text and each drafted level alike)."""

    forwards = 0

    def forward(self, tokens, hidden, positions, cache, visible=None):
        self.forwards += 1
        return super().forward(tokens, hidden, positions, cache, visible)


def llama_oracle() -> tuple[torch.nn.Module, list[int], CountedOracle]:
    """The tiny llama (sdpa), its greedy text for the first prompt, and an oracle head over it whose draft ids are
    target ids."""
    model = model_of("llama", "sdpa")
    truth = reference("llama", "sdpa", 0, None)[0].tolist()
    head = random_head(model, draft_vocab=VOCAB)
    head.d2t.zero_()  # draft ids are target ids
    return model, truth, CountedOracle(head, truth)


def test_an_oracle_head_is_accepted_at_full_depth():
    model, truth, oracle = llama_oracle()
    depth = 4
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=oracle, adaptive=False, depth=depth, topk=1, width=1)
    result = decoder.generate(prompts(1)[0], NEW_TOKENS, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    # the prefill verifies no head draft (nothing read yet); every later step but the last takes the whole chain
    assert result.stats.accepted_hist[depth] >= result.stats.forwards - 3
    assert result.stats.accepted_by["eagle3"] == result.stats.accepted


@pytest.mark.parametrize("steep", [True, False])
def test_the_head_drafts_only_one_level_below_what_the_budget_fed(steep):
    """A perfect chain four deep on offer; where a third token costs three times two (`steep`), the cost model
    feeds one guess a step, and the head reads one level past it: its text read and one drafted level, two
    forwards a step. Control: on a flat curve the whole chain is fed, and every level is read each step."""
    model, truth, oracle = llama_oracle()
    costs = (1.0, 1.05, 3.0, 6.0, 12.0) if steep else (1.0, 1.0, 1.0, 1.0, 1.0)
    curve = forerun.LatencyCurve((1, 2, 4, 8, 16), costs)
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=oracle, latency=curve, depth=4, topk=1, width=1)
    result = decoder.generate(prompts(1)[0], NEW_TOKENS, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    per_step = oracle.forwards / result.stats.forwards
    if steep:
        assert max(result.stats.accepted_hist) == 1 and per_step <= 2.0, (result.stats.accepted_hist, per_step)
    else:
        assert result.stats.accepted_hist[4] >= result.stats.forwards - 3 and per_step > 3.5, per_step


def test_the_head_reads_no_level_once_its_tree_is_full():
    """Three nodes a forward, a chain four deep asked for: the root's child comes with the text's read, its child
    from one drafted level; a further level would add nothing (two forwards a step, not three)."""
    model, truth, oracle = llama_oracle()
    chain = dict(adaptive=False, max_tree_nodes=3, depth=4, topk=1, width=1)
    result = forerun.Decoder(model, None, "eagle3", draft_head=oracle, **chain).generate(
        prompts(1)[0], NEW_TOKENS, eos_token_id=[]
    )
    assert result.sequences[0].tolist() == truth
    assert result.stats.accepted_hist[2] >= result.stats.forwards - 3
    assert oracle.forwards <= 2 * result.stats.forwards, (oracle.forwards, result.stats.forwards)


def test_sampled_runs_with_a_head_repeat_with_their_seed():
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model), latency=CURVE)
    prompt = prompts(1)[0]
    runs = [decoder.generate(prompt, 24, do_sample=True, temperature=0.9, seed=seed).new_tokens for seed in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_a_head_needs_its_method_and_the_method_its_head():
    model = model_of("llama", "sdpa")
    with pytest.raises(ValueError, match="needs draft_head"):
        forerun.Decoder(model, None, "eagle3")
    with pytest.raises(ValueError, match="draft_head is for method 'eagle3'"):
        forerun.Decoder(model, None, "trie", draft_head=random_head(model))


class FeatureRecorder:
    """A drafter that drafts nothing and keeps the features the engine hands it, with their positions."""

    name = "recorder"
    feature_layers = (1, 0, 1)

    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}

    def start(self, ctx):
        pass

    def propose(self, ctx):
        from forerun.tree import TokenTree

        tree = TokenTree.rooted_at(ctx.tokens[-1])
        tree.add(0, (ctx.tokens[-1] + 1) % VOCAB, source=self.name)  # a tree, so the mask path runs too
        return tree

    def observe(self, ctx, outcome):
        end = len(ctx.tokens) - 1
        for offset, row in enumerate(outcome.features):
            self.seen[end - len(outcome.features) + offset] = row

    def finish(self, ctx):
        pass


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_the_features_handed_to_drafters_are_the_targets_hidden_states_at_their_positions(family):
    model = model_of(family, "sdpa")
    recorder = FeatureRecorder()
    prompt = prompts(1)[0]
    decoder = forerun.Decoder(model, None, "plain", drafters=[recorder], latency=CURVE)
    result = decoder.generate(prompt, 20, eos_token_id=[])
    with torch.inference_mode():
        states = model(result.sequences, output_hidden_states=True).hidden_states  # [layers + 1] x [1, T, H]
    total = result.sequences.shape[1]
    assert sorted(recorder.seen) == list(range(total - 1))  # every position but the last token's, once
    seen = torch.stack([recorder.seen[p] for p in range(total - 1)]).chunk(3, dim=-1)
    # transformers' last hidden state is the final norm of the last layer's output (the layer's own output is what
    # SGLang and SpecForge capture); layer 0's output is its hidden_states[1]
    with torch.inference_mode():
        torch.testing.assert_close(model.model.norm(seen[0]), states[2][0, :-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seen[1], states[1][0, :-1], rtol=1e-4, atol=1e-4)
    assert torch.equal(seen[0], seen[2])


class SlowGuesser:
    """A costly drafter (as a trained head is): each proposal takes 20 ms and guesses one token that never holds."""

    name = "slow"
    costly = True

    def __init__(self) -> None:
        self.proposed = self.sat_out = 0

    def start(self, ctx):
        pass

    def sit_out(self, ctx, outcome):
        self.sat_out += 1

    def propose(self, ctx):
        import time

        from forerun.tree import TokenTree

        self.proposed += 1
        time.sleep(0.02)
        tree = TokenTree.rooted_at(ctx.tokens[-1])
        tree.add(0, (ctx.tokens[-1] + 7) % VOCAB, source=self.name, score=0.9)
        return tree

    def observe(self, ctx, outcome):
        pass

    def finish(self, ctx):
        pass


def test_a_costly_drafter_that_does_not_pay_sits_out_and_the_text_stays_exact():
    """The budget's switch measures steps with and without the costly drafter: 20 ms of proposing for nothing is
    paused after its first comparison (each later probe drafts a few steps); the output is generate's."""
    model = model_of("llama", "sdpa")
    slow = SlowGuesser()
    decoder = forerun.Decoder(model, None, "plain", drafters=[slow], latency=CURVE, adaptive=True)
    assert decoder.budget.switch is not None
    result = decoder.generate(prompts(1)[0], 96, eos_token_id=[])
    assert torch.equal(result.sequences, model.generate(prompts(1)[0], max_new_tokens=96, do_sample=False))
    assert 6 <= slow.proposed <= result.stats.forwards // 2, (slow.proposed, result.stats.forwards)
    assert slow.sat_out == result.stats.forwards - slow.proposed  # shown every step it sat out


def test_a_paused_head_sits_out_then_drafts_again_exactly():
    model = model_of("llama", "sdpa")
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model), latency=CURVE)
    decoder.budget.switch.paused = 8  # measured not to pay: the next 8 steps go without it
    result = decoder.generate(prompts(1)[0], NEW_TOKENS, eos_token_id=[])
    assert torch.equal(result.sequences, reference("llama", "sdpa", 0, None))
    assert result.stats.undrafted_steps >= 8 and result.stats.candidates > 0  # sat out, then drafted again


def test_in_reproducible_mode_the_head_sits_out_on_priced_rates_alike_every_run():
    """Reproducible choices time nothing: the switch compares rates priced on the curve (the head's forwards at
    their own costs, here a twentieth of the target's 1-token forward each). A random head, almost never right,
    prices slower than decoding without it and is paused, at the same steps in two fresh decoders; an oracle head
    (a negative control) prices faster and drafts on after plain decoding's one measurement. Every text is
    generate's."""
    from forerun.costmodel.switch import PAUSE_STEPS

    model = model_of("llama", "sdpa")
    truth = reference("llama", "sdpa", 0, None)[0].tolist()

    def run(head):
        decoder = forerun.Decoder(model, None, "eagle3", draft_head=head, latency=CURVE, reproducible=True)
        (drafter,) = decoder.drafters
        share = forerun.LatencyCurve((1,), (CURVE.cost(1) / 20,))  # a real head's forward against its target's
        drafter.costs = HeadCosts(level=share, read=share)
        result = decoder.generate(prompts(1)[0], NEW_TOKENS, eos_token_id=[])
        assert result.sequences[0].tolist() == truth
        return result.stats, decoder.budget.switch

    (first, switch), (second, _) = run(random_head(model)), run(random_head(model))
    assert switch.rates[True] < switch.rates[False] and switch.pause > PAUSE_STEPS and first.undrafted_steps >= 8
    assert (first.undrafted_steps, first.forwards) == (second.undrafted_steps, second.forwards)
    oracle = random_head(model, draft_vocab=VOCAB)
    oracle.d2t.zero_()
    stats, switch = run(OracleHead(oracle, truth))
    assert switch.rates[True] > 2 * switch.rates[False] and stats.accepted >= NEW_TOKENS // 2
    assert switch.pause == PAUSE_STEPS  # never found slower (the one pause measured plain decoding)


class CostlyOracle(OracleDrafter):
    """The oracle, marked costly (as a trained head is): the switch weighs it against the other drafters."""

    name = "costly_oracle"
    costly = True

    def __init__(self, truth: list[int], depth: int, vocab: int) -> None:
        super().__init__(truth, depth, vocab)
        self.proposed = 0

    def propose(self, ctx):
        self.proposed += 1
        return super().propose(ctx)

    def sit_out(self, ctx, outcome):
        pass


@pytest.mark.parametrize("free", ["oracle", "random"])
def test_a_paired_switch_weighs_the_head_against_what_the_other_drafters_alone_would_write(free):
    """Reproducible choices, a costly oracle one token deep: beside a free oracle six deep, each of its steps
    would have written the same text at the same price without it, so it sits out after its first probe; beside a
    free drafter that is never right, the others alone would write one token a step, and it drafts on. Every text
    is generate's."""
    model = model_of("llama", "sdpa")
    truth = reference("llama", "sdpa", 0, None)[0].tolist()
    other = OracleDrafter(truth, 6, VOCAB) if free == "oracle" else RandomDrafter(truth, VOCAB, width=2, depth=2)
    costly = CostlyOracle(truth, 1, VOCAB)
    decoder = forerun.Decoder(
        model, None, "plain", drafters=[other, costly], latency=CURVE, adaptive=True, reproducible=True
    )
    switch = decoder.budget.switch
    assert switch.paired
    switch.probing = 4
    result = decoder.generate(prompts(1)[0], NEW_TOKENS, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    if free == "oracle":
        assert not switch.drafting() and costly.proposed <= 5  # the prefill's proposal, then the 4-step probe
        assert switch.rates[True] < DRAFT_MARGIN * switch.rates[False]
    else:
        assert switch.drafting() and costly.proposed == result.stats.forwards
        assert switch.rates[True] > 1.5 * switch.rates[False]


def test_a_paired_switch_weighs_the_text_written_not_each_step_alike():
    """Nine steps where the head writes 2 tokens in 1.0 s that would take the others 1.6 s, one where another
    drafter's long guess writes 10 tokens in 0.5 s against the head's 1.0 s: by the text, the head is ahead (28
    tokens in 10 s against 14.9 s); a mean of the steps' rates would have put it behind (2.8 against 3.1)."""
    from forerun.costmodel import DraftSwitch

    switch = DraftSwitch(paired=True, probing=10)
    for _ in range(9):
        switch.record_pair(2, 1.0, 2, 1.6)
    switch.record_pair(10, 1.0, 10, 0.5)
    assert switch.drafting() and switch.rates[True] > DRAFT_MARGIN * switch.rates[False]


class PromptFeatureRecorder(FeatureRecorder):
    """`FeatureRecorder` for a batch: its rows are shallow copies sharing `seen`, so it files by the row's prompt."""

    def observe(self, ctx, outcome):
        seen = self.seen.setdefault(tuple(ctx.tokens[:PROMPT]), {})
        end = len(ctx.tokens) - 1
        for offset, row in enumerate(outcome.features):
            seen[end - len(outcome.features) + offset] = row


PROMPT = 24  # tokens of each of `prompts`' prompts


def test_a_batch_hands_each_row_the_features_of_its_own_positions():
    model = model_of("llama", "sdpa")
    recorder = PromptFeatureRecorder()
    decoder = forerun.Decoder(model, None, "plain", drafters=[recorder], adaptive=False)
    results = decoder.generate_batch(prompts(3), 20, eos_token_id=[])
    assert len(recorder.seen) == 3
    for result in results:
        sequence = result.sequences
        seen = recorder.seen[tuple(sequence[0, :PROMPT].tolist())]
        assert sorted(seen) == list(range(sequence.shape[1] - 1))  # every position but the last token's, once
        with torch.inference_mode():
            states = model(sequence, output_hidden_states=True).hidden_states
        features = torch.stack([seen[p] for p in sorted(seen)]).chunk(3, dim=-1)
        torch.testing.assert_close(features[1], states[1][0, :-1], rtol=1e-4, atol=1e-4)


def test_an_oracle_head_in_a_batch_is_accepted_at_full_depth():
    """Rows of a batch draft with their head as a lone row does: the batch's forward hands each row's head its
    features (with no features handed over, the head drafts nothing and this fails)."""
    model = model_of("llama", "sdpa")
    truth = reference("llama", "sdpa", 0, None)[0].tolist()
    head = random_head(model, draft_vocab=VOCAB)
    head.d2t.zero_()
    # a static budget shares its nodes among the rows: 5 each, the root and a chain of 4
    chain = dict(adaptive=False, max_tree_nodes=10, depth=4, topk=1, width=1)
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=OracleHead(head, truth), **chain)
    first, other = decoder.generate_batch([prompts(1)[0], prompts(2)[1]], NEW_TOKENS, eos_token_id=[])
    assert first.sequences[0].tolist() == truth
    assert torch.equal(other.sequences, reference("llama", "sdpa", 1, None))  # its oracle is wrong: still exact
    assert first.stats.accepted_hist[4] >= first.stats.forwards - 3


@pytest.mark.parametrize("catch_up", [64, 0])
def test_a_paused_batch_taps_its_forwards_and_its_heads_draft_at_once_after(catch_up):
    """While a batch's rows do not draft (its policy measured drafting not paying), its forwards are still tapped
    and each row's head keeps the positions written, with no forward of its own (`sit_out`); the first drafted step
    after the pause reads them in one forward, and the oracle head is accepted there at once. With `catch_up=0`
    (the control: a head that keeps nothing, as a paused batch's heads had) it starts over and that step accepts
    nothing. Both rows equal generate."""
    from transformers import MaxLengthCriteria, StoppingCriteriaList

    from forerun.batch import Batch, RowJob, fork
    from forerun.transcript import Transcript

    model = model_of("llama", "sdpa")
    truth = reference("llama", "sdpa", 0, None)[0].tolist()
    head = random_head(model, draft_vocab=VOCAB)
    head.d2t.zero_()
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=OracleHead(head, truth), latency=CURVE,
                              catch_up=catch_up)  # fmt: skip
    batch = Batch(model, decoder.budget)
    jobs = []
    for prompt in prompts(2):
        criteria = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + NEW_TOKENS)])
        jobs.append(
            RowJob(prompt, Transcript(prompt.clone(), criteria), fork(decoder.drafters), frozenset(), NEW_TOKENS)
        )
    rows = [batch.add(job) for job in jobs]
    for _ in range(3):  # drafted steps: the oracle's chances are learned
        batch.step()
    batch.policy.switch.paused = 6
    written = len(jobs[0].transcript.sources)
    for _ in range(6):
        batch.step()
    oracle = rows[0].job.drafters[0]
    assert len(jobs[0].transcript.sources) == written + 6  # a token a step, no drafts
    batch.learn()  # the last paused step's, put off to the next forward (learnt before any proposal anyway)
    waiting = sum(len(tokens) for tokens, _, _ in oracle.pending)
    assert (waiting, oracle.last is None) == ((6, False) if catch_up else (0, True))
    written = len(jobs[0].transcript.sources)
    batch.step()  # drafting again
    accepted = len(jobs[0].transcript.sources) - written - 1
    assert accepted >= 2 if catch_up else accepted == 0
    while batch.rows:
        batch.step()
    for index, job in enumerate(jobs):
        assert torch.equal(job.transcript.sequence, reference("llama", "sdpa", index, None)), index


@pytest.mark.parametrize("oracle", [False, True])
def test_a_batch_weighs_its_rows_heads_at_their_share_of_the_forward(oracle):
    """Reproducible choices, three rows: one switch for the rows' costly drafters hears every row's steps, priced at
    the row's share of the batch's forward and its head's forwards whole (here a twentieth of the target's 1-token
    forward each). A random head, almost never right, is paused and the rows' heads sit out most steps; an oracle
    head (the control, every row the same prompt) drafts on. Every row equals generate."""
    from transformers import MaxLengthCriteria, StoppingCriteriaList

    from forerun.batch import Batch, RowJob, fork
    from forerun.costmodel.switch import PAUSE_STEPS
    from forerun.transcript import Transcript

    model = model_of("llama", "sdpa")
    indices = [0, 0, 0] if oracle else [0, 1, 2]
    truth = reference("llama", "sdpa", 0, None)[0].tolist()
    head = random_head(model)
    if oracle:  # one-hot logits over the target's own vocabulary
        head = random_head(model, draft_vocab=VOCAB)
        head.d2t.zero_()
        head = OracleHead(head, truth)
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=head, latency=CURVE, reproducible=True)
    share = forerun.LatencyCurve((1,), (CURVE.cost(1) / 20,))
    decoder.drafters[0].costs = HeadCosts(level=share, read=share)  # the rows' copies price alike
    batch = Batch(model, decoder.budget)
    jobs = []
    for index in indices:
        prompt = prompts(3)[index]
        criteria = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + NEW_TOKENS)])
        jobs.append(
            RowJob(prompt, Transcript(prompt.clone(), criteria), fork(decoder.drafters), frozenset(), NEW_TOKENS)
        )
    rows = [batch.add(job) for job in jobs]
    proposed = 0
    while batch.rows:
        batch.step()
        proposed += sum(row.costly_drafting for row in batch.rows)
    steps = sum(row.stats.forwards for row in rows)
    switch = batch.policy.costly
    if oracle:
        assert switch.pause == PAUSE_STEPS and switch.rates[True] > 1.5 * switch.rates[False]
        assert sum(row.stats.accepted for row in rows) >= 3 * NEW_TOKENS // 2
    else:
        assert switch.pause > PAUSE_STEPS and switch.rates[True] < switch.rates[False]
        assert proposed < steps // 2, (proposed, steps)  # the heads sat out most row-steps
    for job, index in zip(jobs, indices, strict=True):
        assert torch.equal(job.transcript.sequence, reference("llama", "sdpa", index, None)), index
