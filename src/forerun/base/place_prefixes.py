"""The prefix cache on a static base's places: a prompt's head read before is copied into its place, not fed again.

A conversation's next turn begins with the whole previous turn, and chat prompts begin with the same system
prompt. On the growing cache (`forerun.base.dynamic`) a prefill starts from the stored keys and values of such a
head (`forerun.prefixcache`); on the static base the head would otherwise be read again, chunk by chunk through the
bucket graphs (a 2,000-token conversation: 32 replays of the 64-node bucket before its first token). Here the
stored keys and values are copied into the place's first slots (every layer's in one copy, on the device), the
rest of the prompt is fed after them, and what a place has read (its prompt at admission, prompt and answer when
it leaves) is stored for later prompts. The copies hold the values a full prefill computes (a token's keys and
values depend only on the tokens before it), so the text stays plain generate's (fp32, tested).

Example (the second turn of a conversation joins at place 2 of a batch's base; its first turn was read before, 171
tokens of prompt and answer, now in slots 0..170 of place 2):
    >>> seed_place(base, prefixes, tokens, place=2)                   # doctest: +SKIP
    171
    >>> store_place(base, prefixes, tokens, length=240, place=2)      # for the third turn  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from forerun.prefixcache import Entry, Prefixes

if TYPE_CHECKING:
    from forerun.base.static import StaticBase


@torch.inference_mode()  # the cache's tensors are inference tensors; a server's batch begins a row outside the mode
def seed_place(base: StaticBase, prefixes: Prefixes | None, tokens: list[int], place: int) -> int:
    """Copy the keys and values of the longest stored head of `tokens[:-1]` (the root is always fed) into
    `place`'s first slots; returns how many tokens they cover (0: nothing stored fits). The base is begun
    (`StaticBase.begin`): its cache holds the whole text."""
    if prefixes is None or base.cache is None:
        return 0
    entry, length = prefixes.find(tokens, base.layers)
    if entry is None or length > base.length:
        return 0
    kv = base.slots.kv
    if kv is not None and entry.block is not None and fits_block(kv, entry.block):
        kv[:, :, place, :, :length] = entry.block[:, :, :, :length]  # every layer's keys and values in one copy
        return length
    layers = base.cache.layers
    if not fits(layers, entry):
        return 0
    for layer, keys, values in zip(layers, entry.keys, entry.values, strict=True):
        if not layer.is_initialized:  # its first forward would allocate it from the same shapes
            layer.lazy_initialization(keys, values)
        layer.keys[place, :, :length] = keys[0, :, :length]
        layer.values[place, :, :length] = values[0, :, :length]
    return length


def store_place(base: StaticBase, prefixes: Prefixes | None, tokens: list[int], length: int, place: int) -> None:
    """Keep what `place` has read, the keys and values of `tokens[:length]`, for later prompts."""
    if prefixes is None or not prefixes.max_tokens or base.cache is None or not base.cache.layers[0].is_initialized:
        return  # (the slices below cost a card's host ~60 small operators: not made for a cache that is off)
    kv = base.slots.kv  # every layer's in one buffer, kept in one copy
    rows = kv[:, :, place : place + 1] if kv is not None else [
        (layer.keys[place : place + 1], layer.values[place : place + 1]) for layer in base.cache.layers
    ]  # fmt: skip
    prefixes.keep(tokens, rows, min(length, base.length))


def fits(layers: list, entry: Entry) -> bool:
    """Whether `entry`'s keys and values have the shape, dtype and device of the cache's layers (an entry of
    another model's, sharing its prefix cache by mistake, is not seeded), and one width: a cache of separate key
    and value widths cannot grow while it holds rows (`StaticBase.allocate`), and a seeded row would hold its
    place before its prompt is fed, when rows joining with it may still need a longer cache."""
    for layer, keys, values in zip(layers, entry.keys, entry.values, strict=True):
        if keys.shape != values.shape:
            return False
        if not layer.is_initialized:
            continue
        for held, stored in ((layer.keys, keys), (layer.values, values)):
            if held.shape[1] != stored.shape[1] or held.shape[-1] != stored.shape[-1]:
                return False
            if held.dtype != stored.dtype or held.device != stored.device:
                return False
    return True


def fits_block(kv: torch.Tensor, block: torch.Tensor) -> bool:
    """Whether an entry's `block` [layers, 2, kv_heads, length, head_dim] fits the static base's buffer `kv`
    [layers, 2, places, kv_heads, slots, head_dim] (layers, heads, width, dtype and device: `fits`)."""
    same = kv.shape[:2] == block.shape[:2] and kv.shape[3] == block.shape[2] and kv.shape[5] == block.shape[4]
    return same and kv.dtype == block.dtype and kv.device == block.device
