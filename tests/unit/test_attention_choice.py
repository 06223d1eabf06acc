"""Whether `load_model` attends a half-precision model on the CPU in fp32 or in its own dtype
(`forerun.attention_choice`): the answer follows the timings, ties included, and is kept per settings; `load_model`
follows it only where it chose the attention ("auto"); a model switched after loading computes what a model loaded
so computes, and its cache keeps the model's dtype."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoConfig, PreTrainedTokenizerFast

import forerun
from forerun import attention_choice, models
from forerun.attention import SDPA_FP32, SDPA_GROUPED, register
from forerun.attention_choice import attention_shapes, choice_file, half_attention_pays, time_attention
from forerun.kvcache import roomy_cache

from tiny_models import (
    COMMON,
    FAMILIES,
    MORE_FAMILIES,
    STATE_SPACE_FAMILIES,
    STATEFUL_FAMILIES,
    VOCAB,
    tiny_model,
)

IDS = torch.tensor([[3, 17, 42, 9, 88, 5, 61, 2]])


def test_the_shapes_are_the_models_heads():
    config = tiny_model("llama", num_hidden_layers=3).config
    shapes = attention_shapes(config)
    assert shapes["layers"] == 3 and shapes["heads"] == config.num_attention_heads
    assert shapes["kv_heads"] == config.num_key_value_heads and not shapes["latent"]
    assert shapes["head_dim"] == config.hidden_size // config.num_attention_heads
    assert attention_shapes(tiny_model("deepseek_v3").config)["latent"]


def test_every_familys_config_gives_shapes_or_none():
    for family, own in (FAMILIES | MORE_FAMILIES | STATEFUL_FAMILIES).items():
        shapes = attention_shapes(AutoConfig.for_model(family, **COMMON, **own))
        assert shapes is not None and shapes["heads"] % shapes["kv_heads"] == 0, family
    for family, own in STATE_SPACE_FAMILIES.items():  # no attention heads: nothing measured, nothing switched
        config = AutoConfig.for_model(family, **COMMON, **own)
        assert attention_shapes(config) is None and not half_attention_pays(config, torch.bfloat16, None), family


def test_both_ways_are_timed_on_every_size():
    seconds = time_attention(attention_shapes(tiny_model("llama").config), torch.bfloat16)
    assert set(seconds) == {"fp32", "own dtype"} and all(s > 0 for s in seconds.values())


@pytest.mark.parametrize(("fp32", "half", "pays"), [(2.0, 1.0, True), (1.0, 2.0, False), (1.0, 1.0, True)])
def test_the_answer_follows_the_timings_and_is_kept(monkeypatch, tmp_path, fp32, half, pays):
    calls = []

    def timed(shapes, dtype):
        calls.append(dtype)
        return {"fp32": fp32, "own dtype": half}

    monkeypatch.setattr(attention_choice, "time_attention", timed)
    config = tiny_model("llama").config
    assert half_attention_pays(config, torch.bfloat16, tmp_path) is pays
    assert half_attention_pays(config, torch.bfloat16, tmp_path) is pays and len(calls) == 1  # read back
    assert half_attention_pays(config, torch.float16, tmp_path) is pays and len(calls) == 2  # another dtype
    half_attention_pays(config, torch.bfloat16, None)
    assert len(calls) == 3 and len(list((tmp_path / "attention-choice").glob("*.json"))) == 2
    _, path = choice_file(config, torch.bfloat16, tmp_path)
    path.write_text('{"half": "yes"}')  # unreadable as an answer: measured again
    half_attention_pays(config, torch.bfloat16, tmp_path)
    assert len(calls) == 4


@torch.inference_mode()
def test_a_model_switched_after_loading_computes_as_one_loaded_so():
    register()
    switched = tiny_model("llama", SDPA_FP32).to(torch.bfloat16)
    switched.set_attn_implementation(SDPA_GROUPED)
    loaded = tiny_model("llama", SDPA_GROUPED).to(torch.bfloat16)
    kept_up = tiny_model("llama", SDPA_FP32).to(torch.bfloat16)
    models_ = (switched, loaded, kept_up)
    caches = [roomy_cache(model.config) for model in models_]
    logits = [model(IDS, cache=cache).logits for model, cache in zip(models_, caches, strict=True)]
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])  # the switch took
    assert {layer.keys.dtype for layer in caches[0].layers} == {torch.bfloat16}
    assert {layer.keys.dtype for layer in caches[2].layers} == {torch.float32}


def test_load_model_attends_by_the_answer(monkeypatch, tmp_path):
    tiny_model("llama", num_hidden_layers=2).save_pretrained(tmp_path / "tiny")
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w2").save_pretrained(tmp_path / "tiny")
    asked: list[bool] = []

    def answer(pays: bool):
        def half_attention_pays(config, dtype, cache_dir):
            asked.append(pays)
            return pays

        monkeypatch.setattr(models, "half_attention_pays", half_attention_pays)

    def attention(**options) -> str:
        return forerun.load_model(str(tmp_path / "tiny"), cache_dir=tmp_path, **options)[0].config._attn_implementation

    answer(False)
    assert attention(dtype="bf16") == SDPA_FP32
    answer(True)
    assert attention(dtype="bf16") == SDPA_GROUPED and asked == [False, True]
    assert attention(dtype="fp32") == SDPA_GROUPED and asked == [False, True]  # fp32 attends in fp32: not asked
    assert attention(dtype="bf16", attn_implementation=SDPA_FP32) == SDPA_FP32  # told: not asked
    assert attention(dtype="bf16", attn_implementation="sdpa") == "sdpa" and asked == [False, True]
