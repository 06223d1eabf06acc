"""What the drop-in (`forerun.hf`) needs per row of a left-padded batch: the logits processors as plain batched
generate runs them on that row, and the per-step `scores` / `logits` it returns.

transformers builds one processor list for the whole padded batch: lengths count from the padded prompt
(`min_new_tokens`, `exponential_decay_length_penalty`), and some processors hold one entry per row (the repetition
penalty's padding lengths). forerun verifies each row on its own, so each row gets a view of that list
(`PaddedRowProcessors`): its own entries, and its tokens behind its own padding, as batched generate shows them.

Example (the repetition penalty of a batch whose row 1 has 2 pads: that row's view skips them, not row 0's 0):
    >>> penalty = RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.tensor([0, 2]))
    >>> view = PaddedRowProcessors(LogitsProcessorList([penalty]), torch.tensor([[0, 0]]), row=1)
    >>> view[0].prompt_ignore_length
    2
    >>> view(torch.tensor([[3]]), torch.zeros(1, 4)).shape             # the row's own tokens, unpadded
    torch.Size([1, 4])
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from forerun.transcript import Transcript


class PaddedRowProcessors(LogitsProcessorList):
    """Row `row`'s view of a batch's processors: called with the row's own tokens [k, n] (k prefixes of one
    length), it runs them on those tokens behind the row's padding `pads` [1, p] (p may be 0), as plain batched
    generate does. A list of the row's own copies, so `forerun.draws` still knows their kinds."""

    def __init__(self, processors: LogitsProcessorList | None, pads: torch.Tensor, row: int) -> None:
        super().__init__(row_copy(processor, row) for processor in processors or ())
        self.pads = pads

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.FloatTensor:
        if self.pads.shape[1]:
            pads = self.pads.to(input_ids.device).expand(input_ids.shape[0], -1)
            input_ids = torch.cat([pads, input_ids], dim=1)
        return super().__call__(input_ids, scores, **kwargs)


def row_copy(processor: LogitsProcessor, row: int) -> LogitsProcessor:
    """`processor` for row `row` alone: its per-row entries taken for that row (the repetition penalty's padding
    lengths, which transformers gives a batch as a tensor [rows]; a `prefix_allowed_tokens_fn`'s batch index); a
    processor holding nothing per row as it is."""
    if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
        processor.prompt_ignore_length, torch.Tensor
    ):
        own = copy.copy(processor)
        own.prompt_ignore_length = int(processor.prompt_ignore_length[row])
        return own
    if type(processor) is PrefixConstrainedLogitsProcessor and processor._num_beams == 1:
        own = copy.copy(processor)
        rule = processor._prefix_allowed_tokens_fn
        own._prefix_allowed_tokens_fn = lambda _, tokens: rule(row, tokens)  # the row's index in the batch, as there
        return own
    return processor


def step_scores(
    transcripts: list[Transcript],
    processors: list[LogitsProcessorList],
    pad_id: int,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The drop-in's `scores` and `logits`: one [rows, vocab] fp32 tensor per new position of the longest row, as
    `model.generate(..., output_scores=True, output_logits=True, return_dict_in_generate=True)` returns them.

    `logits` are the raw logits each token was chosen from (the verify forward's row: in fp32 they equal plain
    generate's up to the rounding of a tree forward); `scores` are those after the row's processors, applied with
    the row's tokens before that position. A row that ended before the longest one "writes" the pad token there
    with certainty (0 at `pad_id`, -inf elsewhere, in both), so `model.compute_transition_scores` gives 0 there.
    """
    steps = max(len(t.logits) for t in transcripts)
    if steps == 0:
        return (), ()
    template = next(t.logits[0] for t in transcripts if t.logits)  # [vocab]: a row's dtype and device
    scores: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    logits: list[list[torch.Tensor]] = [[] for _ in range(steps)]
    for transcript, processor in zip(transcripts, processors, strict=True):
        sequence, new = transcript.sequence, len(transcript.logits)
        first = sequence.shape[1] - new
        for step in range(steps):
            if step < new:
                raw = transcript.logits[step][None]  # [1, vocab]
                prefix = sequence[:, : first + step].to(raw.device)
                logits[step].append(raw)
                scores[step].append(processor(prefix, raw.clone()) if processor else raw)
            else:
                ended = torch.full_like(template[None], -torch.inf)
                ended[0, pad_id] = 0.0
                logits[step].append(ended)
                scores[step].append(ended)
    return tuple(torch.cat(s) for s in scores), tuple(torch.cat(s) for s in logits)
