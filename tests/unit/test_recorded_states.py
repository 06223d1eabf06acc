"""A hybrid whose forward writes each guess's recurrent state into its cache (transformers 5.25, where asked):
a partly accepted chain's states are cut back to its last accepted token, and nothing is fed again."""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.base.chain import ChainBase, chain_of, records_states, state_layers
from forerun.feed_probe import own_logits, share_of_spread
from forerun.latency import curve_settings

from helpers import keep_half_a_chain
from tiny_models import prompts, tiny_model


@pytest.mark.parametrize(("family", "writes"), [("qwen3_next", True), ("nemotron_h", True), ("zamba", False),
                                                ("lfm2", False), ("llama", False)])  # fmt: skip
def test_which_models_write_each_guesss_state_and_their_curve_says_so(family, writes):
    """Read off a 3-token step: Qwen3-Next's and Nemotron-H's forwards write it; Zamba's does not; LFM2 has no
    recurrent state (its windows are cut back anyway) and Llama no state at all. A recording model's latency curve
    times its chains recorded, not copied: it is stored under a key of its own."""
    model = tiny_model(family)
    assert records_states(model) == writes
    assert (curve_settings(model).get("chains") == "recorded") == writes


def test_a_chain_accepted_in_part_has_its_states_cut_back():
    """A chain of 4 of which 2 are kept: the recurrent states go back to those after the second (no copy taken,
    nothing waiting), and the next chain gives the logits of one forward over the text. Cut one token too far,
    they do not: the states are the recorded ones, not a copy of the step's start."""
    model = tiny_model("qwen3_next")
    ids = [11, 7, 19, 5, 23, 13, 29, 17, 31, 37]
    shares = []
    for extra in (0, 1):
        base = ChainBase(model, records=True)
        base.begin(32)
        keep_half_a_chain(base, ids, extra)
        with torch.inference_mode():
            assert all(not layer.record_past for layer in state_layers(base.cache))
            got = base.forward(chain_of(ids[8:]), 8, ()).logits
        shares.append(share_of_spread(got, own_logits(model, ids)[8:]))
    assert shares[0] < 1e-5 < shares[1]


def test_the_decoder_cuts_back_and_prices_nothing_fed_again():
    """The Decoder finds it out once: its base records, and its cost model prices no head fed again."""
    model = tiny_model("qwen3_5_text")
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency_cache=None)
    assert decoder.base.records and not decoder.budget.refeeds
    text = prompts(1, length=24)[0]
    want = model.generate(text, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    answer = want[0, 24:].tolist()
    wrong = [t if i % 3 != 2 else 3 + (t - 2) % 90 for i, t in enumerate(answer)]  # every chain fails at its 3rd
    result = decoder.generate(text, 24, eos_token_id=[], prediction=wrong)
    assert torch.equal(result.sequences, want)
    assert result.stats.fed_again == 0 and result.stats.forwards < 20, result.stats.summary()
