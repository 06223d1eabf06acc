"""OpenAI's frequency and presence penalties: a logits processor that reads only its own row's answer.

OpenAI (and vLLM) lower the logit of every token the answer already holds, by how often it does and by its being
there at all:

    logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)

where count[j] counts token j among the answer's tokens so far (the prompt is not counted; a penalty on the prompt
too is transformers' `repetition_penalty`). transformers has no such processor: this is forerun's, and
`model.generate(logits_processor=[OccurrencePenalty(...)])` places it where forerun does, after the processors
generate builds from its settings (repetition penalty, sequence bias, ...) and before the sampling warpers
(temperature, top-k, top-p): vLLM's order too (penalties, then temperature). So plain generate with it is the
reference every method is tested against.

Example (a prompt of 2 tokens; the answer so far is 3, 3, 1):
    >>> penalty = OccurrencePenalty(frequency=0.5, presence=1.0, prompt_length=2)
    >>> penalty(torch.tensor([[1, 0, 3, 3, 1]]), torch.zeros(1, 5)).tolist()
    [[0.0, -1.5, 0.0, -2.0, 0.0]]
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

REQUEST_FIELDS = ("frequency_penalty", "presence_penalty")
"""Their names as `GenerationRequest` fields, server fields and `forerun run` record fields (0 or None: none)."""


class OccurrencePenalty(LogitsProcessor):
    """Subtracts `frequency` per earlier occurrence of a token in the answer and `presence` once if it occurs.

    Each row of scores is computed from its own row of ids alone (a node of a tree scored as a row of a batch gets
    what it gets alone: `forerun.draws.ROW_WISE`); the ids are the prompt (`prompt_length` of them, padding
    included where a batch is padded) and then the answer.
    """

    def __init__(self, frequency: float, presence: float, prompt_length: int) -> None:
        if prompt_length < 0:
            raise ValueError(f"prompt_length must be >= 0, got {prompt_length}")
        self.frequency = float(frequency)
        self.presence = float(presence)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids [rows, length], scores [rows, vocab] -> the penalised scores [rows, vocab], a new tensor."""
        answer = input_ids[:, self.prompt_length :]
        ones = torch.ones(answer.shape, dtype=scores.dtype, device=scores.device)
        counts = torch.zeros_like(scores).scatter_add_(1, answer.to(scores.device), ones)
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence

    def __repr__(self) -> str:
        return f"OccurrencePenalty(frequency={self.frequency}, presence={self.presence}, prompt={self.prompt_length})"
