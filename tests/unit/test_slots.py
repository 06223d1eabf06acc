"""The static base's cache moves keys and values alike, in one shared buffer (keys and values of one width) and in a
buffer per layer and kind (multi-head latent attention: keys wider than values), where a tiny random model's text
hardly notices a value left behind."""

from __future__ import annotations

import pytest
import torch

from forerun.base.slots import SlotLayer, Slots, copy_place, gather_paths

LENGTH = 8


def filled(value_width: int) -> tuple[Slots, list[SlotLayer]]:
    """Two layers, two places of `LENGTH` slots, every slot written with its own number (keys: +100 per layer,
    values: the negated key)."""
    slots = Slots(layers=2, places=2, length=LENGTH)
    layers = [SlotLayer(LENGTH, slots, index) for index in range(2)]
    slots.point(torch.tensor([0, 1]), torch.arange(LENGTH).repeat(2, 1), contiguous=True)
    for index, layer in enumerate(layers):
        numbers = torch.arange(2 * LENGTH, dtype=torch.float32).view(2, 1, LENGTH, 1) + 100 * index
        layer.update(numbers.expand(2, 1, LENGTH, 4), -numbers.expand(2, 1, LENGTH, value_width))
    assert (slots.kv is None) == (value_width != 4)
    return slots, layers


def numbers(layers: list[SlotLayer], place: int) -> list[tuple[list[float], list[float]]]:
    """Each layer's keys and values at `place`, one number a slot."""
    return [(layer.keys[place, 0, :, 0].tolist(), layer.values[place, 0, :, 0].tolist()) for layer in layers]


@pytest.mark.parametrize("value_width", [4, 2], ids=["shared", "per-layer"])
def test_a_kept_path_moves_keys_and_values_in_every_layer(value_width):
    slots, layers = filled(value_width)
    gather_paths(slots, layers, [(1, 3, [0, 2, 3])], torch.device("cpu"))  # place 1: slot 5 -> 4, 6 -> 5
    for index, (keys, values) in enumerate(numbers(layers, 1)):
        want = [8.0 + 100 * index + slot for slot in (0, 1, 2, 3, 5, 6, 6, 7)]
        assert keys == want
        assert values == [-k for k in want]
    assert numbers(layers, 0) == numbers(filled(value_width)[1], 0)  # the other place untouched


@pytest.mark.parametrize("value_width", [4, 2], ids=["shared", "per-layer"])
def test_a_place_copied_carries_its_keys_and_values(value_width):
    slots, layers = filled(value_width)
    copy_place(slots, layers, source=0, target=1, length=3)
    for index, (keys, values) in enumerate(numbers(layers, 1)):
        want = [100.0 * index + slot for slot in (0, 1, 2)] + [8.0 + 100 * index + slot for slot in range(3, 8)]
        assert keys == want
        assert values == [-k for k in want]
