"""Sibling layers stacked (`forerun.base.stacked`): a layer's q, k, v (and gate, up) projections laid out as one
matrix compute the very numbers their own laid-out matrices do, in every family, fp32 and bf16, 1 to 130 rows;
the model holds each matrix once; it saves, loads, copies, pickles, casts and moves as a model laid out apart; a
sibling fed another input, or an input changed in place, is computed anew; nothing stays held after a forward."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from forerun.base.packed import PackedLinear, bf16_kernels, dense_matrix, lay_out_rows, pack_weights, products
from forerun.base.stacked import StackedLinear, packed_stack, stack_siblings, stacked, unstack_siblings

from tiny_models import (
    COMMON,
    FAMILIES,
    MORE_FAMILIES,
    NO_SDPA,
    STATE_SPACE_FAMILIES,
    STATEFUL_FAMILIES,
    tiny_model,
)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")

DTYPES = [torch.float32] + ([torch.bfloat16] if bf16_kernels() else [])
IDS = torch.tensor([[3, 17, 42, 9, 88, 5, 61, 2]])


def seeded(family: str) -> torch.nn.Module:
    """The family's tiny random model, fp32, eval mode (a state-space one too)."""
    if family in STATE_SPACE_FAMILIES:
        torch.manual_seed(0)
        config = AutoConfig.for_model(family, **COMMON, **STATE_SPACE_FAMILIES[family])
        return AutoModelForCausalLM.from_config(config).eval()
    return tiny_model(family, "eager" if family in NO_SDPA else "sdpa")


def laid_out_pair(family: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the tiny model laid out with its siblings stacked, the same model laid out apart)."""
    together, apart = seeded(family).to(dtype), seeded(family).to(dtype)
    pack_weights(together)
    pack_weights(apart, stack=False)
    return together, apart


@torch.inference_mode()
def prompt_then_step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prompt read whole, then of 3 tokens fed after its first 5 on a cache."""
    whole = model(IDS).logits
    cache = DynamicCache(config=model.config)
    model(IDS[:, :5], cache=cache, use_cache=True)
    return whole, model(IDS[:, 5:], cache=cache, use_cache=True).logits


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_family_computes_the_same_logits_stacked(dtype):
    """Mamba's and Jamba's mixers multiply their `dt_proj` matrix by hand: it stays dense (laid out, it failed)."""
    families = sorted(FAMILIES | MORE_FAMILIES | STATEFUL_FAMILIES | STATE_SPACE_FAMILIES)
    stacked_families = []
    for family in families:
        together, apart = laid_out_pair(family, dtype)
        if stacked(together):
            stacked_families.append(family)
        for got, expected in zip(prompt_then_step(together), prompt_then_step(apart), strict=True):
            assert torch.equal(got, expected), family
    # the llama-like families name their projections so (a list that shrank would test little)
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma", "olmo2", "granite", "qwen3_5_text"} <= set(stacked_families)
    assert len(stacked_families) >= 20, stacked_families


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_stack_gives_each_sibling_its_own_columns_for_any_rows(dtype):
    torch.manual_seed(0)
    layers = [PackedLinear(torch.nn.Linear(64, n, bias=True).to(dtype)) for n in (64, 32, 32)]
    for table in ((), (0, 4, 4, 5, 4, 5, 6, 7, 8)):  # as asked, and a few rows computed as more
        for layer in layers:
            layer.rows = table
        stack = packed_stack(layers)
        siblings = [StackedLinear(layer, stack, start) for layer, start in zip(layers, (0, 64, 96), strict=True)]
        for rows in (1, 2, 3, 5, 8, 16, 33, 130):
            x = torch.randn(rows, 64).to(dtype)
            for sibling, layer in zip(siblings, layers, strict=True):
                assert torch.equal(sibling(x), layer(x)), (rows, table)


