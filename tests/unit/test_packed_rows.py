"""Laid-out layers computing a few rows as more (`forerun.base.packed_rows`): the table's rule, the product's rows,
the measurement kept on disk and read back, and the curve's key."""

from __future__ import annotations

import json

import pytest
import torch

from forerun.base import packed_rows
from forerun.base.packed import PackedLinear, bf16_kernels, lay_out_rows, pack_weights, row_table
from forerun.base.packed_rows import MOST_ROWS, fastest_rows, rows_for, valid
from forerun.latency import curve_settings

from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def test_the_table_takes_more_rows_only_where_they_measured_clearly_cheaper():
    even = {m: 0.010 for m in range(1, 9)}
    assert fastest_rows(even) == tuple(range(9))  # ties keep the rows asked for
    almost = even | {4: 0.0095}
    assert fastest_rows(almost) == tuple(range(9))  # 5% cheaper is within the margin
    cheap_four = even | {4: 0.008}
    assert fastest_rows(cheap_four) == (0, 4, 4, 4, 4, 5, 6, 7, 8)  # never fewer rows than asked
    rising = {m: 0.010 * m for m in range(1, 9)}
    assert fastest_rows(rising) == tuple(range(9))


def test_a_product_of_few_rows_is_the_first_rows_of_the_larger_product():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(48, 80, bias=True))
    dense = torch.nn.Linear(48, 80, bias=True)
    dense.load_state_dict(layer[0].state_dict())
    pack_weights(layer)
    packed = layer[0]
    packed.rows = (0, 4, 4, 5, 4, 5, 6, 7, 8)
    x = torch.randn(1, 2, 48)
    four = torch.cat([x[0], torch.zeros(2, 48)])
    assert torch.equal(packed(x)[0], packed.product(four)[:2])  # the kernel's numbers for 4 rows, first 2 kept
    assert packed(x).shape == (1, 2, 80)
    torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)
    many = torch.randn(3, 4, 48)  # 12 rows: beyond the table, as asked
    torch.testing.assert_close(packed(many), dense(many), rtol=1e-5, atol=1e-5)


def test_the_table_is_measured_once_kept_and_measured_again_when_damaged(tmp_path, monkeypatch):
    model = tiny_model("llama", "sdpa")
    pack_weights(model)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    table = rows_for(layers, tmp_path)
    assert valid(list(table)) and len(table) == MOST_ROWS + 1
    (path,) = (tmp_path / "packed-rows").glob("*.json")
    stored = json.loads(path.read_text())
    assert stored["rows"] == list(table) and set(stored["ms"]) == {str(m) for m in range(1, MOST_ROWS + 1)}

    def must_not_measure(layers):
        raise AssertionError("the kept table was not used")

    monkeypatch.setattr(packed_rows, "measure_table", must_not_measure)
    assert rows_for(layers, tmp_path) == table
    path.write_text(json.dumps({"rows": [0, 0, 9, 1, 2, 3, 4, 5, 6]}))  # fewer rows than asked, more than measured
    monkeypatch.setattr(packed_rows, "measure_table", lambda layers: ((0, 3, 2, 3, 4, 5, 6, 7, 8), {}, {}))
    assert rows_for(layers, tmp_path) == (0, 3, 2, 3, 4, 5, 6, 7, 8)
    assert rows_for(layers, None) == (0, 3, 2, 3, 4, 5, 6, 7, 8) and len(list(path.parent.iterdir())) == 1


def test_a_model_takes_its_table_and_its_curve_is_its_own(tmp_path, monkeypatch):
    model = tiny_model("llama", "sdpa")
    pack_weights(model)
    before = curve_settings(model)
    monkeypatch.setattr(packed_rows, "measure_table", lambda layers: ((0, 4, 4, 3, 4, 5, 6, 7, 8), {}, {}))
    assert lay_out_rows(model, tmp_path) == (0, 4, 4, 3, 4, 5, 6, 7, 8) == row_table(model)
    assert all(m.rows == row_table(model) for m in model.modules() if isinstance(m, PackedLinear))
    assert curve_settings(model)["rows"] == [0, 4, 4, 3, 4, 5, 6, 7, 8] and "rows" not in before
    plain = tiny_model("llama", "sdpa")
    assert lay_out_rows(plain, tmp_path) == () and row_table(plain) == ()  # nothing laid out: nothing measured
    if bf16_kernels():  # bf16 is laid out only where oneDNN has bf16 kernels (not on an AVX2 CPU)
        half = tiny_model("llama", "sdpa").to(torch.bfloat16)
        pack_weights(half)
        assert lay_out_rows(half, tmp_path) == () and row_table(half) == ()  # bf16: measured no gain end to end
