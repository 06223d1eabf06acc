"""What an EAGLE-3 head is trained on: the target's reading of a text, taken once and kept.

The target reads each training text once (no gradient): its three auxiliary layers' outputs at every position
(kept in bf16: 3 * hidden values a token) and its `top` most probable next tokens there with their probabilities
(the label: what the target would write). Training then goes over these readings as many times as its time allows,
never running the target again; a target forward costs more than a training step of the head.

Readings are packed for training: whole texts, one after another, up to `size` tokens a pack, each with its own
positions (from 0, as a prompt starts) and a segment number, so that attention and labels never cross from one text
into the next.

Example:
    >>> readings = list(read_texts(model, tokenizer, ["def f(x):", "The sky is blue."], (1, 14, 26)))  # doctest: +SKIP
    >>> readings[0].features.shape, readings[0].top_ids.shape                               # doctest: +SKIP
    (torch.Size([4, 1728]), torch.Size([4, 4]))
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from forerun.taps import LayerTaps


@dataclass(frozen=True)
class Reading:
    """One text as the target read it: `ids` [T], `features` [T, 3 * hidden] (bf16), and the target's most probable
    next tokens after each position `top_ids` [T, top] with their probabilities `top_probs` [T, top]."""

    ids: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]


@dataclass(frozen=True)
class Pack:
    """Readings side by side: the same fields concatenated, plus `positions` [T] (each text's own, from 0) and
    `segments` [T] (which text a position belongs to)."""

    ids: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    top_probs: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor


def token_pieces(tokenizer, texts: Iterable[str], longest: int) -> Iterator[list[int]]:
    """Each text's tokens (an end-of-text token after it), cut into pieces of at most `longest`; pieces shorter
    than 3 tokens are dropped (nothing to learn from)."""
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for text in texts:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + end
        for start in range(0, len(tokens), longest):
            if len(tokens[start : start + longest]) >= 3:
                yield tokens[start : start + longest]


@torch.no_grad()
def read_texts(model, tokenizer, texts: Iterable[str], layers: tuple[int, ...], top: int = 4, longest: int = 1024):
    """The target's `Reading` of each text piece (`token_pieces`), one forward each."""
    for tokens in token_pieces(tokenizer, texts, longest):
        ids = torch.tensor([tokens])
        with LayerTaps(model, layers) as taps:
            logits = model(ids).logits[0]
            features = taps.take()[0]
        best = torch.softmax(logits.float(), dim=-1).topk(top, dim=-1)
        yield Reading(ids[0], features.to(torch.bfloat16), best.indices, best.values.to(torch.float16))


def draft_vocabulary(readings: list[Reading], vocab: int, size: int) -> torch.Tensor:
    """The `size` tokens the target predicts most often on `readings` (its first choice at every position) or reads
    there, sorted; filled up with the lowest other ids when fewer occur.

    Example:
        >>> r = Reading(torch.tensor([5, 6]), torch.zeros(2, 3), torch.tensor([[6], [6]]), torch.ones(2, 1))
        >>> draft_vocabulary([r], 10, 3).tolist()
        [0, 5, 6]
    """
    counts: Counter[int] = Counter()
    for reading in readings:
        counts.update(reading.top_ids[:, 0].tolist())
        counts.update(reading.ids.tolist())
    chosen = [token for token, _ in counts.most_common(size)]
    taken = set(chosen)
    chosen += [t for t in range(vocab) if t not in taken][: size - len(chosen)]
    return torch.tensor(sorted(chosen))


def packs(readings: list[Reading], size: int) -> list[Pack]:
    """Readings packed in order, whole, into packs of at most `size` tokens (a longer reading is a pack alone)."""
    groups: list[list[Reading]] = [[]]
    filled = 0
    for reading in readings:
        if groups[-1] and filled + len(reading) > size:
            groups.append([])
            filled = 0
        groups[-1].append(reading)
        filled += len(reading)
    return [pack_of(group) for group in groups if group]


def pack_of(group: list[Reading]) -> Pack:
    """One `Pack` of `group`."""
    return Pack(
        ids=torch.cat([r.ids for r in group]),
        features=torch.cat([r.features for r in group]),
        top_ids=torch.cat([r.top_ids for r in group]),
        top_probs=torch.cat([r.top_probs for r in group]),
        positions=torch.cat([torch.arange(len(r)) for r in group]),
        segments=torch.cat([torch.full((len(r),), i) for i, r in enumerate(group)]),
    )