def test_a_sibling_fed_another_input_or_a_changed_one_is_computed_anew():
    together, apart = laid_out_pair("llama")
    attention, expected = together.model.layers[0].self_attn, apart.model.layers[0].self_attn
    x, y = torch.randn(2, 64), torch.randn(2, 64)
    assert torch.equal(attention.q_proj(x), expected.q_proj(x))
    assert torch.equal(attention.k_proj(y), expected.k_proj(y))  # not x's columns
    x.mul_(2)  # the same tensor, other numbers
    assert torch.equal(attention.v_proj(x), expected.v_proj(x))
    assert torch.equal(attention.q_proj(x), expected.q_proj(x))


def test_nothing_stays_held_after_a_forward_and_each_matrix_is_held_once():
    together, apart = laid_out_pair("qwen2")  # biases on q, k and v
    prompt_then_step(together)
    stacks = {id(m.stack): m.stack for m in together.modules() if isinstance(m, StackedLinear)}
    assert len(stacks) == 2 * together.config.num_hidden_layers
    assert all(stack.last is None for stack in stacks.values())
    assert len(products(together)) == len(products(apart)) - 3 * together.config.num_hidden_layers

    def held(model: torch.nn.Module) -> int:  # parameters shared by siblings count once
        return sum(parameter.numel() for parameter in model.parameters())

    assert held(together) == held(apart)


def test_a_stacked_model_saves_copies_pickles_and_loads_as_one_laid_out_apart(tmp_path):
    together, apart = laid_out_pair("qwen2")  # biases on q, k and v
    state, own = together.state_dict(), apart.state_dict()
    assert state.keys() == own.keys()
    for name, tensor in own.items():
        assert torch.equal(state[name], tensor.to_dense() if tensor.layout == torch._mkldnn else tensor), name
    expected = prompt_then_step(apart)
    buffer = io.BytesIO()
    torch.save(together, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(together), torch.load(buffer, weights_only=False)):
        assert not stacked(twin) and all(m.weight.layout == torch._mkldnn for m in products(twin))
        assert all(torch.equal(a, b) for a, b in zip(prompt_then_step(twin), expected, strict=True))
    assert stacked(together)  # copying left the original as it was
    other = tiny_model("qwen2", seed=1)
    together.load_state_dict(other.state_dict())
    assert not stacked(together)
    pack_weights(other, stack=False)
    assert all(torch.equal(a, b) for a, b in zip(prompt_then_step(together), prompt_then_step(other), strict=True))


def test_a_cast_gives_each_sibling_its_own_matrix_and_a_no_op_keeps_the_stacks():
    together, apart = laid_out_pair("llama")
    assert together.float().to("cpu") is together and stacked(together)
    together.to(torch.bfloat16)
    apart.to(torch.bfloat16)
    assert not stacked(together) and {p.dtype for p in together.parameters()} == {torch.bfloat16}
    assert all(torch.equal(a, b) for a, b in zip(prompt_then_step(together), prompt_then_step(apart), strict=True))


def test_the_row_table_is_measured_on_the_stacked_products(tmp_path):
    together, _ = laid_out_pair("llama")
    table = lay_out_rows(together, tmp_path)
    assert table and all(layer.rows == table for layer in products(together))
    q_proj = together.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, StackedLinear) and q_proj.rows == table
    assert torch.equal(q_proj.weight.to_dense(), dense_matrix(q_proj.stack.layer))


def test_stacking_takes_only_alike_laid_out_siblings():
    block = torch.nn.Module()
    block.q_proj, block.k_proj = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    block.v_proj = torch.nn.Linear(6, 4)  # another input width
    pack_weights(block, stack=False)
    assert stack_siblings(block) == 0 and not stacked(block)
    block.v_proj = PackedLinear(torch.nn.Linear(8, 4))
    assert stack_siblings(block) == 1 and stack_siblings(block) == 0  # once


def test_unstacked_siblings_have_their_own_matrices_and_the_same_numbers():
    together, apart = laid_out_pair("qwen2")
    expected = prompt_then_step(together)
    assert unstack_siblings(together) == 5 * together.config.num_hidden_layers and not stacked(together)
    assert len(products(together)) == len(products(apart))
    assert all(torch.equal(a, b) for a, b in zip(prompt_then_step(together), expected, strict=True))
