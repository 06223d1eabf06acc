"""The static base hands a trained head its features from the forward itself: a replayed CUDA graph runs no forward
hook, so the layers an EAGLE-3 head reads come out of the bucketed forward beside the logits. They are the hooks'
values at every position fed (a prompt read in chunks included), and a head drafts on the static base, single and
batched, with no hook hung on the target and its output still plain generate's."""

from __future__ import annotations

import functools

import pytest
import torch

import forerun
from forerun.base.dynamic import DynamicBase
from forerun.base.static import StaticBase, graph_features
from forerun.costmodel import LatencyCurve
from forerun.drafters.eagle3.drafter import Eagle3Drafter
from forerun.taps import LayerTaps
from forerun.tree import TokenTree

from eagle3_heads import random_head
from tiny_models import prompts, tiny_model

NEW_TOKENS = 32
CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.05, 1.1, 1.2, 1.3))
"""A GPU's shape: wide trees are nearly free, so the head's trees are fed."""
FIRST = (0, 0, 0)
"""What a head over a 2-layer test model can read off a static base: layers below the last."""


@functools.lru_cache(maxsize=4)
def model_of(family: str, impl: str = "sdpa") -> torch.nn.Module:
    return tiny_model(family, impl)


@functools.lru_cache(maxsize=16)
def reference(family: str, index: int) -> torch.Tensor:
    return model_of(family).generate(prompts(3)[index], max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)  # fmt: skip


def hooked(model: torch.nn.Module, layers: tuple[int, ...], tree: TokenTree, prompt: list[int]) -> torch.Tensor:
    """What hooks on `layers` read off the growing cache's one-forward prefill of `prompt` then `tree`."""
    base = DynamicBase(model)
    assert base.begin(64) is None
    with LayerTaps(model, layers) as taps:
        base.forward(tree, len(prompt) - 1, prompt[:-1])
    return taps.take()


@torch.inference_mode()
@pytest.mark.parametrize(("family", "compiled"), [("llama", False), ("qwen3", False), ("gemma", False),
                                                  ("llama", True)])  # fmt: skip
def test_the_static_base_returns_the_hooks_features_at_every_position(family, compiled):
    """A 13-token prompt through buckets of 4 (three chunks, then the rest with a 2-node tree): features [1, 12 +
    2, F] equal to the hooks' on the growing cache; the same comparison against another layer fails (the control)."""
    model = model_of(family)
    prompt = list(range(3, 16))
    tree = TokenTree.rooted_at(prompt[-1])
    tree.add(0, 20)
    base = StaticBase(model, buckets=(1, 2, 4), compiled=compiled, features=(0, 0))
    assert base.begin(32) is None
    got = base.forward(tree, len(prompt) - 1, prompt[:-1]).features
    want = hooked(model, (0, 0), tree, prompt)
    assert got is not None and got.shape == want.shape == (1, 12 + 2, 2 * model.config.hidden_size)
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, hooked(model, (1, 0), tree, prompt), atol=1e-3)  # control: another layer's


@torch.inference_mode()
def test_a_base_reads_no_last_layer_and_none_unasked():
    """transformers hands the last layer's output back normed: a static base refuses it, and a head that reads it
    is left to the hooks (no features from the base)."""
    model = model_of("llama")
    last = model.config.num_hidden_layers - 1
    with pytest.raises(ValueError, match="features are read from layers 0"):
        StaticBase(model, features=(0, last))
    assert graph_features(model, (0, last)) == () and graph_features(model, FIRST) == FIRST
    base = StaticBase(model)
    assert base.begin(32) is None
    assert base.forward(TokenTree.rooted_at(5), 3, [1, 2, 3]).features is None


class Observed(Eagle3Drafter):
    """The head's drafter, counting the steps it was handed no features (it then forgets and drafts nothing)."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        super().__init__(drafter.config, drafter.head)
        self.steps = self.blind = 0

    def observe(self, ctx, outcome) -> None:
        self.steps, self.blind = self.steps + 1, self.blind + (outcome.features is None)
        super().observe(ctx, outcome)


def no_hooks(monkeypatch) -> None:
    """Any hook hung on the target fails the test: on a card a replayed graph would never run it."""

    def refused(self, index):
        raise AssertionError(f"a hook on layer {index}: a replayed graph would not run it")

    monkeypatch.setattr(LayerTaps, "keeper", refused)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_a_head_drafts_on_the_static_base_with_no_hook(family, monkeypatch):
    model = model_of(family)
    no_hooks(monkeypatch)
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model, aux=FIRST), latency=CURVE,
                              static_cache=True, adaptive=False)  # fmt: skip
    assert decoder.base is not None and decoder.base.features == FIRST
    decoder.drafters = [Observed(decoder.drafters[0])]
    drafted = 0
    for index, prompt in enumerate(prompts(3)):
        result = decoder.generate(prompt, NEW_TOKENS, eos_token_id=[])
        assert torch.equal(result.sequences, reference(family, index)), (family, index)
        drafted += result.stats.candidates
    assert drafted > 0 and decoder.drafters[0].steps > 0 and decoder.drafters[0].blind == 0


def test_a_batch_with_a_head_drafts_on_places_with_no_hook(monkeypatch):
    model = model_of("llama")
    no_hooks(monkeypatch)
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model, aux=FIRST), latency=CURVE,
                              static_cache=True)  # fmt: skip
    results = decoder.generate(prompts(3), NEW_TOKENS, eos_token_id=[])
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, reference("llama", index)), index
    assert 3 in decoder.base.siblings and decoder.base.siblings[3].features == FIRST
    assert sum(result.stats.candidates for result in results) > 0


def test_a_head_reading_the_last_layer_is_hooked_on_a_cpu_static_base():
    """Where the base cannot read a head's layers, the hooks do (a CPU runs no graph): the head still drafts."""
    model = model_of("llama")
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model), latency=CURVE,
                              static_cache=True, adaptive=False)  # fmt: skip
    assert decoder.base.features == ()
    result = decoder.generate(prompts(3)[0], NEW_TOKENS, eos_token_id=[])
    assert torch.equal(result.sequences, reference("llama", 0)) and result.stats.candidates > 0


def test_rows_whose_head_is_hooked_are_fed_one_by_one():
    """A batch whose head reads the last layer (hooked on a CPU): the rows' prompts go in one at a time (a hook
    would see every row's forward at once), each in its own place, and every row is generate's."""
    model = model_of("llama")
    decoder = forerun.Decoder(model, None, "eagle3", draft_head=random_head(model), latency=CURVE, static_cache=True)
    results = decoder.generate(prompts(3), NEW_TOKENS, eos_token_id=[])
    for index, result in enumerate(results):
        assert torch.equal(result.sequences, reference("llama", index)), index
    assert any(placed for _, _, placed in decoder.base.siblings[3].steps)  # the second and third, alone in place
    assert sum(result.stats.candidates for result in results) > 0
