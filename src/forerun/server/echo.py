"""A completion's echoed prompt (`echo`): its pieces on the worker, and a request's prompt counts.

Example:
    >>> pieces = echoed(decoder, "One, two,", top=1, chunk=256)   # run by `BatchWorker.run_pieces`  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Generator

from forerun.decoder import Decoder, GenerationResult
from forerun.scoring import Keeper, scoring
from forerun.server.shaping import Echo


def echoed(
    decoder: Decoder, prompt, top: int | None, chunk: int | None, keep: Keeper | None = None
) -> Generator[int, None, Echo]:
    """An echo's pieces (`BatchWorker.run_pieces`): the prompt's ids checked, then its tokens scored a chunk a
    piece where logprobs are asked (`top` alternatives each): a head scored before read from `keep` (the request's
    view of the prefix cache), the prompt left there (a generation after it reads the prompt from there too)."""
    ids = decoder.check_prompt(prompt, 0)
    text = prompt if isinstance(prompt, str) else decoder.tokenizer.decode(ids[0].tolist())
    entries, cached = None, 0
    if top is not None:
        pieces = scoring(decoder.model, ids, top, chunk, keep)
        cached = next(pieces)
        yield cached
        entries = yield from pieces
    return Echo(text, tuple(ids[0].tolist()), None if entries is None else tuple(entries), cached)


def prompt_counts(done: list[tuple[Echo | None, list[GenerationResult | None]]]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) over a request's prompts, each counted once."""
    tokens = cached = 0
    for echo, results in done:
        first = results[0]
        if first is None:  # the echoed prompt alone: its scored head read from the prefix cache
            tokens += len(echo.ids) if echo is not None else 0
            cached += echo.cached if echo is not None else 0
        else:
            tokens, cached = tokens + first.prompt_len, cached + first.stats.cached_prompt_tokens
    return tokens, cached
