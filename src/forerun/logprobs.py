"""Log-probabilities of the committed tokens, from logits the verification forward computed anyway.

A committed token was chosen at its parent node (the root for the first token of a step, the last accepted node for
the bonus token); that node's logits row gives the token's log-probability under the raw model (before logits
processors, as vLLM reports by default), so no extra forward is needed. In fp32 they equal the log-softmax of plain
generate's logits at the same positions up to float rounding of a tree forward.

Example:
    >>> rows = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    >>> [round(t.logprob, 3) for t in token_logprobs(rows, [0, 2], top=1)]
    [-0.408, -0.013]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token, its log-probability and the model's `top` likeliest tokens at that position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int = 0) -> list[TokenLogprob]:
    """`rows` [n, vocab]: the raw logits each of the n `tokens` was chosen from."""
    logprobs = torch.log_softmax(rows[: len(tokens)].float(), dim=-1)  # [n, vocab]
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)].tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    out = []
    for i, (token, value) in enumerate(zip(tokens, chosen, strict=True)):
        alternatives = ()
        if best is not None:
            alternatives = tuple(zip(best.indices[i].tolist(), best.values[i].tolist(), strict=True))
        out.append(TokenLogprob(int(token), float(value), alternatives))
    return out


def entries_before(tokenizer, entries: Sequence[TokenLogprob], cut: int | None) -> list[TokenLogprob]:
    """The entries of the tokens whose text begins before character `cut` of their text (a stop string's offset;
    None: all), each token's text its own decoded piece.

    Example (pieces "one", ".", " two": a cut at 4 keeps the first two):
        >>> class Pieces:
        ...     def decode(self, ids): return ["one", ".", " two"][ids[0]]
        >>> [e.token for e in entries_before(Pieces(), [TokenLogprob(i, 0.0) for i in range(3)], 4)]
        [0, 1]
    """
    shown, kept = 0, []
    for entry in entries:
        if cut is not None and shown >= cut:
            break
        kept.append(entry)
        shown += len(tokenizer.decode([entry.token]))
    return kept
