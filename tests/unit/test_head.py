"""LogitsHead: a few positions' logits as a tall product, only where that is the model's own computation and only at
the sizes where it measured faster."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from forerun import head as head_module
from forerun.forward_inputs import cache_argument
from forerun.head import TALL_MAX_POSITIONS, LogitsHead, tall_sizes_for

from tiny_models import COMMON, FAMILIES, tiny_model

EVERY_SIZE = range(1, TALL_MAX_POSITIONS + 1)
"""Asked of the heads below, so the tall path runs whatever this machine measures."""
OWN_HEADS = {"gemma2", "gptj", "opt"}
"""Families whose logits are not exactly their output matrix applied to their body's last hidden states: Gemma 2
softcaps them (30 tanh(x / 30)), GPT-J's matrix has a bias; OPT's forward calls its decoder, not the module its
`base_model_prefix` names, so the check sees no body output and keeps the model's call. (Granite divides by
logits_scaling, 1.0 in these configs: the same bits, so the split is its own computation.)"""


def ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


def positions_logits(head: LogitsHead, model: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head's, the model's own) logits [1, n, vocab] of n tokens after a 12-token prompt in the cache."""
    prompt, step = ids(12), ids(n, seed=n)
    caches = []
    for _ in range(2):
        cache = DynamicCache(config=model.config)
        model(input_ids=prompt, use_cache=True, **{cache_argument(model): cache})
        caches.append(cache)
    return (
        head(input_ids=step, cache=caches[0], use_cache=True),
        model(input_ids=step, use_cache=True, **{cache_argument(model): caches[1]}).logits,
    )


@torch.inference_mode()
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_equal_the_models_own_for_every_family(family: str) -> None:
    model = tiny_model(family, "eager")
    head = LogitsHead(model, EVERY_SIZE)
    head(input_ids=ids(12), use_cache=False)  # the first call decides
    assert head.tall == (family not in OWN_HEADS)
    for n in (1, 2, 3, 5, TALL_MAX_POSITIONS, TALL_MAX_POSITIONS + 3):
        mine, own = positions_logits(head, model, n)
        assert mine.shape == own.shape
        torch.testing.assert_close(mine, own, rtol=0, atol=1e-6)
        assert torch.equal(mine.argmax(-1), own.argmax(-1))


def custom_model(family: str, **settings: object) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **COMMON, **{**FAMILIES[family], **settings})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


@torch.inference_mode()
@pytest.mark.parametrize(
    "family, settings",
    [
        ("granite", {"logits_scaling": 4.0}),  # logits = W h / 4
        ("gemma2", {"final_logit_softcapping": 30.0}),  # logits = 30 tanh(W h / 30)
        ("gptj", {}),  # an output matrix with a bias
    ],
)
def test_models_that_change_their_logits_keep_their_own_call(family: str, settings: dict) -> None:
    """Negative controls: a split there would give other logits (the first two fail with the check removed)."""
    model = custom_model(family, **settings)
    head = LogitsHead(model, EVERY_SIZE)
    head(input_ids=ids(12), use_cache=False)
    assert not head.tall
    for n in (2, 4):
        mine, own = positions_logits(head, model, n)
        assert torch.equal(mine, own)


@torch.inference_mode()
def test_tall_product_only_at_the_sizes_chosen_and_keep() -> None:
    model = tiny_model("llama", "eager")
    head = LogitsHead(model, {0, 1, 2, 3, 8, TALL_MAX_POSITIONS + 1})  # 0 and 17 are never tall
    calls = []
    hook = model.get_output_embeddings().register_forward_hook(lambda module, args, out: calls.append(out.shape[1]))
    try:
        head(input_ids=ids(12), use_cache=False)
        assert head.tall and head.tall_sizes == {1, 2, 3, 8} and calls == [12]
        for n in (1, 2, 4, 8, 9, TALL_MAX_POSITIONS + 1):
            head(input_ids=ids(n), use_cache=False)
        # the model's own matrix ran for 4, 9 and 17 positions; 1 (its row written twice), 2 and 8 were tall
        assert calls == [12, 4, 9, 17]
        one = head(input_ids=ids(1), use_cache=False)
        torch.testing.assert_close(one, model(input_ids=ids(1)).logits, rtol=0, atol=1e-6)
        out = head(3, input_ids=ids(20), use_cache=False)  # keep: only the last 3 positions' logits
        assert out.shape == (1, 3, model.config.vocab_size) and calls == [12, 4, 9, 17, 1]
        torch.testing.assert_close(out, model(input_ids=ids(20)).logits[:, -3:], rtol=0, atol=1e-6)
    finally:
        hook.remove()


@torch.inference_mode()
def test_not_in_low_precision() -> None:
    """In bf16 the output matrix costs the same for 1-4 rows: the model's own call stays."""
    model = tiny_model("llama", "eager").to(torch.bfloat16)
    head = LogitsHead(model, EVERY_SIZE)
    head(input_ids=ids(12), use_cache=False)
    assert not head.tall


def test_sizes_measured_faster_are_chosen_stored_and_read_back(tmp_path, monkeypatch) -> None:
    """The rule on given timings (tall where it took at most 0.9 of F.linear's time), kept on disk: the second
    call reads the file and measures nothing."""
    timings = {n: (0.010, 0.010) for n in EVERY_SIZE} | {2: (0.018, 0.009), 3: (0.010, 0.0090), 4: (0.010, 0.0091)}
    measured = []
    monkeypatch.setattr(head_module, "time_layouts", lambda weight, sizes: measured.append(1) or timings)
    weight = torch.zeros(64, 16)
    assert tall_sizes_for(weight, tmp_path) == {2, 3}  # 4 saved 9%: a tie keeps the model's own call
    assert tall_sizes_for(weight, tmp_path) == {2, 3} and measured == [1]
    (stored,) = (tmp_path / "head").glob("64x16-float32-t*.json")
    assert stored.read_text().count("linear_ms") == len(EVERY_SIZE)
    assert tall_sizes_for(torch.zeros(64, 32), tmp_path) == {2, 3} and measured == [1, 1]  # another matrix: measured
    stored.write_text('{"tall": ["7", null]}')  # a damaged file is measured again, not trusted or fatal
    assert tall_sizes_for(weight, tmp_path) == {2, 3} and measured == [1, 1, 1]


@torch.inference_mode()
def test_a_head_left_to_itself_measures_this_device(tmp_path) -> None:
    model = tiny_model("llama", "eager")
    head = LogitsHead(model, cache_dir=tmp_path)
    head(input_ids=ids(12), use_cache=False)
    assert head.tall_sizes <= set(EVERY_SIZE) and len(list((tmp_path / "head").glob("*.json"))) == 1
    seconds = head_module.time_layouts(model.get_output_embeddings().weight, (2, 5))
    assert set(seconds) == {2, 5} and all(t > 0 for pair in seconds.values() for t in pair)
