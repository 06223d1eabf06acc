"""8-bit weights and activations (`forerun.base.row_int8`): integer products exact and row by row, activations
smoothed where measured, and the model around them judged as quantized."""

from __future__ import annotations

import copy

import pytest
import torch

from forerun.base.row_int8 import (
    LEVELS,
    TILE_ROWS,
    RowInt8Linear,
    activation_ranges,
    exact_sums,
    int8_tiles,
    packed_rows,
)
from forerun.base.weights import check_quantize, quantize_weights, vocabulary_rows, weights_kind
from forerun.exactness import W8A8_EPS, resolution
from forerun.latency import curve_settings

from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.skipif(not exact_sums(), reason="this CPU's integer product saturates (no AVX-512 VNNI)")


def linear(inputs: int, outputs: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inputs, outputs, bias=bias).requires_grad_(False)


def integer_reference(layer: RowInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the layer must give: each row's codes (smoothed) times the weight codes, summed exactly in float64,
    scaled by the row's and the weight row's scales, plus the bias."""
    x = x if layer.inverse is None else x * layer.inverse
    scale = x.abs().amax(-1, keepdim=True) / LEVELS
    weights = torch.ops.quantized.linear_unpack(layer.packed)[0]
    sums = (x / scale).round().double() @ weights.int_repr().double().T
    out = sums * weights.q_per_channel_scales()[None] * scale.double()
    return out if layer.bias is None else out + layer.bias.double()


def test_the_product_is_the_exact_integer_sum_scaled_bias_after():
    layer = RowInt8Linear(linear(96, 40, bias=True))
    x = torch.randn(6, 96) * 5
    assert torch.allclose(layer(x).double(), integer_reference(layer, x), rtol=1e-6, atol=1e-6)
    assert torch.equal(layer(torch.zeros(1, 96))[0], layer.bias)  # a zero row: the bias, unscaled


def test_extreme_codes_do_not_saturate():
    """Rows at +-127 against weights at -127: pair sums past 16 bits, which a saturating product would clip."""
    weight = torch.full((16, 64), -1.0)
    weight[::2] = 1.0
    layer = RowInt8Linear(torch.nn.Linear(64, 16, bias=False).requires_grad_(False))
    layer.packed = packed_rows(weight)
    x = torch.tensor([[127.0] * 64, [-127.0] * 64])
    assert torch.allclose(layer(x).double(), integer_reference(layer, x), rtol=1e-6)


@pytest.mark.parametrize("measured", [False, True])
def test_rows_together_equal_rows_alone(measured):
    """A tree's rows in one forward give what each gives alone: each row has its own scale, sums are integers."""
    ranges = torch.rand(128) * torch.tensor([30.0] * 4 + [1.0] * 124) + 0.1 if measured else None
    layer = RowInt8Linear(linear(128, 48, bias=True), ranges)
    x = torch.randn(9, 128)
    together = layer(x)
    assert torch.equal(together, torch.cat([layer(row[None]) for row in x]))
    assert torch.equal(layer(x.reshape(3, 3, 128)), together.reshape(3, 3, 48))  # [batch, nodes, in]


@pytest.mark.skipif(not int8_tiles(), reason="no AMX int8 tiles on this CPU")
@pytest.mark.parametrize("measured", [False, True])
def test_trees_through_amx_tiles_give_fbgemms_numbers_row_by_row(measured):
    """From TILE_ROWS rows on, products go through oneDNN's integer product (AMX): the same integer sums and scales
    as fbgemm's, so the same numbers, row by row; fewer rows stay with fbgemm. Rows at the extreme codes too."""
    ranges = torch.rand(1536) + 0.1 if measured else None
    tiled = RowInt8Linear(linear(1536, 80, bias=True), ranges, tiles=True)
    plain = RowInt8Linear(linear(1536, 80, bias=True), ranges, tiles=False)
    x = torch.randn(37, 1536) * 3
    x[0], x[1] = 1e3, -1e3  # every code +-127: integer sums past 2^24, rounded to fp32 alike
    assert torch.equal(tiled(x[: TILE_ROWS - 1]), plain(x[: TILE_ROWS - 1])) and tiled.tiled is None  # fbgemm
    for rows in (TILE_ROWS, 9, 16, 37):
        assert torch.equal(tiled(x[:rows]), plain(x[:rows])), rows
    assert tiled.tiled is not None and tiled.tiled[0] is tiled.packed
    assert torch.allclose(tiled(x).double(), integer_reference(tiled, x), rtol=1e-6, atol=1e-5)
    twin = copy.deepcopy(tiled)  # oneDNN's packing has no storage to copy: made again at first use
    assert twin.tiled is None and torch.equal(twin(x), tiled(x)) and twin.tiled is not None
    tiled.packed = packed_rows(torch.randn(80, 1536))  # weights replaced: packed for oneDNN again
    assert torch.allclose(tiled(x[:8]).double(), integer_reference(tiled, x[:8]), rtol=1e-6, atol=1e-5)


def test_measured_outliers_are_smoothed_nearer_the_dense_product():
    """An input channel 50x the rest crushes a row's one scale; measured, part of its range moves into the weights.
    Unmeasured (the control), the same layer sits far from the dense product."""
    dense = linear(256, 64)
    x = torch.randn(32, 256)
    x[:, 7] *= 50
    exact = dense(x)
    plain, measured = RowInt8Linear(dense), RowInt8Linear(dense, x.abs().amax(0))
    assert torch.allclose(measured(x).double(), integer_reference(measured, x), rtol=1e-5, atol=1e-5)
    far, near = [float((layer(x) - exact).norm() / exact.norm()) for layer in (plain, measured)]
    assert near < far / 3, (near, far)


def test_a_model_in_w8a8_reads_as_such_and_keeps_its_embedding():
    model = tiny_model("llama", "sdpa")
    embedding = model.get_input_embeddings().weight.clone()
    texts = [torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    ranges = activation_ranges(model, texts)
    assert "lm_head" in ranges and all(r.ndim == 1 for r in ranges.values())
    quantize_weights(model, "w8a8", texts)
    assert weights_kind(model) == "w8a8" and vocabulary_rows(model) == VOCAB
    assert resolution(model) == W8A8_EPS  # ties judged at an 8-bit activation's resolution
    assert curve_settings(model)["weights"] == "w8a8"  # a curve of its own
    assert curve_settings(model).get("tile_rows") == (TILE_ROWS if int8_tiles() else None)  # trees on AMX: another
    for layer in [m for m in model.modules() if isinstance(m, RowInt8Linear)]:
        layer.tiles = False
    assert "tile_rows" not in curve_settings(model)
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # looked up as it was
    assert not any(type(m) is torch.nn.Linear for m in model.modules())


def test_w8a8_refuses_what_it_cannot_run_naming_it():
    with pytest.raises(ValueError, match="fp32"):
        check_quantize("w8a8", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="calibration"):
        quantize_weights(tiny_model("llama", "sdpa"), "w8a8")
    with pytest.raises(ValueError, match="fp32"):
        quantize_weights(tiny_model("llama", "sdpa").to(torch.bfloat16), "w8a8", [torch.ones(1, 4, dtype=torch.long)])
    check_quantize("w8a8", "cpu", torch.float32)
