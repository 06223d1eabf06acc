"""Token ids -> server-sent text deltas, with stop strings held back and never sent.

A streamer (`put`/`end`, as transformers') runs in the generation thread; deltas go to an asyncio queue the
response reads. Text comes from the one incremental detokenizer (`forerun.text.IncrementalText`, no half
characters), and its last characters are held back while they could still be the start of a stop string.

Example:
    >>> stream = TokenStream(tokenizer, loop, stops=["\\n\\n"])      # doctest: +SKIP
    >>> # model writes "a\\n" -> sends "a" (the "\\n" may start a stop); then "\\nb" -> the stop: nothing more
"""

from __future__ import annotations

import asyncio

from forerun.logprobs import entries_before
from forerun.stopping import HeldText
from forerun.text import IncrementalText


class TokenStream:
    """Streams (text delta, log-probability entries of its tokens) of a generation to `queue`; None marks the end.
    `started` is set once the generation has seen its prompt (checked, and given its place: the server sends the
    response's headers then). The entries ride with the delta their tokens' text is released in (none after a stop
    string); without logprobs asked, they are None."""

    def __init__(self, tokenizer, loop: asyncio.AbstractEventLoop, stops: list[str], logprobs: bool = False) -> None:
        self.loop, self.tokenizer = loop, tokenizer
        self.entries: list | None = [] if logprobs else None
        """Entries of tokens whose text is not sent yet (`note_logprobs`)."""
        self.text = IncrementalText(tokenizer)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = asyncio.Event()
        self.held = HeldText(stops)
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # transformers' convention: the prompt comes first
            self.prompt_seen = True
            self.loop.call_soon_threadsafe(self.started.set)
            return
        self.text.push(value.flatten().tolist())
        self.emit(final=False)

    def note_logprobs(self, entries) -> None:
        """The log-probabilities of the tokens the next `put` brings (`forerun.transcript.Transcript.extend`)."""
        if self.entries is not None:
            self.entries.extend(entries)

    def end(self) -> None:
        self.text.finish()
        self.emit(final=True)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    def emit(self, final: bool) -> None:
        delta = self.held.release(self.text.text, final)
        if delta:  # nothing is released after a stop string: one that has appeared appeared in this delta
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (delta, self.released(delta, self.held.stopped)))

    def released(self, delta: str, stopped: bool) -> list | None:
        """The entries to send with `delta`: all noted so far, or at a stop string those whose text the delta
        shows."""
        if self.entries is None:
            return None
        entries, self.entries = self.entries, []
        return entries_before(self.tokenizer, entries, len(delta) if stopped else None)
