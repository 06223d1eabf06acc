"""One chain a step on a model with recurrent states: the budget feeds a chain and prices its second forward, the
base copies the states and puts them back, the latency curve is timed the same way."""

from __future__ import annotations

import pytest
import torch

import forerun
from forerun.base.chain import ChainBase, chain_of, chain_support, copy_states, crops_states, put_back, state_layers
from forerun.costmodel import CostModel, LatencyCurve, StaticBudget
from forerun.feed_probe import own_logits, share_of_spread
from forerun.latency import measure_curve
from forerun.prefixcache import PrefixCache
from forerun.tree import TokenTree, is_chain

from helpers import keep_half_a_chain, without_recording
from tiny_models import prompts, tiny_model

FLAT = LatencyCurve((1, 64), (10.0, 10.5))
STEEP = LatencyCurve((1, 2, 4, 8), (10.0, 16.0, 20.0, 24.0))


def branching() -> TokenTree:
    """root(1) ─ a(2) ─ b(3), root ─ d(5) ─ e(6) ─ f(7), and Jacobi probes under the root."""
    tree = TokenTree.rooted_at(1)
    tree.add_chain(0, [2, 3], source="t", scores=[0.5, 0.9])
    tree.add_chain(0, [5, 6, 7], source="t", scores=[0.6, 0.3, 0.9])
    tree.add_chain(0, [8, 9], role="probe", source="jacobi", scores=0.5)
    return tree


def test_the_cost_model_feeds_the_likeliest_line_without_probes_or_padding():
    """A tree would take both branches and the probes on a flat curve; a chain takes the line whose next node is
    likeliest at each step (d: 0.6 over a: 0.5, then e, then f), never a probe or padding."""
    tree = branching()
    assert CostModel(FLAT, 16).choose(1, [tree]).tree.roles.count("probe") == 2
    selection = CostModel(FLAT, 16, chain=True).choose(1, [tree])
    assert selection.tree.tokens == [1, 5, 6, 7] and is_chain(selection.tree)
    assert selection.node_maps == [{0: 0, 3: 1, 4: 2, 5: 3}]
    jagged = LatencyCurve((1, 2, 3, 4, 5), (10.0, 15.0, 19.5, 16.0, 25.0))  # 4 tokens cost less than 3
    sure = TokenTree.rooted_at(1)
    sure.add_chain(0, [2, 3], source="t", scores=1.0)
    assert len(CostModel(jagged, 16).choose(1, [sure]).tree) == 4  # a tree of 3 is padded to 4
    assert CostModel(jagged, 16, chain=True).choose(1, [sure]).tree.tokens == [1, 2, 3]
    assert CostModel(FLAT, 16, chain=True).for_row().chain


def test_the_head_of_a_partly_accepted_chain_is_priced_as_fed_again():
    """On the steep curve two tokens cost 1.6x one: a 0.65 guess pays as a tree node ((1 + 0.65) / 16 > 1 / 10),
    not as a chain's (a 35% chance of feeding it again, 6 ms more: 1.65 / 18.1 < 1 / 10)."""
    guess = TokenTree.rooted_at(1)
    guess.add(0, 2, source="t", score=0.65)
    assert CostModel(STEEP, 16).choose(1, [guess]).tree.tokens == [1, 2]
    assert CostModel(STEEP, 16, chain=True).choose(1, [guess]).tree.tokens == [1]


def test_a_chain_whose_states_are_cut_back_is_priced_as_a_tree_but_never_padded():
    """Where nothing is fed again (`refeeds=False`: convolution windows cut back), the 0.65 guess pays as it does in
    a tree; the chain is still never padded to a cheaper size (padding would flow into the states)."""
    guess = TokenTree.rooted_at(1)
    guess.add(0, 2, source="t", score=0.65)
    assert CostModel(STEEP, 16, chain=True, refeeds=False).choose(1, [guess]).tree.tokens == [1, 2]
    jagged = LatencyCurve((1, 2, 3, 4, 5), (10.0, 15.0, 19.5, 16.0, 25.0))
    sure = TokenTree.rooted_at(1)
    sure.add_chain(0, [2, 3], source="t", scores=1.0)
    assert CostModel(jagged, 16, chain=True, refeeds=False).choose(1, [sure]).tree.tokens == [1, 2, 3]
    assert not CostModel(STEEP, 16, chain=True, refeeds=False).for_row().refeeds  # a batch's lone row: the same


def test_a_fixed_budget_feeds_the_first_proposals_line():
    budget = StaticBudget(3, chain=True)
    selection = budget.choose(1, [branching()])
    assert selection.tree.tokens == [1, 2, 3] and is_chain(selection.tree)
    assert budget.choose(1, [branching()], drafts=False).tree.tokens == [1]


def test_the_base_puts_the_states_back_and_feeds_the_accepted_head_again():
    """After a chain of 4 of which 2 are kept, the next step (those 2 fed again first) gives the logits of one
    forward over the text."""
    model = tiny_model("qwen3_next")
    ids = [11, 7, 19, 5, 23, 13, 29, 17, 31, 37]
    base = ChainBase(model)
    assert base.begin(32) is None
    with torch.inference_mode():
        base.forward(TokenTree.rooted_at(ids[5]), 5, ids[:5])
        assert base.commit(5, [0]) == 0
        base.forward(chain_of([ids[6], ids[7], 3, 4]), 6, ())  # two wrong guesses after ids[7]
        assert base.commit(6, [0, 1]) == 2 and base.pending == ids[6:8]  # fed again with the next step
        assert base.cache.get_seq_length() == 6
        got = base.forward(chain_of(ids[8:]), 8, ()).logits
        assert base.commit(8, [0, 1]) == 0  # accepted whole: nothing to feed again
        assert share_of_spread(got, own_logits(model, ids)[8:]) < 1e-5
        assert base.cache.get_seq_length() == 10
        with pytest.raises(ValueError, match="chains only"):
            base.forward(branching(), 10, ())


