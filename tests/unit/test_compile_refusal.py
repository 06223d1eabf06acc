"""Compiled buckets refuse, at once and by name, a model whose weights are laid out for oneDNN (what `load_model`
does on CPUs with AVX-512): inductor would fail on the first compiled step, after the curve's minutes of compiling,
with an error about tensors without storage."""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.base.packed import pack_weights
from forerun.base.static import StaticBase

from tiny_models import tiny_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN's layouts need mkldnn")


@needs_onednn
def test_a_decoder_compiling_laid_out_weights_is_refused_before_anything_runs():
    model = tiny_model("llama", "sdpa")
    assert pack_weights(model) > 0
    with pytest.raises(ValueError, match=r"compile_buckets .* laid out for oneDNN .*pack=False"):
        forerun.Decoder(model, None, "plain", static_cache=True, compile_buckets=True)


@needs_onednn
def test_the_same_weights_dense_or_uncompiled_are_taken():
    """The negative controls: dense weights make a compiled base (nothing compiles until a step runs), and laid-out
    weights an eager one."""
    assert StaticBase(tiny_model("llama", "sdpa"), compiled=True).compiled
    packed = tiny_model("llama", "sdpa")
    pack_weights(packed)
    assert not StaticBase(packed).compiled
