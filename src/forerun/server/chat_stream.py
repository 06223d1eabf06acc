"""A completion's or chat completion's stream: every choice's chunks as its generation writes them, then each
choice's last chunk with its finish reason, the usage chunk where asked, and `data: [DONE]` (OpenAI's shapes from
`forerun.server.shaping`; the deltas from `forerun.server.stream`).

Example (what `Service.answer` sends for `stream: true`):
    >>> events = chat_events(tokenizer, streams, task, args, answer)              # doctest: +SKIP
    >>> StreamingResponse(cancelling(events, task, cancel), media_type="text/event-stream")  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from forerun.server.echo import prompt_counts
from forerun.server.errors import error_body, failed
from forerun.server.fields import APIError
from forerun.server.shaping import (
    DONE,
    Answer,
    Echo,
    call_chunk,
    chunk,
    echo_payload,
    event,
    logprobs_payload,
    opening,
    usage,
)
from forerun.server.stream import Reasoning, TokenStream, deltas, targets_of
from forerun.server.translate import GenerationArgs
from forerun.tool_stream import CallPart


async def chat_events(
    tokenizer, streams: list[list[TokenStream]], task: asyncio.Task, args: GenerationArgs, answer: Answer
) -> AsyncIterator[str]:
    """Every choice's chunks as its generation writes them (greedy choices: the one generation's, each under
    every index of its prompt; an echoed prompt first), then `ending`'s."""
    choices = args.n * len(streams)
    if answer.chat:
        for index in range(choices):
            yield opening(answer, index)
    offsets, flat = [0] * choices, [stream for each in streams for stream in each]
    targets = targets_of([len(each) for each in streams], args.n)
    async for run, delta, entries in deltas(flat, task):
        for index in targets[run]:
            if isinstance(entries, CallPart):
                if (carried := call_chunk(answer, entries, index)) is not None:
                    yield carried
                continue
            if isinstance(entries, Reasoning):
                logprobs = logprobs_payload(tokenizer, entries.entries, answer.chat)
                yield chunk(answer, None, logprobs=logprobs, index=index, reasoning=entries.text)
                continue
            if isinstance(entries, Echo):
                logprobs = echo_payload(tokenizer, entries)
            else:
                logprobs = logprobs_payload(tokenizer, entries, answer.chat, offsets[index])
            yield chunk(answer, delta, logprobs=logprobs, index=index)
            offsets[index] += len(delta)
    for last in await ending(tokenizer, task, args, answer):
        yield last


async def ending(tokenizer, task: asyncio.Task, args: GenerationArgs, answer: Answer) -> list[str]:
    """Each choice's last chunk with its finish reason (an echoed prompt alone: its text first), the usage chunk
    where asked, then [DONE]; or the failure as an error event, then [DONE]: a stream is never cut."""
    try:
        decoder, done = await task
    except APIError as error:
        return [event(error_body(error.status, error.message, error.param, error.kind)), DONE]
    except Exception as error:  # noqa: BLE001 - a stream ends with an error event and [DONE], never cut
        failure = failed(error)
        return [event(error_body(failure.status, failure.message, kind=failure.kind)), DONE]
    results = [result for _, results in done for result in results]
    extra = usage(results, decoder.method, prompt_counts(done))
    chunks = []
    for index, result in enumerate(results):
        echo = done[index // args.n][0]
        if result is None and echo is not None:  # the echoed prompt alone: nothing was streamed
            chunks.append(chunk(answer, echo.text, logprobs=echo_payload(tokenizer, echo), index=index))
        reason = "length" if result is None else result.finish_reason
        chunks.append(chunk(answer, None, reason, {"forerun": extra["forerun"]}, index=index))
    if args.include_usage:  # as OpenAI: a last chunk with no choices carries the usage
        chunks.append(chunk(answer, None, None, {"usage": extra["usage"]}, choices=False))
    return [*chunks, DONE]
