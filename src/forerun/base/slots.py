"""The static base's cache: one preallocated buffer of keys and values per layer, `places` rows of `length` slots,
written where the base says.

A forward feeds R rows. Row r of it belongs to place `Slots.places[r]` and writes its n nodes at the slots
`Slots.current[r, :n]` of that place. The buffer is read back either as its first R places (`contiguous`: a
batch's step, where rows are places 0..R-1 and no copy is made) or as the fed places gathered (a joining row's
prompt, fed alone into its own place while the others wait; rows joining together are fed as a batch's step).

Example (two places of 8 slots; one row fed at place 1, its 2 nodes at slots 3 and 4):
    >>> slots = Slots(layers=1, places=2, length=8)
    >>> slots.point(places=torch.tensor([1]), current=torch.tensor([[3, 4]]), contiguous=False)
    >>> layer = SlotLayer(8, slots, 0)
    >>> keys, _ = layer.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4))
    >>> keys.shape, slots.kv[0, 0, 1, 0, :, 0].tolist()
    (torch.Size([1, 1, 8, 4]), [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import StaticLayer


class Slots:
    """Where the forward in flight writes (`places` [R], `current` [R, n] slot indices, shared by every layer); and,
    once the first layer is allocated, every layer's keys and values in one buffer (one gather commits them all)."""

    def __init__(self, layers: int, places: int, length: int) -> None:
        self.layers, self.places_held, self.length = layers, places, length
        self.places: torch.Tensor | None = None
        self.current: torch.Tensor | None = None
        self.contiguous = True
        self.kv: torch.Tensor | None = None
        """[layers, 2, places, heads, length, head_dim], where keys and values have one shape."""

    def point(self, places: torch.Tensor, current: torch.Tensor, contiguous: bool) -> None:
        """The next forward's rows: row r is place `places[r]`, its nodes go to slots `current[r]`."""
        self.places, self.current, self.contiguous = places, current, contiguous

    def allocate(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        if self.kv is None and keys.shape == values.shape:
            heads, dim = keys.shape[1], keys.shape[3]
            shape = (self.layers, 2, self.places_held, heads, self.length, dim)
            self.kv = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
        return self.kv


class SlotLayer(StaticLayer):
    """A `StaticLayer` that writes a forward's keys and values at the places and slots `slots` names, not after a
    running length: a tree's nodes go where the base put them, and a rejected branch is simply overwritten."""

    def __init__(self, max_cache_len: int, slots: Slots, index: int) -> None:
        super().__init__(max_cache_len)
        self.slots, self.index = slots, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.num_heads = key_states.shape[1]
        self.batch_size = self.slots.places_held
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        shared = self.slots.allocate(key_states, value_states)
        if shared is None:  # keys and values of different widths: a buffer each
            room = (self.slots.places_held, self.num_heads, self.slots.length)
            self.keys = key_states.new_zeros(*room, self.k_head_dim)
            self.values = value_states.new_zeros(*room, self.v_head_dim)
        else:
            self.keys, self.values = shared[self.index, 0], shared[self.index, 1]
        self.heads = torch.arange(self.num_heads, device=self.device)[None, :, None]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, n = key_states.shape[0], key_states.shape[-2]
        places = self.slots.places[:rows]
        where = (places[:, None, None], self.heads, self.slots.current[:rows, None, :n])  # [R, heads, n]
        self.keys.index_put_(where, key_states)
        self.values.index_put_(where, value_states)
        if self.slots.contiguous:
            return self.keys[:rows], self.values[:rows]
        return self.keys.index_select(0, places), self.values.index_select(0, places)


def gather_paths(slots: Slots, layers: Sequence[StaticLayer], kept: Sequence[tuple[int, int, list[int]]],
                 device: torch.device) -> None:  # fmt: skip
    """Each (place, prefix_len, kept nodes): the kept nodes' keys and values, written at slots prefix_len + node,
    gathered to slots prefix_len, prefix_len + 1, ... of their place; every place and layer in one gather where
    `slots.kv` holds them all (a path already in place moves nothing).

    Example (place 1 kept nodes 0 and 2 of a tree fed after 3 tokens: slot 5 moves to slot 4):
        >>> slots = Slots(layers=1, places=2, length=8)
        >>> slots.kv = torch.arange(16.0).view(1, 1, 2, 1, 8, 1).repeat(1, 2, 1, 1, 1, 1)
        >>> gather_paths(slots, [], [(1, 3, [0, 2])], torch.device("cpu"))
        >>> slots.kv[0, 0, 1, 0, :, 0].tolist()
        [8.0, 9.0, 10.0, 11.0, 13.0, 13.0, 14.0, 15.0]
    """
    moved = [(p, start, nodes) for p, start, nodes in kept if nodes != list(range(len(nodes)))]
    if not moved:
        return
    index = torch.tensor(
        [
            [p for p, _, nodes in moved for _ in nodes],
            [start + i for _, start, nodes in moved for i in nodes],
            [start + i for _, start, nodes in moved for i in range(len(nodes))],
        ]
    ).to(device, non_blocking=True)  # one copy, and the host goes on (the gathers queue behind it)
    places, source, target = index
    if slots.kv is not None:  # every layer's keys and values in one gather
        slots.kv[:, :, places, :, target] = slots.kv[:, :, places, :, source]
        return
    for layer in layers:
        layer.keys[places, :, target] = layer.keys[places, :, source]
        layer.values[places, :, target] = layer.values[places, :, source]


def copy_place(slots: Slots, layers: Sequence[StaticLayer], source: int, target: int, length: int) -> None:
    """Copy place `source`'s first `length` slots to place `target`, in every layer."""
    if slots.kv is not None:
        slots.kv[:, :, target, :, :length] = slots.kv[:, :, source, :, :length]
        return
    for layer in layers:
        layer.keys[target, :, :length] = layer.keys[source, :, :length]
        layer.values[target, :, :length] = layer.values[source, :, :length]
