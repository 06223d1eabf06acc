"""What a server stream (`forerun.server.stream.TokenStream`) queues for an answer put a token at a time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import torch


def queued(
    make: Callable[[asyncio.AbstractEventLoop], object], prompt: Sequence[int], answer: Sequence[int], pieces: int = 1
) -> list:
    """The items the stream `make(loop)` queues for `answer` (token ids) after `prompt`, put `pieces` tokens at a
    time."""
    loop = asyncio.new_event_loop()
    try:
        stream = make(loop)
        stream.put(torch.tensor([list(prompt)]))  # transformers' convention: the prompt first
        for start in range(0, len(answer), pieces):
            stream.put(torch.tensor(list(answer[start : start + pieces])))
        stream.end()
        loop.run_until_complete(asyncio.sleep(0))
        items = []
        while (item := stream.queue.get_nowait()) is not None:
            items.append(item)
        return items
    finally:
        loop.close()


def sent_calls(items: list) -> tuple:
    """The tool calls a stream's items sent (`forerun.tool_stream.CallPart`s joined: each call's name from its
    first part, its arguments from every part in order); each call named once and ended once, nothing after."""
    from forerun.tool_calls import ToolCall
    from forerun.tool_stream import CallPart

    calls: list[list] = []
    for _, extra in items:
        if not isinstance(extra, CallPart):
            continue
        if extra.name is not None:
            assert extra.index == len(calls) and all(done for *_, done in calls)
            calls.append([extra.name, "", False])
        assert extra.index == len(calls) - 1 and not calls[-1][2], "a part of a call that ended or never began"
        calls[-1][1] += extra.arguments
        calls[-1][2] = extra.done
    assert all(done for *_, done in calls)
    return tuple(ToolCall(name, arguments) for name, arguments, _ in calls)


def content_of(items: list) -> str:
    """The content a stream's items sent (neither a thought's text nor a call's part)."""
    from forerun.server.stream import Reasoning
    from forerun.tool_stream import CallPart

    return "".join(delta for delta, extra in items if not isinstance(extra, (Reasoning, CallPart)))
