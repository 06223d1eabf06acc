"""The growing cache of a single row writes each step's entries in place, and the text stays plain generate's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import forerun
from forerun.costmodel import LatencyCurve
from forerun.forward_inputs import cache_argument
from forerun.kvcache import ROOM, RoomyLayer

from tiny_models import prompts, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))
NEW = 2 * ROOM + 16  # past the first buffer's spare slots at least once


def watched(model: torch.nn.Module, run: Callable[[], object]) -> tuple[object, set[int], list[int]]:
    """`run()`'s result, with the buffers under `model`'s first cache layer's keys and their length after each of
    its forwards."""
    buffers, forwards = set(), []

    def seen(_module, _args, kwargs, _output):
        layer = kwargs[cache_argument(model)].layers[0]
        assert isinstance(layer, RoomyLayer)
        buffers.add(layer.keys.data_ptr())
        forwards.append(layer.keys.shape[-2])

    hook = model.register_forward_hook(seen, with_kwargs=True)
    try:
        return run(), buffers, forwards
    finally:
        hook.remove()


@pytest.mark.parametrize("method", ["plain", "prompt_lookup", "auto"])
@pytest.mark.parametrize(("family", "impl"), [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa")])
def test_a_long_answer_grows_its_cache_in_place_and_equals_generate(family, impl, method):
    model = tiny_model(family, impl)
    prompt = prompts(1, length=24, seed=3)[0]
    expected = model.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    decoder = forerun.Decoder(model, None, method, latency=CURVE)
    result, buffers, forwards = watched(model, lambda: decoder.generate(prompt, NEW, eos_token_id=[]))
    assert torch.equal(result.sequences, expected), (family, impl, method)
    # a concatenating layer would hold a new tensor after every forward; this one re-buffers a few times at most
    assert len(forwards) > 10 and len(buffers) <= 4, (len(forwards), len(buffers))


def test_a_draft_models_cache_grows_in_place_too():
    target, draft = tiny_model("llama", "sdpa"), tiny_model("llama", "sdpa", seed=1)
    prompt = prompts(1, length=24, seed=4)[0]
    expected = target.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    decoder = forerun.Decoder(target, None, "draft_model", draft_model=draft, confidence=0.0, gamma=3)
    result, buffers, forwards = watched(draft, lambda: decoder.generate(prompt, NEW, eos_token_id=[]))
    assert torch.equal(result.sequences, expected)
    assert len(forwards) > 20 and len(buffers) <= 4, (len(forwards), len(buffers))


def test_a_layer_whose_rows_were_cut_to_a_view_takes_new_entries_for_those_rows_only():
    """Whoever replaces a layer's keys and values by a view of its buffer (its first rows, its first slots) gets
    the next entries appended to exactly that view: the rows dropped stay dropped, the slots cut are written over."""
    layer = RoomyLayer()
    layer.update(torch.ones(3, 2, 5, 4), torch.ones(3, 2, 5, 4))
    layer.keys, layer.values = layer.keys[:1], layer.values[:1]  # the first row alone, same address and strides
    keys, values = layer.update(torch.full((1, 2, 1, 4), 7.0), torch.full((1, 2, 1, 4), 7.0))
    assert keys.shape == values.shape == (1, 2, 6, 4)
    assert keys[0, :, -1].eq(7).all() and keys[0, :, :5].eq(1).all()
    layer.keys, layer.values = keys[:, :, :3], values[:, :, :3]  # cut back to 3 slots: written in place after them
    keys, _ = layer.update(torch.full((1, 2, 1, 4), 9.0), torch.full((1, 2, 1, 4), 9.0))
    assert keys.shape == (1, 2, 4, 4) and keys[0, :, 3].eq(9).all() and keys.data_ptr() == layer.buffers[0].data_ptr()
