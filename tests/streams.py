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
