"""The growing answer of one request: its tokens, where each came from, its stopping criteria, streamer and
log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteriaList

from forerun.logprobs import TokenLogprob, token_logprobs


@dataclass
class Transcript:
    """The growing sequence [1, prompt + new], checked against the stopping criteria one token at a time."""

    sequence: torch.Tensor
    stopping: StoppingCriteriaList
    streamer: object | None = None
    sources: list[str] = field(default_factory=list)
    """Per new token: 'model' (the target's own step) or the name of the drafter it was accepted from."""
    done: bool = False
    logprobs_top: int | None = None
    """None: no log-probabilities; k >= 0: each new token's log-probability and the k likeliest alternatives."""
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def extend(self, tokens: list[int], sources: list[str], rows: torch.Tensor | None = None) -> list[int]:
        """Append tokens until a criterion fires (exactly where plain generate stops); return those appended.

        `rows` [len(tokens), vocab]: the raw logits each token was chosen from (for log-probabilities).
        """
        taken = []
        for token, source in zip(tokens, sources, strict=True):
            self.sequence = torch.cat([self.sequence, self.sequence.new_tensor([[token]])], dim=1)
            self.sources.append(source)
            taken.append(token)
            if bool(self.stopping(self.sequence, None).any()):
                self.done = True
                break
        entries = []
        if self.logprobs_top is not None and rows is not None and taken:
            entries = token_logprobs(rows, taken, self.logprobs_top)
            self.logprobs.extend(entries)
        if self.streamer is not None and taken:
            note_logprobs = getattr(self.streamer, "note_logprobs", None)
            if note_logprobs is not None and entries:  # optional: streamers that send log-probabilities per chunk
                note_logprobs(entries)
            note_sources = getattr(self.streamer, "note_sources", None)
            if note_sources is not None:  # optional: streamers that colour tokens by origin (forerun chat)
                note_sources(self.sources[len(self.sources) - len(taken) :])
            self.streamer.put(self.sequence.new_tensor(taken))
        return taken
