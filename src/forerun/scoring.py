"""Log-probabilities of a prompt's own tokens: what OpenAI's `echo` with `logprobs` returns, and what evaluation
harnesses (lm-evaluation-harness's loglikelihood tasks) sum over a continuation.

Token i's entry is its log-probability under the raw model (before any logits processor, as generated tokens'
are: `forerun.logprobs`) given tokens 0..i-1; the first token has none (nothing precedes it). The prompt is fed in
chunks on a growing cache, each chunk's logits turned into entries before the next is fed, so a long prompt never
holds [L, vocab] logits at once and a server can step its running rows between chunks. In fp32 the entries equal
the log-softmax of one forward of the whole prompt up to float rounding (exactly, with one chunk).

Example (a prompt the model itself wrote after its first token is every step's likeliest token):
    >>> entries = score_prompt(model, ids, top=1)                              # doctest: +SKIP
    >>> entries[0], [e.token == e.top[0][0] for e in entries[1:]]               # doctest: +SKIP
    (None, [True, True, ...])
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

import torch
from transformers import DynamicCache

from forerun.forward_inputs import cache_argument
from forerun.kvcache import plain_layers
from forerun.logprobs import TokenLogprob, token_logprobs

DEFAULT_CHUNK = 512
"""Prompt tokens per forward: [512, vocab] fp32 logits are ~100 MB for a 49k vocabulary, ~300 MB for 152k."""

Entries = list[TokenLogprob | None]


class Keeper(Protocol):
    """A prefix cache (`forerun.prefixcache.PrefixCache` or a salt's `PrefixScope`)."""

    def store(self, tokens: list[int], cache: Any, length: int, scores: tuple | None = None) -> None: ...

    def find_scored(self, tokens: list[int], top: int) -> tuple[Any, int]: ...


def scoring(
    model: torch.nn.Module,
    ids: torch.Tensor,
    top: int = 0,
    chunk: int | None = DEFAULT_CHUNK,
    keep: Keeper | None = None,
) -> Generator[int, None, Entries]:
    """Score `ids` [1, L] a chunk at a time: yields first how many tokens were read from `keep` (0: none), then the
    tokens read so far after each forward; returns L entries (None, then TokenLogprob of token i with `top`
    alternatives). `chunk` None: the rest of the prompt in one forward.
    `keep`: a prefix cache (`forerun.prefixcache`). The head this prompt shares with one scored before is read
    from it (its keys and values, and its tokens' entries: four answers to one question score the question once),
    and the prompt's keys, values and entries are left in it at the end, so a generation that follows (a server's
    `echo` with `max_tokens` > 0) reads the prompt from there too. Reused entries are those computed for the
    earlier prompt: equal to this prompt's own up to float rounding, as a prefix cache's keys and values are.

    Example:
        >>> pieces = scoring(model, ids, chunk=256)                              # doctest: +SKIP
        >>> next(pieces)                      # tokens read from a prefix cache: none given  # doctest: +SKIP
        0
        >>> for read in pieces: ...           # a server steps its batch between two chunks  # doctest: +SKIP
    """
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"scoring takes one non-empty prompt [1, L], got shape {list(ids.shape)}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be a whole number of alternatives >= 0, got {top!r}")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens or None, got {chunk!r}")
    length = ids.shape[1]
    step = length if chunk is None else chunk
    device = next(model.parameters()).device
    tokens = ids[0].tolist()
    entries, cache, first = reused(model, keep, tokens, top)
    name = cache_argument(model) or "past_key_values"  # `cache` from transformers 5.24 on
    yield first
    for start in range(first, length, step):
        with torch.inference_mode():
            out = model(input_ids=ids[:, start : start + step].to(device), **{name: cache}, use_cache=True)
            cache = out["cache"] if "cache" in out else out.get("past_key_values")  # as the forward names it
            # logits at position p choose token p + 1: the chunk's last row chooses the next chunk's first token
            following = ids[0, start + 1 : start + step + 1].tolist()
            if following:
                entries += token_logprobs(out.logits[0], following, top)
        del out
        yield min(start + step, length)
    if keep is not None:
        keep.store(tokens, cache, length, scores=tuple(entries))
    return entries


def reused(model: torch.nn.Module, keep: Keeper | None, tokens: list[int], top: int) -> tuple[Entries, Any, int]:
    """(entries known, a cache holding the keys and values before the first token to feed, that token's position)
    from the longest scored head `keep` holds for `tokens`; ([None], None, 0) where it holds none. A head of h
    scored tokens gives their h entries and the keys and values of h - 1 of them: token h - 1 is fed again, its
    logits scoring token h."""
    entry, head = (None, 0) if keep is None else keep.find_scored(tokens, top)
    if entry is None:
        return [None], None, 0
    cache = DynamicCache(config=model.config)
    if not plain_layers(cache) or len(cache.layers) != len(entry.keys):
        return [None], None, 0
    entry.fill(cache, head - 1)
    known = [e if e is None else TokenLogprob(e.token, e.logprob, e.top[:top]) for e in entry.scores[:head]]
    return known, cache, head - 1


def score_prompt(
    model: torch.nn.Module,
    ids: torch.Tensor,
    top: int = 0,
    chunk: int | None = DEFAULT_CHUNK,
    keep: Keeper | None = None,
) -> Entries:
    """`scoring` run to its end: the L entries of `ids` [1, L]."""
    pieces = scoring(model, ids, top, chunk, keep)
    while True:
        try:
            next(pieces)
        except StopIteration as done:
            return done.value


def continuation_logprob(entries: Entries, context_len: int) -> tuple[float, bool]:
    """(sum of log-probabilities, whether each token was the likeliest) of the tokens after the first
    `context_len`: lm-evaluation-harness's loglikelihood of a continuation. Needs entries scored with top >= 1.

    Example:
        >>> e = [None, TokenLogprob(5, -0.5, ((5, -0.5),)), TokenLogprob(7, -2.0, ((3, -0.1),))]
        >>> continuation_logprob(e, 1)
        (-2.5, False)
    """
    if not 1 <= context_len < len(entries):
        raise ValueError(f"context_len must be between 1 and {len(entries) - 1}, got {context_len}")
    tail = [entry for entry in entries[context_len:] if entry is not None]
    if any(not entry.top for entry in tail):
        raise ValueError("the entries were scored without alternatives (top=0): score with top >= 1")
    greedy = all(entry.logprob >= entry.top[0][1] for entry in tail)
    return sum(entry.logprob for entry in tail), greedy
