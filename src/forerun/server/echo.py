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
    piece where logprobs are asked (`top` alternatives each), their keys and values left in `keep` (the request's
    view of the prefix cache, where it generates too: its prefill then reads the prompt from there)."""
    ids = decoder.check_prompt(prompt, 0)
    text = prompt if isinstance(prompt, str) else decoder.tokenizer.decode(ids[0].tolist())
    entries = None
    if top is not None:
        entries = yield from scoring(decoder.model, ids, top, chunk, keep)
    return Echo(text, tuple(ids[0].tolist()), None if entries is None else tuple(entries))


def prompt_counts(done: list[tuple[Echo | None, list[GenerationResult | None]]]) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) over a request's prompts, each counted once."""
    tokens = cached = 0
    for echo, results in done:
        first = results[0]
        tokens += len(echo.ids) if first is None and echo is not None else (first.prompt_len if first else 0)
        cached += first.stats.cached_prompt_tokens if first is not None else 0
    return tokens, cached
