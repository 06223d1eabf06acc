"""`load_model` on folders of families transformers writes no sdpa attention for."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

import forerun
from forerun.attention import SDPA_GROUPED
from forerun.costmodel import LatencyCurve

from tiny_models import VOCAB, prompts, tiny_model

CURVE = LatencyCurve((1, 2, 4, 8, 16, 32, 64), (1.0, 1.0, 1.0, 1.2, 1.4, 1.9, 2.9))


@pytest.mark.parametrize("family", ["gptj", "gemma2"])
def test_a_family_without_sdpa_loads_with_eager_attention(tmp_path, family):
    """`load_model`'s "auto" attention asks transformers for sdpa, which Gemma 2 and gpt-oss do not have (nor GPT-J
    before transformers 5.24): loading their folders raised transformers' ValueError. They load with eager
    attention and decode exactly; a family that has sdpa loads with it."""
    tiny_model(family, "eager").save_pretrained(tmp_path)
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w2").save_pretrained(tmp_path)
    model, _ = forerun.load_model(str(tmp_path), cache_dir=None)
    has_sdpa = type(model)._supports_sdpa
    assert model.config._attn_implementation == (SDPA_GROUPED if has_sdpa else "eager")
    text = prompts(1)[0]
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=CURVE)
    want = model.generate(text, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(decoder.generate(text, 24, eos_token_id=[]).sequences, want)
    if not has_sdpa:
        with pytest.raises(ValueError, match="scaled_dot_product_attention"):
            forerun.load_model(str(tmp_path), attn_implementation="sdpa", cache_dir=None)
