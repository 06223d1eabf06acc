"""Where a draft model's keys and values live, and how its forwards run: a growing cache, or slots on a card.

A draft model drafts token by token: one forward of one token per drafted token (a few more where it checks
guesses of its own), after catching up with what the target committed. On a CPU that is the growing cache's eager
forward (`GrowingDraftCache`). On a card an eager forward of a small model costs its kernels' launches and Python,
many times its arithmetic (an eager SmolLM2-135M step took ~30 ms on an H100 that reads its weights in well under
one), so a draft token would cost more than the target's captured step it was meant to save. There its forwards
go through a `StaticBase` of its own (`SlotDraftCache`): a preallocated cache, each forward padded to a bucket and
replayed as that bucket's captured graph, as the target's are.

Both hold the draft's entries for the tokens fed so far; the drafter says how many of them it still shares with
the text (`crop`), and feeds the rest after them (`feed`). Rolling back rejected guesses costs nothing on slots: the
next forward writes over them.

Example (the draft has read 5 tokens; it keeps 4 of them and feeds two more, reading both positions' logits):
    >>> store = GrowingDraftCache(draft, LogitsHead(draft))                # doctest: +SKIP
    >>> store.feed([1, 2, 3, 4, 5], start=0, keep=1).shape                # [1, vocab]  # doctest: +SKIP
    >>> store.crop(4); store.feed([9, 8], start=4, keep=2).shape           # [2, vocab]  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from forerun.attention import planless_attention
from forerun.base.static import StaticBase, static_support
from forerun.base.step_inputs import behind
from forerun.head import LogitsHead
from forerun.kvcache import roomy_cache
from forerun.tree import TokenTree

SLOTS_AHEAD = 256
"""Slots reserved beyond the text a request starts with: a slot cache grows (and its graphs are captured again)
only once a text outgrows them (`StaticBase` rounds up to 512 slots)."""


class DraftCache(Protocol):
    """The draft's keys and values for one request, and its forwards over them."""

    def reserve(self, length: int) -> bool:
        """Room for `length` tokens; False where making it dropped what was held (feed everything again)."""
        ...

    def feed(self, tokens: Sequence[int], start: int, keep: int) -> torch.Tensor:
        """Feed `tokens` after the first `start` held ones; the draft's logits [keep, vocab] at the last `keep`."""
        ...

    def crop(self, length: int) -> None:
        """Hold only the first `length` tokens' entries."""
        ...


class GrowingDraftCache:
    """A transformers cache that grows in place (`kvcache.roomy_cache`), eager forwards (the CPU's way); `head`
    computes the logits (`forerun.head`: the layout this CPU measured faster for a few positions)."""

    def __init__(self, draft: nn.Module, head: LogitsHead) -> None:
        self.draft, self.head = draft, head
        self.cache = roomy_cache(draft.config)

    def reserve(self, length: int) -> bool:
        return True

    def feed(self, tokens: Sequence[int], start: int, keep: int) -> torch.Tensor:
        device = next(self.draft.parameters()).device
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
        positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
        with planless_attention(device):  # a new cache length every step: no plan per shape on a card
            logits = self.head(keep, input_ids=ids, position_ids=positions, cache=self.cache, use_cache=True)
        return logits[0, -keep:]

    def crop(self, length: int) -> None:
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)  # negative: that many dropped from the end (transformers' own reading)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()


class SlotDraftCache:
    """A `StaticBase` of the draft's own: slots, forwards padded to buckets, each bucket a captured graph on a card.

    `feed` hands the base the tokens as a chain (a chain is a tree): the ones whose logits are not wanted as the
    lead (a catch-up's, in chunks of the largest bucket), the last `keep` as the tree. The base writes them at slots
    start, start + 1, ... and nothing moves after (a chain's path is already in place)."""

    def __init__(self, base: StaticBase) -> None:
        self.base = base

    def reserve(self, length: int) -> bool:
        """Raises ValueError where the draft cannot verify trees on slots for a text this long (a sliding window
        shorter than the text): the drafter goes on in a growing cache."""
        base = self.base
        if length <= base.supported and length + base.largest <= base.length:
            return True  # checked and held already: no check of the model again every step
        held = base.length
        reason = base.begin(length + SLOTS_AHEAD)  # allocates only when the slots held fall short
        if reason is not None:
            raise ValueError(f"the draft model cannot run on slots: {reason}")
        return base.length == held

    def feed(self, tokens: Sequence[int], start: int, keep: int) -> torch.Tensor:
        tokens = list(tokens)
        lead, chain = tokens[:-keep], tokens[-keep:]
        tree = behind(chain[:-1], TokenTree.rooted_at(chain[-1]))
        return self.base.forward(tree, start + len(lead), lead).logits

    def crop(self, length: int) -> None:
        pass  # the next forward writes over what follows; nothing reads past what it is told is held


class SlotPool:
    """Static bases for one draft model, one per request drafting at once (a batch's rows each take their own;
    the drafters forked for them share the pool). A base keeps its captured graphs between requests."""

    def __init__(self, draft: nn.Module) -> None:
        self.draft = draft
        self.free: list[StaticBase] = []
        self.lock = threading.Lock()

    def take(self) -> StaticBase:
        with self.lock:
            if self.free:
                return self.free.pop()
        return StaticBase(self.draft, places=1)

    def give(self, base: StaticBase) -> None:
        with self.lock:
            self.free.append(base)


def slot_pool(draft: nn.Module, slots: bool | None) -> SlotPool | None:
    """A pool of slot caches for `draft` where its forwards go on slots (`slots`; None: where it sits on a CUDA
    card) and its model can verify trees there (`static_support`); else None (the growing cache)."""
    wanted = next(draft.parameters()).device.type == "cuda" if slots is None else slots
    return SlotPool(draft) if wanted and static_support(draft) is None else None
