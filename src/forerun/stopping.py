"""Stopping criteria of forerun's own: stop strings matched cheaply, and cancellation from another thread.

transformers' `StopStringCriteria` precomputes token tables per stop string (tens of milliseconds per string, a
5,000-character string took 34 s here): a server must not pay that per request. `StopStrings` instead decodes the
tail of the new text after each token and looks for the strings in it: the cost is one small decode per token,
whatever the strings. It fires at the token that completes a stop string (the token stays in the sequence; the
text is cut at the string by whoever shows it, as `first_stop` does), as transformers' criterion does.

Example:
    >>> stop = StopStrings(tokenizer, ["\\n\\n", "```"], prompt_len=12)      # doctest: +SKIP
    >>> first_stop("a, b\\n\\nc", ["\\n\\n"])
    4
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from transformers import StoppingCriteria


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    positions = [text.find(s) for s in stops if s and s in text]
    return min(positions) if positions else None


class HeldText:
    """What of a growing text may be shown while it is written: everything before the first stop string, less the
    last characters while they could still begin one (shown at the end if none follows). One per answer.

    Example (stop "\\n\\n": "a\\n" shows "a", the "\\n" held; "a\\n\\nb" has the stop: nothing more):
        >>> held = HeldText(["\\n\\n"])
        >>> held.release("a\\n"), held.release("a\\n\\nb"), held.stopped, held.release("a\\n\\nbc", final=True)
        ('a', '', True, '')
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.shown = 0
        """Characters of the text released so far."""
        self.stopped = False
        """Whether a stop string has appeared (nothing is released after it)."""

    def release(self, text: str, final: bool = False) -> str:
        """The part of `text` (the whole answer so far) not released before that may be shown now; `final`: the
        answer is complete, nothing is held back."""
        if self.stopped:
            return ""
        cut = first_stop(text, self.stops)
        if cut is not None:
            text, self.stopped = text[:cut], True
        elif not final:
            text = text[: max(self.shown, len(text) - self.holdback)]
        delta = text[self.shown :]
        self.shown = max(self.shown, len(text))
        return delta


class StopStrings(StoppingCriteria):
    """True once the text generated after `prompt_len` tokens contains one of `stops`."""

    def __init__(self, tokenizer, stops: Sequence[str], prompt_len: int) -> None:
        if tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer, self.stops, self.prompt_len = tokenizer, list(stops), prompt_len
        # A string of n characters spans at most n tokens (+ a few that decode to nothing, e.g. byte pieces).
        self.window = max(len(s) for s in self.stops) + 8

    def __call__(self, input_ids: torch.Tensor, scores: object, **kwargs: object) -> torch.Tensor:
        done = []
        for row in input_ids:
            new = row[self.prompt_len :]
            tail = self.tokenizer.decode(new[-self.window :], skip_special_tokens=False)
            done.append(first_stop(tail, self.stops) is not None)
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class Cancelled(StoppingCriteria):
    """Stops generation once `event` is set (a client went away, a timeout fired, the server shuts down)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: object, **kwargs: object) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)
