"""A GGUF file's Q4_0/Q4_1 codes kept as torchao CPU int4 weights (`forerun.base.gguf_codes`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize

import forerun
from forerun.base import gguf_codes
from forerun.base.gguf_codes import Codes, Place, Places, block_codes, int4_weight, keep_codes, mismatch
from forerun.base.weights import dense, quantize_weights, weights_kind
from forerun.models import resolve

pytest.importorskip("torchao")


def blocks(kind: str, rows: int = 4, columns: int = 64, seed: int = 0):
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, columns)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quantize(weights, qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(rows, columns).copy())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_codes_stand_for_the_files_weights(kind):
    raw, exact = blocks(kind)
    codes = block_codes(raw, kind, 4, 64)
    assert codes.codes.dtype == torch.int32 and 0 <= int(codes.codes.min()) and int(codes.codes.max()) <= 15
    unrounded = (codes.codes.float() - 8) * codes.scale.repeat_interleave(32, 1) + codes.zero.repeat_interleave(32, 1)
    torch.testing.assert_close(unrounded, exact, rtol=0, atol=1e-6)  # the file's own values (fp32 arithmetic)
    # as the kernel holds them: scale and zero rounded to bf16, so within a few bf16 steps of the block's largest
    assert float((codes.dequantized() - exact).abs().max()) <= 2**-7 * float(exact.abs().max())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_kept_matrix_multiplies_as_its_dequantized_weights(kind):
    raw, _ = blocks(kind, rows=64, columns=128)
    codes = block_codes(raw, kind, 64, 128)
    linear = torch.nn.Linear(128, 64, bias=False).to(torch.bfloat16)
    linear.weight = int4_weight(codes)
    assert not dense(linear.weight) and weights_kind(torch.nn.Sequential(linear)) == "int4"
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = x.float() @ codes.dequantized().T
    torch.testing.assert_close(linear(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_blocks_in_another_row_order_are_not_kept():
    # The negative control of the check that guards every kept matrix: llama's q/k rows are stored permuted in a
    # GGUF file; codes taken in the file's order must be refused against the weights transformers loaded.
    raw, exact = blocks("Q4_1", rows=8)
    codes = block_codes(raw, "Q4_1", 8, 64)
    assert mismatch(codes, exact.to(torch.bfloat16)) is None
    swapped = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])
    wrong = Codes(codes.codes[swapped], codes.scale[swapped], codes.zero[swapped])
    assert "differ from the loaded weight" in mismatch(wrong, exact.to(torch.bfloat16))


@pytest.mark.real_model
def test_the_embedded_q4_1_file_keeps_its_codes_in_every_layer():
    model, _ = forerun.load_model("smollm2-135m", dtype="bf16", pack=False)  # dense, as quantize= starts from
    location, gguf_file = resolve("smollm2-135m")
    kept = keep_codes(model, Path(location) / gguf_file)
    assert len(kept.kept) == 30 * 7  # q, k, v, o, gate, up, down in each of the 30 layers
    assert kept.left == (("lm_head", "not in the file (tied to another tensor)"),)
    assert dense(model.lm_head.weight)
    quantize_weights(model, "int4")  # the rest: the output matrix, quantized by torchao
    assert not dense(model.lm_head.weight) and weights_kind(model) == "int4"


def test_places_round_trip_and_read_their_bytes(tmp_path):
    path = tmp_path / "blob.gguf"
    path.write_bytes(bytes(range(256)))
    places = Places("llama", {"a.weight": Place("Q4_1", 10, 4), "b.weight": Place("F32", 200, 8)})
    again = Places.from_dict(json.loads(json.dumps(places.as_dict())))
    assert again == places
    assert again.raw(path, "a.weight").tolist() == [10, 11, 12, 13] and again.raw(path, "c.weight") is None


def same_int4(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pairs = [(x.weight, y.weight) for x, y in zip(a.modules(), b.modules(), strict=True) if hasattr(x, "weight")]
    return all(
        torch.equal(x.qdata, y.qdata) and torch.equal(x.scale_and_zero, y.scale_and_zero)
        if hasattr(x, "qdata")
        else torch.equal(x, y)
        for x, y in pairs
    )


@pytest.mark.real_model
def test_codes_found_through_a_kept_index_are_the_files(tmp_path, monkeypatch):
    dense_model, _ = forerun.load_model("smollm2-135m", dtype="bf16", pack=False)
    location, gguf_file = resolve("smollm2-135m")
    path, index = Path(location) / gguf_file, tmp_path / "index.json"
    first = copy.deepcopy(dense_model)
    kept = keep_codes(first, path, index)  # parses the file, keeps the index
    assert index.is_file() and len(kept.kept) == 210

    def no_parsing(_):
        raise AssertionError("the file's metadata was parsed again")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_codes, "read_places", no_parsing)
        again = copy.deepcopy(dense_model)
        assert keep_codes(again, path, index) == kept
    assert same_int4(first, again)
    index.write_text('{"architecture": "llama", "tensors": {"x": [')  # damaged: the file is read again
    third = copy.deepcopy(dense_model)
    assert keep_codes(third, path, index) == kept and same_int4(first, third)
    # and the index written whole again
    assert Places.from_dict(json.loads(index.read_text())) == gguf_codes.read_places(path)
