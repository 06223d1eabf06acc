"""Every node's sampled draw at once (`forerun.draws`) equals the walk's, node by node, on hand-made logits.

The tree has three levels, two branches and repeated tokens, and the logits are peaked over a 24-token vocabulary,
so a processor that read the wrong prefix (the root's for every node, or another node's) would change draws:
the negative control below shows that it does.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
)

from forerun import draws
from forerun.hf_rows import PaddedRowProcessors
from forerun.host_copy import to_host
from forerun.noise import GumbelNoise
from forerun.penalties import OccurrencePenalty
from forerun.transcript import Transcript
from forerun.tree import TokenTree
from forerun.verify import NodeScores

VOCAB = 24
PREFIX = [[4, 9, 4, 11, 7]]


def tree() -> TokenTree:
    """root(7) - 4 - 9 - 4, root - 4 - 11, root - 12 - 4 (a probe): tokens of the prefix again, at every depth."""
    t = TokenTree.rooted_at(7)
    a = t.add(0, 4)
    b = t.add(a, 9)
    t.add(b, 4)
    t.add(a, 11)
    c = t.add(0, 12)
    t.add(c, 4, role="probe")
    return t


PROCESSORS = {
    "none": [],
    "temperature-top_k-top_p": [TemperatureLogitsWarper(0.8), TopKLogitsWarper(6), TopPLogitsWarper(0.9)],
    "min_p-typical": [MinPLogitsWarper(0.05), TypicalLogitsWarper(0.95)],
    "epsilon-eta": [EpsilonLogitsWarper(0.02), EtaLogitsWarper(0.02)],
    "repetition": [RepetitionPenaltyLogitsProcessor(4.0), TemperatureLogitsWarper(1.3)],
    "no_repeat_ngram": [NoRepeatNGramLogitsProcessor(2)],
    # OpenAI's penalties: the answer is the prefix after its first 2 tokens, then each node's path
    "occurrence": [OccurrencePenalty(1.5, 2.0, prompt_length=2), TemperatureLogitsWarper(0.8)],
    "sequence_bias-min_new": [
        SequenceBiasLogitsProcessor({(9, 4): -8.0, (4,): 3.0}),
        MinNewTokensLengthLogitsProcessor(4, 3, [12]),
    ],
    # the drop-in's view of a padded batch's row 1 (2 pads): lengths from the padded prompt, its own padding skipped
    "padded_row": PaddedRowProcessors(
        LogitsProcessorList(
            [
                RepetitionPenaltyLogitsProcessor(4.0, prompt_ignore_length=torch.tensor([0, 2])),
                MinNewTokensLengthLogitsProcessor(7, 3, [12]),
            ]
        ),
        torch.tensor([[0, 0]]),
        row=1,
    ),
}


def scored(processor: list, seed: int) -> NodeScores:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(tree()), VOCAB, generator=generator) * 3
    transcript = Transcript(torch.tensor(PREFIX), [])
    if not isinstance(processor, PaddedRowProcessors):
        processor = LogitsProcessorList(processor) or None
    return NodeScores(logits, processor, transcript, tree())


def walked(scores: NodeScores, noise: GumbelNoise) -> list[int]:
    """The lazy walk's draw at every node (`verify_sampled` asks for the walked ones only)."""
    return [
        noise.draw(scores.scores(node), scores.committed.length + depth)
        for node, depth in enumerate(scores.tree.depths)
    ]


@pytest.mark.parametrize("kind", PROCESSORS)
def test_draws_at_once_equal_the_walk_at_every_node(kind):
    for seed in range(40):
        scores = scored(PROCESSORS[kind], seed)
        at_once = draws.drawn(scores, GumbelNoise(seed))
        assert at_once is not None and at_once.dtype == torch.int64
        assert at_once.tolist() == walked(scores, GumbelNoise(seed)), (kind, seed)
        every = draws.scored(scores)  # the scores themselves, bit for bit (a near-tie alone would not show)
        for node in range(len(scores.tree)):
            assert torch.equal(every[node], scores.scores(node)), (kind, seed, node)


@pytest.mark.parametrize("kind", PROCESSORS)
def test_greedy_choices_at_once_equal_the_walks_argmax_at_every_node(kind):
    for seed in range(40):
        scores = scored(PROCESSORS[kind], seed)
        at_once = draws.chosen(scores)
        assert at_once is not None and at_once.dtype == torch.int64
        assert at_once.tolist() == [scores.argmax(node) for node in range(len(scores.tree))], (kind, seed)


@pytest.mark.parametrize("kind", PROCESSORS)
def test_the_base_logits_are_left_as_they_were(kind):
    scores = scored(PROCESSORS[kind], 0)
    before = scores.logits.clone()
    draws.drawn(scores, GumbelNoise(0))
    assert torch.equal(scores.logits, before)


@pytest.mark.parametrize("kind", ["repetition", "no_repeat_ngram", "sequence_bias-min_new", "occurrence"])
def test_negative_control_a_prefix_read_processor_scored_without_its_prefix_draws_otherwise(kind, monkeypatch):
    """Taken for a processor that reads no prefix (every node scored with the root's), it changes draws: the
    equality above can fail."""
    monkeypatch.setattr(draws, "PREFIX_FREE", draws.PREFIX_FREE + draws.ROW_WISE)
    differ = sum(
        draws.drawn(scores := scored(PROCESSORS[kind], seed), GumbelNoise(seed)).tolist()
        != walked(scores, GumbelNoise(seed))
        for seed in range(40)
    )
    assert differ > 0


def test_processors_not_known_to_act_row_by_row_walk():
    constrained = PrefixConstrainedLogitsProcessor(lambda batch_id, ids: [1, 2], num_beams=1)

    class Doubled(TemperatureLogitsWarper):  # a subclass may read more than its parent
        pass

    assert draws.grouping(None) == "tree" and draws.grouping(LogitsProcessorList()) == "tree"
    assert draws.grouping(LogitsProcessorList(PROCESSORS["temperature-top_k-top_p"])) == "tree"
    assert draws.grouping(LogitsProcessorList(PROCESSORS["repetition"])) == "levels"
    for odd in (constrained, Doubled(0.5)):
        processor = LogitsProcessorList([TemperatureLogitsWarper(0.7), odd])
        assert draws.grouping(processor) is None
        assert (
            draws.drawn(
                NodeScores(torch.zeros(7, VOCAB), processor, Transcript(torch.tensor(PREFIX), []), tree()),
                GumbelNoise(0),
            )
            is None
        )


def test_rows_draws_travel_with_the_argmaxes_in_one_copy_and_keep_their_rows():
    assert to_host([None, None]) == [None, None]
    assert to_host([torch.tensor([3]), None, torch.tensor([5, 6, 7])]) == [[3], None, [5, 6, 7]]
    argmax = torch.arange(12).reshape(3, 4)[:, :3]  # a view of the base's outputs, as a step slices them
    assert to_host([argmax, torch.tensor([8, 9])]) == [argmax.tolist(), [8, 9]]
    assert to_host([torch.zeros(2, 0, dtype=torch.long), None]) == [[[], []], None]
