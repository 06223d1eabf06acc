"""Token ids -> server-sent text deltas, with stop strings held back and never sent.

A streamer (`put`/`end`, as transformers') runs in the generation thread; deltas go to an asyncio queue the
response reads. Text comes from the one incremental detokenizer (`forerun.text.IncrementalText`, no half
characters), and its last characters are held back while they could still be the start of a stop string. `deltas`
merges a response's streams as their deltas come; `started` waits until their generations have begun.

Example:
    >>> stream = TokenStream(tokenizer, loop, stops=["\\n\\n"])      # doctest: +SKIP
    >>> # model writes "a\\n" -> sends "a" (the "\\n" may start a stop); then "\\nb" -> the stop: nothing more
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from forerun.logprobs import entries_before
from forerun.server.errors import failed
from forerun.server.fields import APIError
from forerun.stopping import HeldText, first_stop
from forerun.text import IncrementalText
from forerun.thoughts import Thought, ThoughtMarks, ThoughtWatch, split
from forerun.tool_calls import before_calls, marked_at, read_answer
from forerun.tool_stream import CallPart, CallStream


@dataclass(frozen=True)
class Reasoning:
    """A delta of a reasoning model's thought (`forerun.thoughts`), with the log-probability entries of the tokens
    released with it (None where none were asked)."""

    text: str
    entries: list | None


class TokenStream:
    """Streams (text delta, log-probability entries of its tokens) of a generation to `queue`; None marks the end.
    `started` is set once the generation has seen its prompt (checked, and given its place: the server sends the
    response's headers then). The entries ride with the delta their tokens' text is released in (none after a stop
    string); without logprobs asked, they are None. Where tools are offered, text from a possible `<tool_call>` on
    is held: calls written in its blocks go out as they are written (`CallPart` items, `forerun.tool_stream`), and
    once the answer ends the rest is content (no calls in it) or the calls not yet sent, whole. Where
    `thoughts` (a chat's), a thought the answer (or its prompt) opens goes out as `Reasoning` items, the answer
    after it as content; while only whitespace has come, whether a thought opens is not known and it is held."""

    def __init__(
        self,
        tokenizer,
        loop: asyncio.AbstractEventLoop,
        stops: list[str],
        logprobs: bool = False,
        tools: Mapping[str, dict] | frozenset[str] | None = None,
        mark: int | None = None,
        thoughts: ThoughtMarks | None = None,
    ) -> None:
        self.loop, self.tokenizer = loop, tokenizer
        self.tools = tools
        """The tools offered, their names (or their parameters' schemas by name, which type an XML call's values;
        None: none; their calls are read out of the answer)."""
        self.mark, self.calls_at = mark, None
        """The special token a probed template's calls open with (`forerun.tool_specs.call_mark`), and where in the
        text it stood once the answer holds it (`forerun.tool_calls.marked_at`): the decoded text drops it."""
        self.follower = CallStream(tools) if tools is not None else None
        """Follows the calls of `<tool_call>` blocks, or after the mark, as they are written (None: no tools)."""
        self.entries: list | None = [] if logprobs else None
        """Entries of tokens whose text is not sent yet (`note_logprobs`)."""
        self.text = IncrementalText(tokenizer)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = asyncio.Event()
        self.held = HeldText(stops)
        self.prompt_seen, self.prompt_tokens = False, 0
        """Whether the prompt has come (the first `put`), and its tokens."""
        self.thoughts, self.watch = thoughts, None
        """The tokenizer's thought marks, and the answer's thought as it is written (`forerun.thoughts`)."""
        self.sent = ["", ""]
        """The reasoning and the content sent so far."""
        self.unsent = 0
        """Characters of the text released since the last entries went out."""

    def put(self, value) -> None:
        if not self.prompt_seen:  # transformers' convention: the prompt comes first
            self.prompt_seen, self.prompt_tokens = True, value.numel()
            if self.thoughts is not None:
                self.watch = ThoughtWatch(self.tokenizer, self.thoughts, value.flatten().tolist())
            self.loop.call_soon_threadsafe(self.started.set)
            return
        ids = value.flatten().tolist()
        if self.watch is not None:
            self.watch.push(ids)
        if self.tools is not None and self.calls_at is None and self.mark in ids:
            self.calls_at = marked_at(self.tokenizer, self.text.ids + ids, self.mark)
        self.text.push(ids)
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
        text, calls, words = self.text.text, (), ""
        thought = None if self.watch is None else self.watch.thought(len(text))
        after = 0 if thought is None else thought.after
        limit = len(text) if final or self.watch is None or not self.watch.undecided else 0
        if self.tools is not None:  # tools offered: what may be a call is not content until the answer is whole
            at = None if self.calls_at is None else self.calls_at - after
            if final:
                cut = first_stop(text, self.held.stops)
                found, calls = read_answer(text if cut is None else text[:cut], thought, self.tools, self.calls_at)
                words = found or ""
            held = before_calls(text[after:], bare=True, names=self.tools)
            held = held if at is None else min(held, max(at, 0))
            began = calls or self.follower.started
            limit = limit if final and not began else min(limit, after + held)
        self.unsent += len(self.held.release(text[:limit], final))
        self.send(text[: self.held.shown], thought, final)
        if self.tools is None:
            return
        parts = self.call_parts(text, thought, final, calls)
        # words after the calls, unless they hold a call that was streamed but not read (cut off: sent already)
        if calls and self.follower.agrees(calls) and words.startswith(self.sent[1]) and words[len(self.sent[1]) :]:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (words[len(self.sent[1]) :], None))
        for part in parts:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("", part))

    def call_parts(self, text: str, thought: Thought | None, final: bool, calls: tuple) -> list[CallPart]:
        """The parts of calls to send now: those written since the last step, followed in the text as far as no
        stop string can end it; once the answer is whole, the calls `calls` read from it not yet sent."""
        if not final and self.watch is not None and self.watch.undecided:  # where the answer begins is not known
            return []
        cut = first_stop(text, self.held.stops)
        shown = text[:cut] if cut is not None else text if final else text[: len(text) - self.held.holdback]
        answer = split(shown, thought)[1]
        if self.calls_at is not None and 0 <= self.calls_at - (len(shown) - len(answer)) <= len(answer):
            self.follower.mark_at(self.calls_at - (len(shown) - len(answer)))
        return self.follower.finish(answer, calls) if final else self.follower.follow(answer)

    def send(self, shown: str, thought: Thought | None, final: bool = False) -> None:
        """Queue what of the released text `shown` was not sent: its thought's part as `Reasoning`, the rest as
        content (the thought's marks and the whitespace at its ends are neither). At the end, the entries of tokens
        that wrote nothing (an end token) go out with no text, as the answer not streamed lists them."""
        reasoning, content = split(shown, thought) if thought is not None else (None, shown)
        deltas = [(now or "")[len(sent) :] for now, sent in zip((reasoning, content), self.sent, strict=True)]
        self.sent = [(reasoning or ""), content]
        if not any(deltas):
            if final and self.entries:
                entries, self.unsent = self.released(self.unsent, self.held.stopped), 0
                if entries:
                    self.loop.call_soon_threadsafe(self.queue.put_nowait, ("", entries))
            return
        entries = self.released(self.unsent, self.held.stopped)
        self.unsent = 0
        if deltas[0]:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("", Reasoning(deltas[0], entries)))
            entries = None if entries is None else []
        if deltas[1]:  # nothing is released after a stop string: one that has appeared appeared in this delta
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (deltas[1], entries))

    def released(self, shown: int, stopped: bool) -> list | None:
        """The entries to send with text just released, `shown` characters of it: all noted so far, or at a stop
        string those whose text it shows."""
        if self.entries is None:
            return None
        entries, self.entries = self.entries, []
        return entries_before(self.tokenizer, entries, shown if stopped else None)


def targets_of(runs: list[int], n: int) -> list[list[int]]:
    """The choice indices each stream feeds, the streams of every prompt in order (`runs[k]`: prompt k's): a
    stream's own (sampled choices, a run each) or all `n` of its prompt (greedy: one run shown n times).

    Example (two prompts of n=2, the first greedy, the second sampled):
        >>> targets_of([1, 2], 2)
        [[0, 1], [2], [3]]
    """
    return [
        [k * n + j for j in range(n)] if count == 1 else [k * n + i]
        for k, count in enumerate(runs)
        for i in range(count)
    ]


async def deltas(streams: list[TokenStream], task: asyncio.Task) -> AsyncIterator[tuple[int, str, list | None]]:
    """(stream index, text delta, logprob entries) of every stream as they come, until each has ended or the
    generation has failed."""
    getters = {asyncio.ensure_future(stream.queue.get()): run for run, stream in enumerate(streams)}
    try:
        while getters:
            succeeded = task.done() and not task.cancelled() and task.exception() is None
            waited = set(getters) if succeeded else {*getters, task}  # succeeded: its streams' ends are coming
            done, _ = await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            ready = sorted(done & set(getters), key=getters.__getitem__)
            for getter in ready:
                run = getters.pop(getter)
                item = getter.result()
                if item is not None:
                    yield run, *item
                    getters[asyncio.ensure_future(streams[run].queue.get())] = run
            if task in done and not ready:
                return  # it failed, and what its streams had sent is out: a failed row's stream may never end
    finally:
        for getter in getters:
            getter.cancel()


async def started(streams: list[TokenStream], task: asyncio.Task, cancel: threading.Event) -> None:
    """Wait until a streamed request's generations have all begun (their prompts checked, their places in the
    batch taken) or one failed before: a full queue, a bad knob, a prompt over the context, a timeout while queued
    then answer with their HTTP status (429 with Retry-After, 400, 504), not as an error event inside a 200 stream,
    so clients' status handling and retries work for streams too."""
    waiter = asyncio.ensure_future(asyncio.gather(*(stream.started.wait() for stream in streams)))
    try:
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        cancel.set()
        raise
    finally:
        waiter.cancel()
    if not all(stream.started.is_set() for stream in streams) and task.done():
        await task  # it failed before its first step: APIError -> its status


async def cancelling(events: AsyncIterator[str], task: asyncio.Task, cancel: threading.Event) -> AsyncIterator[str]:
    """`events`, sent; if the client goes away mid-stream (the response stops reading them), the generation is
    cancelled (`cancel`) after its current step."""
    try:
        async for item in events:
            yield item
    finally:
        if not task.done():
            cancel.set()


class LoneEvents(Protocol):
    """A lone generation's stream in another API's events (`forerun.server.responses_shaping.Events`,
    `forerun.server.anthropic_shaping.Events`): each call gives the events to send."""

    def opening(self) -> list[str]: ...
    def reasoning(self, delta: str) -> list[str]: ...
    def text(self, delta: str, logprobs: list | None) -> list[str]: ...
    def call(self, part: CallPart) -> list[str]: ...
    def finish(self, result: Any, method: str) -> list[str]: ...
    def fail(self, error: APIError) -> list[str]: ...


async def lone_events(
    events: LoneEvents, stream: TokenStream, task: asyncio.Task, shown: Callable[[list], list | None]
) -> AsyncIterator[str]:
    """A Responses or Messages stream: its opening, then its thought, words and calls as the generation writes
    them (`shown`: a delta's log-probability entries as the API sends them), then its end, or its failure told."""
    for event in events.opening():
        yield event
    async for _, delta, entries in deltas([stream], task):
        if isinstance(entries, CallPart):
            written = events.call(entries)
        elif isinstance(entries, Reasoning):
            written = events.reasoning(entries.text)
        else:
            written = events.text(delta, None if entries is None else shown(entries))
        for event in written:
            yield event
    try:
        decoder, done = await task
    except APIError as error:
        ending = events.fail(error)
    except Exception as error:  # noqa: BLE001 - a stream ends with its failure told, never cut
        ending = events.fail(failed(error))
    else:
        ending = events.finish(done[0][1][0], decoder.method)
    for event in ending:
        yield event
