"""Whether `load_model` lays a model's weights out (`forerun.base.pack_choice`): the probe takes the layers
`pack_weights` would, whole modules in the model's order within its budget; measuring leaves the model as it was
(its own layers, parameters and tied output matrix); the answer follows the timings, ties included, and is kept
per settings; `load_model` follows it where it may lay out, and never asks when told."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

import forerun
from forerun import models
from forerun.base import pack_choice
from forerun.base.pack_choice import pack_pays, probe_layers, time_layouts
from forerun.base.packed import packable, packed

from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")

LLAMA_LAYERS = [f"model.layers.{i}.{part}" for i in range(2) for part in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]  # the root's own last  # fmt: skip


def llama(**config: object) -> torch.nn.Module:
    return tiny_model("llama", num_hidden_layers=2, **config)


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if n.endswith("weight"))


def test_the_probe_takes_whole_modules_in_order_within_its_budget():
    model = llama()
    assert [name for name, _ in probe_layers(model)] == LLAMA_LAYERS
    attention = weight_bytes(model.model.layers[0].self_attn)
    first = [name for name, _ in probe_layers(model, budget=attention + 1)]
    assert first == LLAMA_LAYERS[:4]  # q, k, v, o: the attention module whole, the MLP's siblings not split
    assert [name for name, _ in probe_layers(model, budget=1)] == first  # at least one module
    body = sum(weight_bytes(model.get_submodule(name)) for name in LLAMA_LAYERS[:-1])
    assert [name for name, _ in probe_layers(model, budget=body)] == LLAMA_LAYERS[:-1]  # no room for the output
    assert probe_layers(model.to(torch.float16)) == []  # nothing `pack_weights` lays out


def test_the_probe_leaves_out_layers_the_model_reads_by_hand():
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(hidden_size=16, num_hidden_layers=1, state_size=4, vocab_size=32))
    names = [name for name, _ in probe_layers(mamba)]
    assert "backbone.layers.0.mixer.in_proj" in names and not [n for n in names if n.endswith("dt_proj")]


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q, k and v with biases, stacked in the probe
def test_measuring_leaves_the_model_as_it_was(family):
    model = tiny_model(family, num_hidden_layers=2, tie_word_embeddings=True)
    parameters = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    ids = torch.tensor([[3, 17, 42, 9]])
    with torch.inference_mode():
        before = model(ids).logits
        seconds = time_layouts(probe_layers(model), cache_dir=None)
        after = model(ids).logits
    assert set(seconds) == {"dense", "laid out"} and all(s > 0 for s in seconds.values())
    assert not packed(model) and {type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)} == {
        torch.nn.Linear
    }
    for name, p in model.named_parameters():
        assert p is parameters[name][0] and torch.equal(p, parameters[name][1]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert torch.equal(before, after)


def timings(monkeypatch: pytest.MonkeyPatch, dense: float, laid_out: float) -> list[int]:
    """`time_layouts` answering these seconds; the list counts its calls."""
    calls: list[int] = []

    def timed(probe, cache_dir):
        calls.append(len(probe))
        return {"dense": dense, "laid out": laid_out}

    monkeypatch.setattr(pack_choice, "time_layouts", timed)
    return calls


@pytest.mark.parametrize(("laid_out", "pays"), [(0.9, True), (1.0, True), (1.1, False)])
def test_the_answer_follows_the_timings_and_is_kept(monkeypatch, tmp_path, laid_out, pays):
    model = llama()
    calls = timings(monkeypatch, 1.0, laid_out)
    assert pack_pays(model, tmp_path) is pays and calls == [len(LLAMA_LAYERS)]
    (path,) = (tmp_path / "packed-choice").glob("float32-t*.json")
    stored = json.loads(path.read_text())
    assert stored["pack"] is pays and stored["ms"] == {"dense": 1000.0, "laid out": laid_out * 1000}
    assert stored["settings"]["layers"][-1] == [model.config.vocab_size, model.config.hidden_size, False]
    timings(monkeypatch, 1.0, 2.0 if pays else 0.5)  # another answer, were it measured again
    assert pack_pays(model, tmp_path) is pays  # read, not measured


def test_an_answer_is_per_settings_and_a_damaged_one_is_measured_again(monkeypatch, tmp_path):
    calls = timings(monkeypatch, 1.0, 0.5)
    pack_pays(llama(), tmp_path)
    pack_pays(llama(intermediate_size=48), tmp_path)  # other shapes: measured
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        pack_pays(llama(), tmp_path)  # another thread count: measured
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3 and len(list((tmp_path / "packed-choice").glob("*.json"))) == 3
    for path in (tmp_path / "packed-choice").glob("*.json"):
        path.write_text('{"pack": "yes"}')
    pack_pays(llama(), tmp_path)
    assert len(calls) == 4
    pack_pays(llama(), None)
    pack_pays(llama(), None)  # no cache: measured each time, nothing written
    assert len(calls) == 6 and len(list((tmp_path / "packed-choice").glob("*.json"))) == 3


def test_load_model_lays_out_by_the_answer(monkeypatch, tmp_path):
    llama().save_pretrained(tmp_path / "tiny")
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w2").save_pretrained(tmp_path / "tiny")
    asked: list[bool] = []

    def answer(pays: bool):
        def pack_pays(model, cache_dir):
            asked.append(pays)
            return pays

        monkeypatch.setattr(models, "pack_pays", pack_pays)

    folder = str(tmp_path / "tiny")
    answer(False)
    assert not packed(forerun.load_model(folder, cache_dir=tmp_path)[0])
    answer(True)
    assert packed(forerun.load_model(folder, cache_dir=tmp_path)[0]) == packable("cpu", torch.float32)
    assert asked == [False, True] if packable("cpu", torch.float32) else asked == []
    asked.clear()
    assert not packed(forerun.load_model(folder, pack=False, cache_dir=tmp_path)[0])
    assert packed(forerun.load_model(folder, pack=True, cache_dir=tmp_path)[0]) and asked == []  # told: not asked


def test_a_whole_models_probe_measures_the_row_table_the_model_then_reads(tmp_path):
    from forerun.base.packed import lay_out_rows, pack_weights

    model = llama()
    pack_pays(model, tmp_path)  # measured: its probe's laid-out layers get a row table
    assert len(list((tmp_path / "packed-rows").glob("float32-*.json"))) == 1
    pack_weights(model)
    lay_out_rows(model, tmp_path)  # the same products in the same order: read, not measured again
    assert len(list((tmp_path / "packed-rows").glob("float32-*.json"))) == 1
