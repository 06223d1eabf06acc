"""A model whose linear layers are laid out for oneDNN (`load_model`'s default on CPUs with AVX-512) still does what
any PyTorch module does: deep copies, pickles, state dicts, `save_pretrained` and `from_pretrained`, casts and
moves. A laid-out tensor has no storage and casts to nothing, so each of these failed on it before (`Cannot access
storage of OpaqueTensorImpl`, `unsupported memory format option Preserve`, `empty_strided` on `MkldnnCPU`)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import AutoModelForCausalLM

from forerun.base.packed import PackedLinear, pack_weights

from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")

IDS = torch.tensor([[3, 17, 42, 9, 88, 5]])


def packed_llama() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the tiny llama with its layers laid out, the same model dense)."""
    dense, packed = tiny_model("llama", "sdpa"), tiny_model("llama", "sdpa")
    assert pack_weights(packed) > 0
    return packed, dense


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits


def laid_out(model: torch.nn.Module) -> list[bool]:
    return [m.weight.layout == torch._mkldnn for m in model.modules() if isinstance(m, PackedLinear)]


def test_a_deep_copy_and_a_pickle_are_laid_out_and_compute_the_same_numbers():
    packed, _ = packed_llama()
    before = logits(packed)
    twin = copy.deepcopy(packed)
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    unpickled = torch.load(buffer, weights_only=False)
    for model in (twin, unpickled, packed):
        assert all(laid_out(model))
        assert torch.equal(logits(model), before)
    twin.lm_head.weight = torch.nn.Parameter(torch.zeros_like(packed.lm_head.weight.to_dense()), False)
    assert torch.equal(logits(packed), before)  # the copy's matrices are its own


def test_a_state_dict_holds_dense_matrices_that_a_dense_model_loads(tmp_path):
    packed, dense = packed_llama()
    state = packed.state_dict()
    assert state.keys() == dense.state_dict().keys()
    for name, tensor in dense.state_dict().items():
        assert state[name].layout == torch.strided and torch.equal(state[name], tensor), name
    fresh = tiny_model("llama", "sdpa", seed=1)
    fresh.load_state_dict(state)
    assert torch.equal(logits(fresh), logits(dense))
    packed.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert torch.equal(logits(reloaded), logits(dense))


def test_a_laid_out_model_loads_a_state_dict_into_its_layout():
    packed, _ = packed_llama()
    other = tiny_model("llama", "sdpa", seed=1)
    expected = copy.deepcopy(other)
    pack_weights(expected)
    packed.load_state_dict(other.state_dict())
    assert all(laid_out(packed))
    assert torch.equal(logits(packed), logits(expected))
    with pytest.raises(RuntimeError, match="size mismatch"):
        packed.load_state_dict({**other.state_dict(), "lm_head.weight": torch.zeros(3, 3)})


def test_a_cast_leaves_the_matrices_dense_in_the_new_dtype_and_a_no_op_keeps_the_layout():
    packed, dense = packed_llama()
    same = packed.float().to("cpu")
    assert same is packed and all(laid_out(packed))
    packed.to(torch.bfloat16)
    assert not any(laid_out(packed))
    assert {p.dtype for p in packed.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(logits(packed), logits(dense.to(torch.bfloat16)), rtol=0, atol=0)


def test_a_matrix_tied_again_to_the_embedding_stays_tied_in_a_copy():
    """transformers' `tie_weights` may hand a laid-out output layer the embedding's dense matrix again: a copy keeps
    the two one parameter, as a copy of the dense model does."""
    packed, _ = packed_llama()
    packed.lm_head.weight = packed.model.embed_tokens.weight
    twin = copy.deepcopy(packed)
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    assert torch.equal(logits(twin), logits(packed))
