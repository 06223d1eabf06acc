"""A padded batch's row sees its processors as plain batched generate runs them: its tokens behind its own padding,
its own per-row entries (`forerun.hf_rows`)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor

from forerun.hf_rows import PaddedRowProcessors


class Seen(LogitsProcessor):
    """Records the token ids it is called with; leaves the scores alone."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls.append(input_ids.clone())
        return scores


def test_a_rows_processors_see_its_tokens_behind_its_padding_for_every_prefix():
    seen = Seen()
    view = PaddedRowProcessors(LogitsProcessorList([seen]), torch.tensor([[0, 0]]), row=1)
    prefixes = torch.tensor([[5, 6, 7], [5, 6, 8]])  # two prefixes of one length: a tree's level
    view(prefixes, torch.zeros(2, 10))
    assert torch.equal(view[0].calls[0], torch.tensor([[0, 0, 5, 6, 7], [0, 0, 5, 6, 8]]))


def test_an_unpadded_row_is_called_with_its_tokens_as_they_are():
    view = PaddedRowProcessors(LogitsProcessorList([Seen()]), torch.zeros(1, 0, dtype=torch.long), row=0)
    view(torch.tensor([[5, 6, 7]]), torch.zeros(1, 10))
    assert torch.equal(view[0].calls[0], torch.tensor([[5, 6, 7]]))


def test_a_length_counted_from_the_padded_prompt_holds_eos_back_as_batched_generate_does():
    """`min_new_tokens` counts from the padded prompt's length (5 here: 2 pads, 3 prompt tokens): after 1 new token
    the end of text is still held back in the padded row, as plain batched generate holds it."""
    rule = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=5, min_new_tokens=2, eos_token_id=9)
    view = PaddedRowProcessors(LogitsProcessorList([rule]), torch.tensor([[0, 0]]), row=1)
    scores = view(torch.tensor([[1, 2, 3, 4]]), torch.zeros(1, 10))  # the row's 3 prompt tokens and 1 new one
    assert scores[0, 9] == -float("inf")
    assert torch.isfinite(view(torch.tensor([[1, 2, 3, 4, 5]]), torch.zeros(1, 10))[0, 9])
