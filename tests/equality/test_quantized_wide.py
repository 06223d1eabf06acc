"""Quantized layers given many rows at once unpack their weights to bf16 (`forerun.base.unpacked`): a long prompt
(4- and 8-bit weights) and a single row's large trees (8-bit) read that way, and forerun's first differences from
plain generate of the same model stay ties."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from test_low_precision import CURVE, against_generate
from test_quantized import int4_model

import forerun
from forerun.base.kernels import KernelLinear, kernel_of
from forerun.base.unpacked import INT8_WIDE_ROWS, WIDE_ROWS, Wide
from forerun.costmodel import LatencyCurve

from tiny_models import prompts

pytest.importorskip("torchao")


@pytest.mark.parametrize("bits", ["int4", "int8"])
def test_long_prompts_read_through_unpacked_weights_differ_only_at_ties(bits):
    """A prompt of WIDE_ROWS tokens or more goes through the weights unpacked to bf16 (`forerun.base.unpacked`), in
    forerun's prefill and in plain generate's alike; the next turn's prompt starts with the first one's text (the
    prefix cache serves it, the rest is read anew). Every first difference is a tie."""
    model = int4_model("qwen2", bits)
    with wide_products(model) as rows:
        decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
        first = prompts(1, length=WIDE_ROWS + 40, seed=3)[0]
        result, divergence = against_generate(decoder, model, first, 24)
        assert divergence is None or divergence.is_tie, (bits, divergence)
        assert rows and max(rows) >= WIDE_ROWS  # the prefills went through the unpacked weights
        rows.clear()
        second = torch.cat([result.sequences, prompts(1, length=WIDE_ROWS, seed=4)[0]], dim=1)
        _, divergence = against_generate(decoder, model, second, 24)
        assert divergence is None or divergence.is_tie, (bits, divergence)
        assert rows


def test_trees_through_unpacked_8_bit_weights_differ_only_at_ties():
    """8-bit layers take a single row's trees of INT8_WIDE_ROWS nodes or more through their codes in bf16: on a flat
    curve `auto` feeds such trees step after step, and every first difference from plain generate is a tie."""
    model = int4_model("llama", "int8")
    flat = LatencyCurve((1, 64), (1.0, 1.01))
    with wide_products(model) as rows:
        decoder = forerun.Decoder(model, None, "auto", latency=flat, max_tree_nodes=64)
        trees = 0
        for prompt in prompts(3):
            rows.clear()
            _, divergence = against_generate(decoder, model, prompt, 40)
            assert divergence is None or divergence.is_tie, divergence
            trees += len(rows) - 1  # the first layer's wide products, less the prefill's
        assert trees >= 1 and min(rows) >= INT8_WIDE_ROWS


@contextlib.contextmanager
def wide_products(model: torch.nn.Module):
    """While inside, `model`'s quantized layers take many rows through unpacked weights whatever this CPU (where it
    does not multiply bf16 natively they do not by default: `unpacked.native_bf16`), and the rows of every such
    product of its first quantized layer are counted (the others are not)."""
    layers = [module for module in model.modules() if isinstance(module, KernelLinear)]
    rows: list[int] = []
    wides = [layer.wide for layer in layers]
    for layer in layers:
        layer.wide = kernel_of(layer.weight)[2]
    layers[0].wide = Wide(functools.partial(counted, layers[0].wide.product, rows), layers[0].wide.rows)
    try:
        yield rows
    finally:
        for layer, wide in zip(layers, wides, strict=True):
            layer.wide = wide


def counted(product, rows: list[int], x: torch.Tensor, *operands) -> torch.Tensor:
    rows.append(x.shape[0])
    return product(x, *operands)
