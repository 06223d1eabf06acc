"""What a head's forwards cost: measured by rows, kept on disk under a key of what they depend on, and what a
reproducible budget prices a drafted step at. No timing is asserted: only shapes, keys and sums."""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.config import Eagle3Config
from forerun.costmodel import LatencyCurve
from forerun.drafters.eagle3 import costs as head_costs_module
from forerun.drafters.eagle3.costs import HeadCosts, costs_path, head_costs, measure_head_costs
from forerun.drafters.eagle3.drafter import Eagle3Drafter

from eagle3_heads import random_head
from tiny_models import prompts, tiny_model

CURVE = LatencyCurve((1, 8, 32), (0.010, 0.012, 0.020))


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_costs_are_measured_per_kind_at_every_size(target):
    costs = measure_head_costs(random_head(target), topk=4, capture=False, sizes=(1, 3, 5), context=20, repeats=1)
    for curve in (costs.level, costs.read):
        assert curve.sizes == (1, 3, 5) and all(seconds > 0 for seconds in curve.seconds)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        measure_head_costs(random_head(target), 4, False, sizes=(0, 2))


def test_costs_are_stored_read_back_and_measured_again_when_unreadable(target, tmp_path, monkeypatch):
    head = random_head(target)
    first = head_costs(head, 4, False, tmp_path)
    path = costs_path(head, 4, False, tmp_path)
    assert path.is_file() and path.parent.name == "latency"

    def measured_again(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(head_costs_module, "measure_head_costs", measured_again)
    assert head_costs(head, 4, False, tmp_path) == first  # read, not measured
    path.write_text('{"costs": {"level": "nonsense"}}')
    with pytest.raises(AssertionError, match="measured again"):
        head_costs(head, 4, False, tmp_path)


def test_the_key_names_what_the_costs_depend_on(target, tmp_path):
    head = random_head(target)
    path = costs_path(head, 4, False, tmp_path)
    assert costs_path(head, 8, False, tmp_path) != path  # another top-k
    bf16 = random_head(tiny_model("llama").to(torch.bfloat16))  # (a head casts the target's embedding it shares)
    assert costs_path(bf16, 4, False, tmp_path) != path  # another dtype
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert costs_path(head, 4, False, tmp_path) != path  # another thread count
    finally:
        torch.set_num_threads(threads)
    assert costs_path(random_head(target, seed=5), 4, False, tmp_path) == path  # not the weights' values


def test_a_drafter_sums_its_forwards_at_their_measured_prices(target):
    drafter = Eagle3Drafter(Eagle3Config(), random_head(target))
    drafter.forwarded(2, project=False)
    assert drafter.spent() == 0.0  # not priced: its budget times its steps
    drafter.costs = HeadCosts(LatencyCurve((1, 2), (1.0, 2.0)), LatencyCurve((1, 2), (10.0, 20.0)))
    drafter.forwarded(2, project=False)
    drafter.forwarded(1, project=True)
    assert drafter.spent() == 12.0 and drafter.spent() == 0.0
    assert drafter.__copy__().costs is drafter.costs  # a batch's row prices alike


@pytest.mark.parametrize("reproducible", [True, False])
def test_a_reproducible_budget_prices_the_head_on_its_stored_costs(target, tmp_path, reproducible):
    """Reproducible choices time nothing: the head's forwards are priced on its own costs, measured once into the
    latency cache; where steps are timed nothing is measured. The text is generate's either way."""
    head = random_head(target)
    decoder = forerun.Decoder(target, None, "eagle3", draft_head=head, latency=CURVE, reproducible=reproducible,
                              latency_cache=tmp_path)  # fmt: skip
    (drafter,) = decoder.drafters
    assert (drafter.costs is not None) == reproducible
    assert costs_path(head, drafter.runner.topk, False, tmp_path).is_file() == reproducible
    prompt = prompts(1)[0]
    result = decoder.generate(prompt, 16, eos_token_id=[])
    expected = target.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(result.sequences, expected)
