"""OpenAI's frequency and presence penalties (`forerun.penalties`) on hand-made ids and scores, and their checks."""

from __future__ import annotations

import pytest
import torch

from forerun.penalties import OccurrencePenalty
from forerun.request import GenerationRequest


def test_each_answer_token_is_lowered_by_its_count_and_its_presence():
    ids = torch.tensor([[4, 4, 1, 2, 1, 1]])  # prompt 4, 4; answer 1, 2, 1, 1
    got = OccurrencePenalty(0.5, 2.0, prompt_length=2)(ids, torch.ones(1, 6))
    assert got.tolist() == [[1.0, 1 - 1.5 - 2.0, 1 - 0.5 - 2.0, 1.0, 1.0, 1.0]]  # the prompt's 4 is not counted
    everything = OccurrencePenalty(0.5, 2.0, prompt_length=0)(ids, torch.ones(1, 6))
    assert everything[0, 4] == 1 - 1.0 - 2.0  # the control: counted as an answer token, the prompt's 4 is lowered


def test_a_row_is_penalised_alone_whatever_shares_its_call():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (5, 12), generator=generator)
    scores = torch.randn(5, 50, generator=generator)
    penalty = OccurrencePenalty(0.3, -0.7, prompt_length=4)
    together = penalty(ids, scores)
    for row in range(5):
        assert torch.equal(together[row], penalty(ids[row : row + 1], scores[row : row + 1])[0])
    assert not torch.equal(together, scores)
    assert torch.equal(OccurrencePenalty(0.0, 0.0, 4)(ids, scores), scores)


def test_the_scores_given_are_left_as_they_were():
    scores = torch.zeros(1, 4)
    OccurrencePenalty(1.0, 1.0, 0)(torch.tensor([[1, 2]]), scores)
    assert torch.equal(scores, torch.zeros(1, 4))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(frequency_penalty=2.5), "frequency_penalty must be between -2 and 2, got 2.5"),
        (dict(presence_penalty=-3), "presence_penalty must be between -2 and 2, got -3"),
        (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
        (dict(frequency_penalty="1"), "frequency_penalty must be a finite number"),
        (dict(frequency_penalty=True), "frequency_penalty must be a finite number"),
    ],
)
def test_a_penalty_out_of_openais_range_is_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        GenerationRequest.of("Hi", 8, **settings)


def test_a_penalty_makes_a_greedy_request_processed():
    assert GenerationRequest.of("Hi", 8, presence_penalty=0.5).processed
    assert not GenerationRequest.of("Hi", 8, presence_penalty=0, frequency_penalty=0.0).processed
    assert not GenerationRequest.of("Hi", 8, presence_penalty=None, frequency_penalty=None).processed  # JSON's null
    with pytest.raises(ValueError, match="prompt_length"):
        OccurrencePenalty(1.0, 1.0, prompt_length=-1)
