"""A batch's rows on a `StaticBase` (a GPU's): a place per row, every row at its own prefix length in its own place
(no padding, no holes), a joining row's prompt fed into its place through the same buckets after the head the prefix
cache holds (`forerun.base.place_prefixes`), one graph per (rows, bucket) on a GPU and the step's argmaxes in one
copy. It answers `forerun.base.rows.SharedRows` as the CPU's `DynamicRows` does.

Example (what `forerun.batched` does for `generate([...])`):
    >>> rows = static_rows(decoder.base, places=4, max_len=600)                # doctest: +SKIP
    >>> place, cached = rows.open(job.prefixes, tokens, max_len=600)           # doctest: +SKIP
    >>> rows.admit(place, len(tokens) - 1, [0], job.prefixes, tokens)          # its row index  # doctest: +SKIP
    0
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forerun.base.chain import ChainBase
from forerun.base.dynamic import TreeLogits
from forerun.base.place_prefixes import seed_place, store_place
from forerun.base.rows import DynamicRows, Leaving, RowsLogits, SharedRows
from forerun.base.static import StaticBase
from forerun.prefixcache import Prefixes
from forerun.tree import TokenTree


class StaticRows:
    """Rows at places of a `StaticBase` (module docstring). Rows keep to the lowest places: where the ones left
    fit a smaller row bucket, the last are moved down (`settle`), so a shrinking batch feeds fewer rows."""

    side_by_side = True
    chains_together = False  # a hybrid's rows take the growing cache

    def __init__(self, base: StaticBase) -> None:
        self.base = base
        self.held: list[int] = []
        """Each row's place, in row order."""
        self.joining: set[int] = set()
        self.lengths: dict[int, int] = {}
        """Committed tokens per held place."""

    @property
    def slots(self) -> int:
        return self.base.length

    waiting = 0  # a static base's rows verify trees: nothing is fed again

    def open(self, prefixes: Prefixes | None, tokens: list[int], max_len: int) -> tuple[int, int]:
        reason = self.base.begin(max_len)
        if reason is not None:
            raise ValueError(f"this request cannot be verified on the static cache: {reason}")
        taken = {*self.held, *self.joining}
        free = [place for place in range(self.base.places) if place not in taken]
        if not free:
            raise ValueError(f"all {self.base.places} places of the static cache are taken")
        self.joining.add(free[0])
        return free[0], seed_place(self.base, prefixes, tokens, free[0])

    def feed(self, own: int, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        return self.base.forward(tree, prefix_len, lead, place=own)

    def feed_many(self, fed: Sequence[tuple[int, TokenTree, int, Sequence[int]]]) -> list[TreeLogits]:
        out = self.base.forward_places({own: (tree, prefix_len, lead) for own, tree, prefix_len, lead in fed})
        return [out[own] for own, *_ in fed]

    def admit(self, own: int, prefix_len: int, path: list[int], prefixes: Prefixes | None, tokens: list[int]) -> int:
        self.base.commit(prefix_len, path, place=own)
        store_place(self.base, prefixes, tokens, prefix_len + len(path), own)  # its prompt, for rows joining later
        self.joining.discard(own)
        self.held.append(own)
        self.lengths[own] = prefix_len + len(path)
        return len(self.held) - 1

    def abandon(self, own: int) -> None:
        self.joining.discard(own)

    def settle(self) -> None:
        """Move the rows at the highest places into the lowest free ones while that lowers the row bucket."""
        base = self.base
        while self.held and base.row_bucket(len(self.held)) < base.row_bucket(max(self.held) + 1):
            taken = {*self.held, *self.joining}
            low = min(place for place in range(base.places) if place not in taken)
            high = max(self.held)
            if low > high:
                return
            base.move(high, low, self.lengths[high])
            self.held[self.held.index(high)] = low
            self.lengths[low] = self.lengths.pop(high)

    @property
    def features(self) -> tuple[int, ...]:
        return self.base.features

    def forward(self, prefix_lens: Sequence[int], trees: Sequence[TokenTree], nodes: int) -> RowsLogits:
        fed = {place: (tree, prefix_len) for place, tree, prefix_len in zip(self.held, trees, prefix_lens, strict=True)}
        logits, choices, features = self.base.run(fed, placed=False)
        features = None if features is None else self.in_row_order(features)[:, :nodes]
        return RowsLogits(logits, tuple(self.held), choices[:, :nodes], features)

    def in_row_order(self, tapped: torch.Tensor | None) -> torch.Tensor | None:
        if tapped is None:
            return None
        held = torch.tensor(self.held).to(tapped.device, non_blocking=True)  # a blocking copy waits for the forward
        return tapped.index_select(0, held)  # a copy: no replay rewrites it

    def keep(self, prefix_lens: Sequence[int], kept: Sequence[list[int]], nodes: int) -> None:
        self.base.commit_rows(list(zip(self.held, prefix_lens, kept, strict=True)))
        for place, prefix_len, path in zip(self.held, prefix_lens, kept, strict=True):
            self.lengths[place] = prefix_len + len(path)

    def compact(self) -> None:
        pass  # each row's slots are its own: nothing to squeeze

    def remove(self, leaving: Sequence[Leaving]) -> None:
        for index, prefixes, tokens, length in leaving:  # what it read (prompt, answer) for its next turn
            store_place(self.base, prefixes, tokens, length, self.held[index])
        gone = {index for index, *_ in leaving}
        for index in gone:
            self.lengths.pop(self.held[index], None)
        self.held = [place for index, place in enumerate(self.held) if index not in gone]

    def without_rows(self) -> StaticRows:
        fresh = StaticRows(self.base)
        fresh.joining = set(self.joining)  # their prompts are in their places: no new row may take them
        return fresh


def static_rows(base: StaticBase | ChainBase | None, places: int, max_len: int) -> SharedRows | None:
    """Rows on `base`'s sibling of `places` places for texts of up to `max_len` tokens (it grows for longer ones),
    or None where there is no static base or it cannot serve them (then the batch takes the growing cache); a
    hybrid's chain base: the growing cache, its lone row cutting its chains' states back as the base does."""
    if isinstance(base, ChainBase):
        return DynamicRows(base.model, base.records)
    if not isinstance(base, StaticBase):
        return None
    sibling = base.sibling(places)
    return StaticRows(sibling) if sibling.begin(max_len) is None else None