def test_convolution_windows_are_cut_back_and_nothing_is_fed_again():
    """LFM2's states are the last few inputs of each short convolution: a chain's are recorded, and where 2 of 4
    are kept the windows are cut back to end at the second (and attention to 8 tokens); the next chain, fed with
    nothing before it, gives the logits of one forward over the text. Cut one token further back, they do not."""
    model = tiny_model("lfm2")
    ids = [11, 7, 19, 5, 23, 13, 29, 17, 31, 37]
    want = own_logits(model, ids)[8:]
    assert crops_states(model) and not crops_states(tiny_model("qwen3_next"))
    shares = []
    for extra in (0, 1):
        base = ChainBase(model)
        base.begin(32)
        keep_half_a_chain(base, ids, extra)
        with torch.inference_mode():
            windows = state_layers(base.cache)
            assert {int(layer.get_seq_length()) for layer in base.cache.layers if layer not in windows} == {8}
            assert {int(layer.get_seq_length()) for layer in windows} == {8 - extra}  # the windows' own count
            assert all(not layer.record_past for layer in state_layers(base.cache))
            widths = {t.shape[-1] for layer in state_layers(base.cache) for t in layer.conv_states.values()}
            assert widths == {model.config.conv_L_cache}
            got = base.forward(chain_of(ids[8:]), 8, ()).logits
        shares.append(share_of_spread(got, want))
    assert shares[0] < 1e-5 < shares[1]


def test_a_cache_that_read_past_its_text_is_not_kept():
    """A chain accepted whole beyond where the text ends (a stop string cut the answer inside it): the states hold
    tokens the text does not, so nothing is kept for prompts that begin with the text; where the text holds
    every token read, the cache is kept."""
    model = tiny_model("qwen3_next")
    ids = [11, 7, 19, 5, 23, 13, 29, 17, 31, 37]
    prefixes = PrefixCache(1000)
    for text, kept in ((ids[:8], 0), (ids, 1)):
        base = ChainBase(model)
        base.begin(32)
        with torch.inference_mode():
            base.forward(TokenTree.rooted_at(ids[5]), 5, ids[:5])
            base.commit(5, [0])
            base.forward(chain_of(ids[6:10]), 6, ())
            base.commit(6, [0, 1, 2, 3])  # 10 tokens read and kept
        base.store(prefixes, text, 10)
        assert len(prefixes.entries) == kept


def test_copies_are_copies():
    """The model writes its states in place (`copy_`): a copy that shared their storage would restore nothing."""
    model = tiny_model("lfm2")
    base = ChainBase(model)
    base.begin(32)
    with torch.inference_mode():
        base.forward(TokenTree.rooted_at(5), 4, [11, 7, 19, 13])
        copies = copy_states(base.cache)
        before = [{i: t.clone() for i, t in c[0].items() if t is not None} for c in copies if c is not None]
        base.forward(chain_of([9, 8, 7]), 5, ())
        changed = [layer.conv_states for layer in base.cache.layers if hasattr(layer, "conv_states")]
        assert any(not torch.equal(changed[n][i], t) for n, c in enumerate(before) for i, t in c.items())
        put_back(base.cache, copies, 5)
        assert all(torch.equal(changed[n][i], t) for n, c in enumerate(before) for i, t in c.items())


def test_chains_are_refused_where_they_are_another_computation():
    assert chain_support(tiny_model("qwen3_5_text")) is None
    assert "other logits" in chain_support(tiny_model("recurrent_gemma"))


def test_a_hybrids_latency_curve_is_timed_on_chains():
    """Timing forwards cropped the cache back after each (linear-attention layers cannot be cropped): it raised."""
    curve = measure_curve(tiny_model("qwen3_next"), sizes=(1, 2, 4), context=16, repeats=1)
    assert curve.sizes == (1, 2, 4) and all(s > 0 for s in curve.seconds)


def test_tokens_fed_again_are_read_plainly_past_a_trees_worth(monkeypatch):
    """Each chain accepted in part puts the states back before what it fed again, so a run of such chains feeds a
    growing head again every step; once that head reaches the budget's nodes a step feeds it with the root alone."""
    without_recording(monkeypatch)  # as a forward that writes no guess's recurrent state: states put back
    model = tiny_model("qwen3_5_text")
    text = prompts(1, length=24)[0]
    want = model.generate(text, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    answer = want[0, 24:].tolist()
    wrong = [t if i % 3 != 2 else 3 + (t - 2) % 90 for i, t in enumerate(answer)]  # every chain fails at its 3rd
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency=FLAT, latency_cache=None, max_tree_nodes=6)
    heads, forward = [], decoder.base.forward
    decoder.base.forward = lambda tree, *args: (
        heads.append((len(decoder.base.pending), len(tree))) or forward(tree, *args)
    )
    result = decoder.generate(text, 40, eos_token_id=[], prediction=wrong)
    assert torch.equal(result.sequences, want)
    assert max(head for head, _ in heads) <= 6 + 6  # at most a budget's worth, then one chain's head more
    assert any(head >= 6 and nodes == 1 for head, nodes in heads)  # read plainly
    assert result.stats.fed_again > 0
