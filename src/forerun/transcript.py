"""The growing answer of one request: its tokens, where each came from, its stopping criteria, streamer and
log-probabilities."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from forerun.logprobs import TokenLogprob, token_logprobs


@dataclass
class Transcript:
    """The growing sequence [1, prompt + new], checked against the stopping criteria one token at a time.

    The tokens taken under plain limits are held in a list and joined to the tensor when `sequence` is read (a
    logits processor, a criterion, the result), not at every step: a batch of many rows paid a concatenation
    and a new tensor per row per step for a sequence most steps never read.

    Example:
        >>> t = Transcript(torch.tensor([[5, 6]]), StoppingCriteriaList([MaxLengthCriteria(4)]))
        >>> t.extend([7, 8, 9], ["model"] * 3), t.length, t.done, t.sequence.tolist()
        ([7, 8], 4, True, [[5, 6, 7, 8]])
    """

    held: torch.Tensor
    """[1, n]: the sequence as last joined; `pending` follows it."""
    stopping: StoppingCriteriaList
    streamer: object | None = None
    sources: list[str] = field(default_factory=list)
    """Per new token: 'model' (the target's own step) or the name of the drafter it was accepted from."""
    done: bool = False
    logprobs_top: int | None = None
    """None: no log-probabilities; k >= 0: each new token's log-probability and the k likeliest alternatives."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    keep_logits: bool = False
    """True: keep each new token's raw logits row in `logits` (`output_logits`/`output_scores` of the drop-in)."""
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)
    """Per new token, where `keep_logits`: the raw logits [vocab] it was chosen from, in fp32 on the model's device."""

    limits: tuple[float, frozenset[int]] | None = field(init=False, default=None)
    """The stopping criteria as a length and EOS ids where that is all they are (`simple_limits`)."""

    pending: list[int] = field(default_factory=list, repr=False)
    """Tokens taken since `held` was last joined."""

    def __post_init__(self) -> None:
        self.limits = simple_limits(self.stopping)

    @property
    def sequence(self) -> torch.Tensor:
        """[1, prompt + new] on the host."""
        if self.pending:
            self.held = torch.cat([self.held, self.held.new_tensor([self.pending])], dim=1)
            self.pending = []
        return self.held

    @property
    def wants_logits(self) -> bool:
        """Whether `extend` needs the rows the new tokens were chosen from."""
        return self.keep_logits or self.logprobs_top is not None

    @property
    def length(self) -> int:
        """Prompt and new tokens so far (without joining them)."""
        return self.held.shape[1] + len(self.pending)

    def extend(self, tokens: list[int], sources: list[str], rows: torch.Tensor | None = None) -> list[int]:
        """Append tokens until a criterion fires (exactly where plain generate stops); return those appended.

        `rows` [len(tokens), vocab]: the raw logits each token was chosen from (for log-probabilities).
        """
        taken = self.take(tokens, sources) if self.limits is not None else self.take_checked(tokens, sources)
        entries = []
        if self.keep_logits and rows is not None and taken:
            self.logits.extend(rows[: len(taken)].float().unbind(0))
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
            self.streamer.put(self.held.new_tensor(taken))
        return taken

    def take(self, tokens: list[int], sources: list[str]) -> list[int]:
        """`extend`'s tokens under a length and EOS alone (`limits`): checked in Python and held in `pending` (a
        criterion call per token costs tensor ops on the host between a card's steps)."""
        max_length, eos = self.limits
        taken, length = [], self.length
        for token, source in zip(tokens, sources, strict=True):
            self.sources.append(source)
            taken.append(token)
            length += 1
            if length >= max_length or token in eos:
                self.done = True
                break
        self.pending.extend(taken)
        return taken

    def take_checked(self, tokens: list[int], sources: list[str]) -> list[int]:
        """`extend`'s tokens, each checked by calling the stopping criteria on the grown sequence."""
        taken = []
        for token, source in zip(tokens, sources, strict=True):
            self.held = torch.cat([self.sequence, self.held.new_tensor([[token]])], dim=1)
            self.sources.append(source)
            taken.append(token)
            if bool(self.stopping(self.sequence, None).any()):
                self.done = True
                break
        return taken


def simple_limits(stopping: StoppingCriteriaList) -> tuple[float, frozenset[int]] | None:
    """(max length, EOS ids) when `stopping` is only transformers' length and EOS criteria (what they check, in
    Python), else None (stop strings, cancellation, max_time...: the criteria themselves are called).

    Example:
        >>> simple_limits(StoppingCriteriaList([MaxLengthCriteria(12), EosTokenCriteria([2, 0])]))
        (12, frozenset({0, 2}))
    """
    max_length, eos = math.inf, set()
    for criterion in stopping:
        if type(criterion) is MaxLengthCriteria:
            max_length = min(max_length, criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos.update(criterion.eos_token_id.flatten().tolist())
        else:
            return None
    return max_length, frozenset(eos)
