"""The KV cache a batch's rows share: one DynamicCache `[rows, kv_heads, slots, head_dim]` whose slots need not line
up, and which slots each row may attend to (`RowCache.visible` `[rows, slots]`). See `forerun.batch` for the
picture; holes are masked out for good and squeezed out once they would free half the slots (`compact`). A hybrid's
recurrent and convolution states are one row each, beside (`forerun.rowstates`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from forerun.kvcache import roomy_cache
from forerun.rowstates import append_states, has_states, keep_state_rows, row_cache, write_states

COMPACT_SHARE = 0.5
"""Squeeze the holes out of the cache once they are more than this share of its slots (attention reads them all)."""


class RowCache:
    """One DynamicCache for every row, and which of its slots each row may attend to."""

    def __init__(self, config) -> None:
        self.cache = roomy_cache(config)  # new slots written in place: no copy of every row's cache each step
        self.states = any(has_states(layer) for layer in self.cache.layers)
        """A hybrid's: layers with recurrent states, a row each (`forerun.rowstates`); rows together feed one token
        each a step, a lone row chains (`forerun.base.lone_chain`)."""
        self.visible = torch.zeros(0, 0, dtype=torch.bool)  # [rows, slots]
        self.vacant: list[int] = []
        """Cache rows whose row left (`vacate`): a joining row is written into one in place (`add`), and those still
        empty at the next step go (`settle`). Refilling a place costs one row's copy; dropping a row and appending
        another copied the whole cache twice (~14 ms each at 8 bf16 rows of ~300 slots here)."""

    @property
    def slots(self) -> int:
        return self.visible.shape[1]

    def add(self, row: DynamicCache, length: int) -> int:
        """Take in a row whose own cache holds `length` slots, every one visible: into a vacant place if there is one
        (`refill`), else appended, the shorter side left-padded. Returns the row's index among the held rows.
        """
        if self.vacant:
            return self.refill(row, length)
        rows, slots = self.visible.shape
        size = max(slots, length)
        for mine, theirs in zip(self.cache.layers, row.layers, strict=True):
            if has_states(mine):
                append_states(mine, theirs)
            ours, new = layer_tensors(mine), layer_tensors(theirs)
            if ours is None and new is None:
                continue
            # keys and values may differ in width (multi-head latent attention: DeepSeek-V3's 192 and 128)
            ours = ours or tuple(empty_like_rows(tensor, rows, slots) for tensor in new)
            new = new or tuple(empty_like_rows(tensor, 1, length) for tensor in ours)
            keys = torch.cat([left_pad(ours[0], size), left_pad(new[0], size)], dim=0)
            values = torch.cat([left_pad(ours[1], size), left_pad(new[1], size)], dim=0)
            set_layer(mine, keys, values)
        visible = torch.ones(1, length, dtype=torch.bool)
        self.visible = torch.cat([left_pad(self.visible, size, dim=1), left_pad(visible, size, dim=1)], dim=0)
        return rows

    def refill(self, row: DynamicCache, length: int) -> int:
        """Write a joining row into the first vacant place, right-aligned (the cache grows on the left first if
        the row is longer than its slots); the place's older slots stay, invisible."""
        place = self.vacant.pop(0)
        if length > self.slots:
            self.grow(length)
        slots = self.slots
        for mine, theirs in zip(self.cache.layers, row.layers, strict=True):
            if has_states(mine):
                write_states(mine, theirs, place)
            ours, new = layer_tensors(mine), layer_tensors(theirs)
            if ours is not None and new is not None:
                ours[0][place, :, slots - length :] = new[0][0]
                ours[1][place, :, slots - length :] = new[1][0]
        self.visible[place] = torch.arange(slots) >= slots - length
        return place  # the first vacant place: every place before it is held

    def grow(self, size: int) -> None:
        """Left-pad every row to `size` slots."""
        for layer in self.cache.layers:
            if layer_tensors(layer) is not None:
                set_layer(layer, left_pad(layer.keys, size), left_pad(layer.values, size))
        self.visible = left_pad(self.visible, size, dim=1)

    def places(self) -> list[int]:
        """The cache rows held by rows, in order: the batch's i-th row is cache row `places()[i]`."""
        vacant = set(self.vacant)
        return [place for place in range(self.visible.shape[0]) if place not in vacant]

    def vacate(self, places: Sequence[int]) -> None:
        """Rows at these cache places left: their slots are no one's until a joining row takes the place."""
        for place in places:
            self.visible[place] = False
        self.vacant = sorted({*self.vacant, *places})

    def settle(self) -> None:
        """Before a forward: places no row took go (`drop`), so every cache row is a batch row again."""
        if self.vacant:
            self.drop(self.places())

    def keep(self, kept: Sequence[Sequence[int]], nodes: int, windows_cut: bool = False) -> None:
        """After a forward of `nodes` padded tree nodes per row: keep each row's path `kept[row]` (node indices,
        root first), gathered to the front of the new slots; the cache grows by the longest path. A hybrid's rows
        only once their states are cut back to their paths (`windows_cut`: `rowstates.cut_states`)."""
        slots, longest = self.slots, max(len(path) for path in kept)
        if nodes == 1:  # the roots alone: they already sit where they belong
            self.keep_all(1)
            return
        if self.states and not windows_cut:
            raise ValueError(f"a hybrid's rows verify one token each a step (their states read all {nodes} fed)")
        index = torch.tensor([[slots + path[min(i, len(path) - 1)] for i in range(longest)] for path in kept])
        for layer in self.cache.layers:
            if layer_tensors(layer) is None:
                continue
            keys, values = layer.keys, layer.values  # [rows, heads, slots + nodes, dim]
            # Gather first (a copy), then write over the tree's slots and cut: no copy of the whole cache.
            keys[:, :, slots : slots + longest] = gather_slots(keys, index)
            values[:, :, slots : slots + longest] = gather_slots(values, index)
            layer.keys, layer.values = keys[:, :, : slots + longest], values[:, :, : slots + longest]
        filled = torch.arange(longest)[None] < torch.tensor([len(path) for path in kept])[:, None]
        self.visible = torch.cat([self.visible, filled], dim=1)

    def keep_all(self, fed: int) -> None:
        """Every row keeps all `fed` slots the last forward wrote (roots alone; a lone hybrid row's chain)."""
        self.visible = torch.cat([self.visible, torch.ones(self.visible.shape[0], fed, dtype=torch.bool)], dim=1)

    def drop(self, rows: Sequence[int]) -> None:
        """Keep only `rows` (indices, in order); slots no remaining row sees go, holes are compacted if many."""
        index = torch.tensor(list(rows), dtype=torch.long)
        self.vacant = []
        self.visible = self.visible.index_select(0, index)
        for layer in self.cache.layers:
            if has_states(layer):
                keep_state_rows(layer, index)
            if layer_tensors(layer) is not None:
                set_layer(
                    layer,
                    layer.keys.index_select(0, index.to(layer.keys.device)),
                    layer.values.index_select(0, index.to(layer.keys.device)),
                )
        if len(rows) and self.slots:
            self.compact(force=not bool(self.visible[:, 0].any()))

    def row(self, row: int) -> DynamicCache:
        """Row `row`'s visible slots alone, in order, as a one-row cache ([1, heads, visible, dim] per layer)."""
        where = self.visible[row].nonzero().flatten()
        if self.states:  # a hybrid's: its states too, its layers' kinds
            return row_cache(self.cache, row, where)
        single = DynamicCache()
        for index, layer in enumerate(self.cache.layers):
            if layer_tensors(layer) is None:
                return DynamicCache()  # a layer without entries: nothing to keep
            at = where.to(layer.keys.device)
            single.update(layer.keys[row : row + 1, :, at], layer.values[row : row + 1, :, at], index)
        return single

    def compact(self, force: bool = False) -> None:
        """Right-align each row's visible slots (order kept) when that frees more than COMPACT_SHARE of the slots.

        What compacting frees is the slots beyond the longest row's count, not every hole: where one row is much
        longer than the others (a long prompt joined), their padding cannot go, and squeezing would copy the whole
        cache every step for nothing (measured: 4 rows beside a 2150-token prompt, 0.3 s a step)."""
        rows, slots = self.visible.shape
        counts = self.visible.sum(dim=1)
        size = int(counts.max()) if rows else 0
        if not slots or (not force and slots - size <= COMPACT_SHARE * slots):
            return
        index = torch.zeros(rows, size, dtype=torch.long)
        for row in range(rows):
            where = self.visible[row].nonzero().flatten()
            index[row, size - len(where) :] = where
        visible = torch.arange(size)[None] >= (size - counts)[:, None]
        for layer in self.cache.layers:
            if layer_tensors(layer) is None:
                continue
            set_layer(layer, gather_slots(layer.keys, index), gather_slots(layer.values, index))
        self.visible = visible


def gather_slots(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor [rows, heads, slots, dim] at slots index [rows, n] of each row: [rows, heads, n, dim]. Keys and values
    are gathered each by its own width (multi-head latent attention: DeepSeek-V3's keys are wider than values)."""
    rows, heads, _, dim = tensor.shape
    where = index.to(tensor.device)[:, None, :, None].expand(rows, heads, index.shape[1], dim)
    return tensor.gather(2, where)


def layer_tensors(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A layer's keys and values [rows, heads, slots, dim]; None where it holds none (yet: or a layer of states)."""
    keys = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", False) or keys is None or keys.dim() != 4:
        return None
    return layer.keys, layer.values


def set_layer(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    if not layer.is_initialized:
        layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values


def empty_like_rows(tensor: torch.Tensor, rows: int, slots: int) -> torch.Tensor:
    """Zeros shaped as `tensor` [rows', heads, slots', dim] but with `rows` rows and `slots` slots."""
    return tensor.new_zeros(rows, tensor.shape[1], slots, tensor.shape[3])


def left_pad(tensor: torch.Tensor, size: int, dim: int = 2) -> torch.Tensor:
    """Zeros (False) in front along `dim` up to `size`."""
    missing = size - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
