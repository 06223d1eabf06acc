"""The cost model on hand-made inputs: chosen trees checked by hand and by brute force; calibration; the curve."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import forerun
from forerun.costmodel import (
    Calibration,
    CostModel,
    ForwardTimes,
    LatencyCurve,
    StaticBudget,
    best_prefix,
    support_keys,
)
from forerun.tree import TokenTree

from helpers import OracleDrafter, RandomDrafter
from tiny_models import VOCAB, prompts, tiny_model

# Shaped like this CPU's fp32 curve: 3 tokens cost more than 4 (ms).
JAGGED = LatencyCurve((1, 2, 3, 4, 5), (10.0, 15.0, 19.5, 16.0, 25.0))
FLAT = LatencyCurve((1, 64), (10.0, 10.5))
STEEP = LatencyCurve((1, 2, 4, 8), (10.0, 16.0, 20.0, 24.0))


def chain_and_sibling(scores=(0.8, 0.9, 0.9), sibling=0.2) -> TokenTree:
    """root(1) ─ a(2) ─ b(3) ─ c(4), and root ─ d(5) beside a."""
    tree = TokenTree.rooted_at(1)
    tree.add_chain(0, [2, 3, 4], source="t", scores=list(scores))
    tree.add(0, 5, source="t", score=sibling)
    return tree


def test_curve_interpolates_extrapolates_and_refuses_nonsense():
    curve = LatencyCurve((1, 2, 4), (1.0, 2.0, 2.5))
    assert curve.cost(1) == 1.0 and curve.cost(3) == 2.25 and curve.cost(8) == 3.5  # slope 0.25 past the end
    assert curve.relative(4) == 2.5 and curve.default_cap(2.0) == 2
    for sizes, seconds in [((2, 4), (1, 2)), ((1, 1), (1, 2)), ((1, 2), (1, -2)), ((1,), (1, 2))]:
        with pytest.raises(ValueError):
            LatencyCurve(sizes, seconds)


def test_hand_worked_choice_on_a_jagged_curve():
    """Reach a .8, b .72, c .648, d .2. Rates (1 + E) / cost: k=0 1/10=.100, k=1 1.8/15=.120,
    k=2 2.52/19.5=.129, k=3 3.168/16=.198, k=4 3.368/25=.135: feed root + a, b, c (4 tokens, cheaper than 3)."""
    model = CostModel(JAGGED, max_nodes=16)
    tree = chain_and_sibling()
    selection = model.choose(1, [tree])
    assert selection.tree.tokens == [1, 2, 3, 4]
    assert selection.expected_accepted == pytest.approx(0.8 + 0.72 + 0.648)
    assert selection.node_maps == [{0: 0, 1: 1, 2: 2, 3: 3}]  # d was not fed


def test_poor_drafts_feed_the_root_alone_and_certain_ones_the_whole_tree():
    poor = chain_and_sibling((0.05, 0.05, 0.05), 0.05)
    assert CostModel(STEEP, 16).choose(1, [poor]).tree.tokens == [1]
    certain = chain_and_sibling((1.0, 1.0, 1.0), 0.0)
    certain.scores[4] = 0.01  # the sibling: almost never right, but on a flat curve even it is worth a place
    assert CostModel(FLAT, 16).choose(1, [certain]).tree.tokens == [1, 2, 3, 4, 5]
    assert CostModel(FLAT, 3).choose(1, [certain]).tree.tokens == [1, 2, 3]  # the cap holds


def test_no_drafts_at_the_first_step_when_asked():
    assert CostModel(FLAT, 16).choose(1, [chain_and_sibling((1, 1, 1))], drafts=False).tree.tokens == [1]
    assert StaticBudget(16).choose(1, [chain_and_sibling()], drafts=False).tree.tokens == [1]


def ancestor_closed_subsets(tree: TokenTree):
    nodes = list(range(1, len(tree)))
    for size in range(len(nodes) + 1):
        for subset in itertools.combinations(nodes, size):
            chosen = set(subset)
            if all(tree.parents[n] == 0 or tree.parents[n] in chosen for n in chosen):
                yield chosen


@pytest.mark.parametrize("seed", range(30))
def test_choice_is_the_brute_force_optimum(seed):
    """On random trees and random (non-monotone) curves, no ancestor-closed subset beats the chosen one."""
    rng = random.Random(seed)
    tree = TokenTree.rooted_at(0)
    for token in range(1, 8):
        tree.add(rng.randrange(len(tree)), token, source="s", score=rng.random())
    curve = LatencyCurve(tuple(range(1, 10)), tuple(rng.uniform(1.0, 3.0) for _ in range(9)))
    model = CostModel(curve, max_nodes=9)
    p = model.chances(tree, support_keys(tree, [tree], [{i: i for i in range(len(tree))}]))
    reach = [1.0]
    for node in range(1, len(tree)):
        reach.append(reach[tree.parents[node]] * p[node])

    def rate(chosen):  # a forward may be padded up to any cheaper size within the cap
        return (1 + sum(reach[n] for n in chosen)) / min(curve.cost(m) for m in range(1 + len(chosen), 10))

    best = max(rate(chosen) for chosen in ancestor_closed_subsets(tree))
    selection = model.choose(0, [tree])
    chosen = {node for node in selection.node_maps[0] if node}
    assert rate(chosen) == pytest.approx(best)
    padding = selection.tree.sources.count("padding")
    assert curve.cost(len(selection.tree)) == min(curve.cost(m) for m in range(1 + len(chosen), 10))
    assert padding == 0 or curve.cost(len(selection.tree) - padding) > curve.cost(len(selection.tree))


def test_a_step_is_padded_where_a_larger_forward_costs_less(model):
    """bf16 on a CPU with bf16 units: 2-4 tokens cost less than 1. A step with nothing worth feeding is padded to
    the cheapest size with probes of no drafter's; the text stays plain generate's."""
    dip = LatencyCurve((1, 2, 3, 4, 8), (10.0, 9.0, 9.2, 9.1, 12.0))
    selection = CostModel(dip, 16).choose(1, [])
    assert selection.tree.tokens == [1, 1] and selection.tree.roles == ["root", "probe"]
    assert selection.tree.sources == ["", "padding"] and selection.expected_accepted == 0.0
    assert CostModel(STEEP, 16).choose(1, []).tree.tokens == [1]  # a monotone curve: the root alone
    assert len(CostModel(dip, 1).choose(1, []).tree) == 1  # never beyond the cap
    prompt = prompts(1)[0]
    truth = model.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    guessing = forerun.Decoder(model, None, "plain", drafters=[RandomDrafter(truth, VOCAB)], adaptive=True, latency=dip)
    result = guessing.generate(prompt, 20, eos_token_id=[])
    assert result.sequences[0].tolist() == truth and result.stats.fed_hist[1] == 0  # a guess rides for free
    silent = forerun.Decoder(
        model, None, "plain", drafters=[RandomDrafter(truth, VOCAB, width=0)], adaptive=True, latency=dip
    )
    result = silent.generate(prompt, 20, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    assert result.stats.fed_hist[2] >= result.stats.forwards - 1  # every step padded (the prefill's prompt aside)
    assert result.stats.single_token_share == 1.0  # padded steps are still plain decoding steps


def test_probe_groups_are_fed_whole_when_their_worth_pays_for_them():
    """Probes are worth the sum of their scores (future tokens), fed all together or not at all."""
    tree = TokenTree.rooted_at(1)
    tree.add_chain(0, [7, 8], role="probe", source="jacobi", scores=0.25)  # worth 0.5 tokens in all
    tree.add(0, 2, source="jacobi", score=0.01)
    # flat curve: 4 tokens cost 5% more than 1 and bring 0.5 + 0.01 expected tokens: everything goes
    assert CostModel(FLAT, 16).choose(1, [tree]).tree.roles == ["root", "probe", "probe", "candidate"]
    # steep curve: 3 tokens cost 2x; 1.5 / 2.0 < 1 / 1.0: the root alone, no probes either
    assert CostModel(STEEP, 16).choose(1, [tree]).tree.roles == ["root"]
    # the group does not fit the cap: the candidate may still go
    assert CostModel(FLAT, 2).choose(1, [tree]).tree.roles == ["root", "candidate"]
    # a good candidate elsewhere is fed without worthless probes
    other = TokenTree.rooted_at(1)
    other.add(0, 3, source="trie", score=1.0)
    tree.scores[1] = tree.scores[2] = 0.0
    selection = CostModel(STEEP, 16).choose(1, [tree, other])
    assert selection.tree.tokens == [1, 3, 2] or selection.tree.tokens == [1, 3]
    assert "probe" not in selection.tree.roles


def test_best_prefix_weighs_groups_by_hand():
    """Curve (1: 10, 2: 16, 3: 17, 4: 18): candidates [0.9], group (value 0.6, size 2).
    k=1 alone: 1.9/16 = .119; k=1 + group: 2.5/18 = .139; group alone: 1.6/17 = .094; root: .100."""
    curve = LatencyCurve((1, 2, 3, 4), (10.0, 16.0, 17.0, 18.0))
    choice = best_prefix([0.9], curve, groups=[(0.6, 2)])
    assert (choice.nodes, choice.groups, choice.fed) == (1, (0,), 4)


def test_fused_nodes_take_the_best_calibrated_estimate():
    a, b = TokenTree.rooted_at(1), TokenTree.rooted_at(1)
    a.add(0, 2, source="trie", score=0.1)
    b.add(0, 2, source="prompt_lookup", score=0.9)
    model = CostModel(STEEP, 16)
    selection = model.choose(1, [a, b])
    assert selection.tree.tokens == [1, 2] and selection.expected_accepted == pytest.approx(0.9)
    assert selection.node_maps == [{0: 0, 1: 1}, {0: 0, 1: 1}]


def test_a_contested_guess_is_calibrated_apart_from_the_same_drafter_alone_or_agreed_with():
    """Trie guesses 7, prompt lookup 8, and the text goes on with 8, step after step: the trie's contested guesses
    fall to a low rate (and stop being fed), while a trie guess nobody disputes keeps its own prior and one both
    drafters make is calibrated as their agreement."""

    def proposal(source: str, token: int, score: float = 0.5) -> TokenTree:
        tree = TokenTree.rooted_at(1)
        tree.add(0, token, source=source, score=score)
        return tree

    model = CostModel(STEEP, 16)
    for _ in range(30):
        selection = model.choose(1, [proposal("trie", 7), proposal("prompt_lookup", 8)])
        model.learn(selection, [8, 2])
    assert selection.ranking.keys == [None, ("trie/contested", 0.5), ("prompt_lookup/contested", 0.5)]
    assert selection.tree.tokens == [1, 8]  # the contested trie guess is no longer fed
    assert model.calibration.probability("trie/contested", 1, 0.5) < 0.1
    assert model.calibration.probability("prompt_lookup/contested", 1, 0.5) > 0.9
    alone = model.rank(1, [proposal("trie", 7)])
    assert alone.keys[1] == ("trie", 0.5) and alone.chances == [pytest.approx(0.5)]  # untouched prior
    agreed = model.rank(1, [proposal("trie", 8, 0.3), proposal("prompt_lookup", 8, 0.6)])
    assert agreed.keys[1] == ("prompt_lookup+trie", 0.6)
    # learning also reaches nodes that were not fed: the unfed trie guess was counted every step
    assert model.calibration.trials[("trie/contested", 1, 2)] == pytest.approx(30)


def proposal(source: str, score: float = 0.8) -> TokenTree:
    """root(1) -> 2, guessed by `source`."""
    tree = TokenTree.rooted_at(1)
    tree.add(0, 2, source=source, score=score)
    return tree


def test_fed_guesses_that_fail_beyond_their_estimate_lower_their_source_alone():
    """The calibrated chance of a trie guess says 0.8, but the trie guesses that were fed kept failing (as the
    guesses whose estimate came out highest by chance do): the trie's chances fall and its guess is no longer fed,
    while a prompt-lookup guess with the same calibrated chance still is, and the calibration itself is untouched."""
    model = CostModel(STEEP, 16)
    assert model.choose(1, [proposal("trie")]).tree.tokens == [1, 2]  # (1 + .8) / 16 beats 1 / 10
    for _ in range(40):
        model.fed_check.record("trie", 0.8, False)
    assert model.choose(1, [proposal("trie")]).tree.tokens == [1]
    assert model.choose(1, [proposal("prompt_lookup")]).tree.tokens == [1, 2]
    assert model.calibration.probability("trie", 1, 0.8) == pytest.approx(0.8)
    assert model.rank(1, [proposal("trie")]).raw[1] == pytest.approx(0.8)  # what the check learns from


def test_a_source_the_fed_check_stopped_is_fed_again_once_it_has_waited():
    """Only fed guesses move a source's factor: after its fed guesses failed, the trie's unfed guesses are right
    step after step (the calibration sees it), and once it has proposed unfed for 16 steps its factor relaxes
    toward 1 until its guesses are fed again (without the relaxation they never would be)."""
    model = CostModel(STEEP, 16)
    for _ in range(40):
        model.fed_check.record("trie", 0.8, False)
    fed = []
    for _ in range(200):
        selection = model.choose(1, [proposal("trie")])
        fed.append(len(selection.tree) > 1)
        model.learn(selection, [2, 3])
    assert fed[:17] == [False] * 17 and fed[-1]


def test_the_fed_check_learns_from_fed_guesses_whose_parent_was_accepted_only():
    """Prompt lookup proposes 2 -> 3, the trie 4 beside 2 (poor, not fed); the text goes on 2, 5: the fed 2 was
    right, the fed 3 wrong; the unfed trie guess is left to the calibration."""
    chain, poor = TokenTree.rooted_at(1), TokenTree.rooted_at(1)
    chain.add_chain(0, [2, 3], source="prompt_lookup", scores=0.9)
    poor.add(0, 4, source="trie", score=0.05)
    model = CostModel(STEEP, 16)
    selection = model.choose(1, [chain, poor])
    assert selection.tree.tokens == [1, 2, 3] and len(selection.fed) == 2
    model.learn(selection, [2, 5])
    check = model.fed_check
    assert check.hits == {"prompt_lookup/contested": 1.0, "prompt_lookup": 0.0}
    assert check.predicted == {"prompt_lookup/contested": pytest.approx(0.9), "prompt_lookup": pytest.approx(0.9)}
    assert ("trie/contested", 1, 0) in model.calibration.trials  # the calibration learnt from it all the same


def test_calibration_learns_from_every_proposed_node_fed_or_not():
    """Committed [7, 3]: node 7 (depth 1) was right, 9 under it wrong, 8 (depth 1) wrong, 4 under 8 unknown."""
    tree = TokenTree.rooted_at(5)
    tree.add_chain(0, [7, 9], source="s", scores=0.5)
    tree.add_chain(0, [8, 4], source="s", scores=0.5)
    calibration = Calibration()
    calibration.learn(tree, [7, 3])
    assert calibration.trials == {("s", 1, 2): 2.0, ("s", 2, 2): 1.0}
    assert calibration.hits == {("s", 1, 2): 1.0, ("s", 2, 2): 0.0}
    assert calibration.estimate("s", 1, 0.5) == pytest.approx((1 + 2 * 0.5) / (2 + 2))
    # this request, depth 1: node 7 predicted 0.5 (the prior) and hit; node 8 then predicted (1 + 1) / (1 + 2)
    # and missed; older observations decay by 0.97 each
    hits, predicted = 0.97, 0.5 * 0.97 + 2 / 3
    assert calibration.correction("s", 1) == pytest.approx((hits + 2) / (predicted + 2))


def test_request_correction_scales_a_request_that_goes_worse_than_the_long_run():
    calibration = Calibration()
    for _ in range(60):
        calibration.record("s", 1, 0.5, True)  # a good earlier request: the long-run rate is high
    calibration.new_request()
    assert calibration.probability("s", 1, 0.5) > 0.9
    for _ in range(10):
        calibration.record("s", 1, 0.5, False)  # this request: the guesses miss
    assert calibration.probability("s", 1, 0.5) < 0.35 * calibration.estimate("s", 1, 0.5) / 0.9


def test_calibration_forgets_slowly():
    calibration = Calibration()
    for _ in range(200):
        calibration.record("s", 1, 0.5, True)
    for _ in range(200):
        calibration.record("s", 1, 0.5, False)
    assert calibration.probability("s", 1, 0.5) < 0.05  # the old hits have been halved away


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_off_switch_a_drafter_that_is_always_wrong_settles_into_one_token_steps(model):
    prompt = prompts(1)[0]
    truth = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    decoder = forerun.Decoder(
        model, None, "plain", drafters=[RandomDrafter(truth, VOCAB)], adaptive=True, latency=STEEP
    )
    fed = []
    original = decoder.budget.choose

    def spy(*args, **kwargs):
        selection = original(*args, **kwargs)
        fed.append(len(selection.tree))
        return selection

    decoder.budget.choose = spy
    result = decoder.generate(prompt, 40, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    assert fed[0] > 1  # it tried (the drafter's own score, before any evidence)
    assert set(fed[4:]) == {1}, fed  # within a few steps: the root alone, every step
    assert result.stats.single_token_share > 0.85


def test_an_oracle_gets_its_whole_branch_fed(model):
    prompt = prompts(1)[0]
    truth = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    oracle = OracleDrafter(truth, 5, VOCAB)
    decoder = forerun.Decoder(model, None, "plain", drafters=[oracle], adaptive=True, latency=STEEP)
    result = decoder.generate(prompt, 40, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    assert result.stats.accepted_hist[5] >= result.stats.forwards - 3  # full depth nearly every step
    assert result.stats.accepted_by.get("decoy", 0) == 0


def test_forward_times_learn_the_ratio_of_drafted_to_one_token_forwards():
    times = ForwardTimes()
    assert times.penalty == 1.0  # nothing timed: the curve as measured
    for _ in range(100):
        times.record(1, 0.010, 0.020)  # every forward twice its price (a busy machine): no penalty
        times.record(4, 0.015, 0.030)
    assert times.penalty == pytest.approx(1.0)
    for _ in range(100):
        times.record(1, 0.010, 0.010)
        times.record(8, 0.020, 0.040)  # drafted forwards 2x their price, 1-token ones on it (a long context)
    assert times.penalty == pytest.approx(2.0, rel=0.01)
    times.record(8, 0.020, 50.0)  # a stall counts as a 3x forward at most: one step of 20, not a thousandfold
    assert times.penalty == pytest.approx(2.05, rel=0.01)
    times.record(8, 0.020, float("nan"))
    times.record(8, 0.0, 1.0)
    assert times.penalty == pytest.approx(2.05, rel=0.01)  # nonsense timings are ignored


def test_forward_times_forget_a_penalty_that_stopped_all_drafting():
    times = ForwardTimes(root=1.0, drafted=3.0)
    for _ in range(16):
        times.record(1, 0.010, 0.010)
    assert times.penalty == pytest.approx(3.0)  # a few undrafted steps are the penalty working, not evidence
    for _ in range(30):
        times.record(1, 0.010, 0.010)
    assert times.penalty < 1.1  # after many, drafting is tried again and measured afresh


def test_a_penalty_on_drafted_forwards_changes_what_is_fed():
    """STEEP: one candidate at 0.8 pays on the curve, (1 + .8) / 16 = .1125 > 1 / 10; measured 1.5x dearer than
    the curve (relative to 1-token forwards) it does not: 1.8 / 24 = .075; and a certain chain of 7 still does:
    (1 + 7 * .95-ish) / 36 > .1."""
    tree = TokenTree.rooted_at(1)
    tree.add(0, 2, source="t", score=0.8)
    assert CostModel(STEEP, 16).choose(1, [tree]).tree.tokens == [1, 2]
    assert CostModel(STEEP, 16, times=ForwardTimes(drafted=1.5)).choose(1, [tree]).tree.tokens == [1]
    chain = TokenTree.rooted_at(1)
    chain.add_chain(0, list(range(2, 9)), source="t", scores=[1.0] * 7)
    assert len(CostModel(STEEP, 16, times=ForwardTimes(drafted=1.5)).choose(1, [chain]).tree) == 8
    assert best_prefix([0.8], STEEP, draft_penalty=1.5).nodes == 0 and best_prefix([0.8], STEEP).nodes == 1


def test_decoding_times_each_forward_after_the_prefill(model):
    """The engine reports every decoding forward's size and seconds to the budget; not the prefill's."""
    prompt = prompts(1)[0]
    truth = model.generate(prompt, max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    decoder = forerun.Decoder(
        model, None, "plain", drafters=[OracleDrafter(truth, 3, VOCAB)], adaptive=True, latency=STEEP
    )
    assert decoder.budget.times is None  # a given curve is priced as it is
    decoder.budget.times = ForwardTimes()
    timed, fed = [], []
    original_timed, original_choose = decoder.budget.timed, decoder.budget.choose

    def spy_timed(size, seconds):
        timed.append((size, seconds))
        original_timed(size, seconds)

    def spy_choose(*args, **kwargs):
        selection = original_choose(*args, **kwargs)
        fed.append(len(selection.tree))
        return selection

    decoder.budget.timed, decoder.budget.choose = spy_timed, spy_choose
    result = decoder.generate(prompt, 30, eos_token_id=[])
    assert result.sequences[0].tolist() == truth
    assert [size for size, _ in timed] == fed[1:] and len(timed) == result.stats.forwards - 1
    assert all(seconds > 0 for _, seconds in timed)
    assert decoder.budget.times.root != 1.0 or decoder.budget.times.drafted != 1.0  # it learnt from them


def test_curve_is_measured_once_then_read_from_the_cache(model, tmp_path, monkeypatch):
    from forerun import latency

    first = latency.curve_for(model, tmp_path)
    files = list((tmp_path / "latency").glob("*.json"))
    assert len(files) == 1 and "LlamaForCausalLM-float32" in files[0].name

    def must_not_measure(*args, **kwargs):
        raise AssertionError("the cached curve was not used")

    monkeypatch.setattr(latency, "measure_curve", must_not_measure)
    assert latency.curve_for(model, tmp_path) == first
    bf16 = tiny_model("llama").to(torch.bfloat16)
    assert latency.curve_path(bf16, tmp_path) != files[0]  # another dtype, another curve
    files[0].write_text("{not json")  # a damaged file is measured again, not trusted
    monkeypatch.undo()
    assert latency.curve_for(model, tmp_path).sizes == first.sizes
    files[0].write_text('{"sizes": [1], "seconds": [0.01], "batched": "nonsense"}')  # JSON, but not a curve
    assert latency.curve_for(model, tmp_path).sizes == first.sizes


def test_a_kept_curve_of_other_sizes_is_measured_again_not_priced_on(model, tmp_path):
    """A curve of one size under the cost model's key (an older `forerun curve --sizes 1` stored one there) made
    every later Decoder feed the root alone: no method drafted again. It is measured again; a batched part of other
    rows is measured again when a batch asks for it."""
    from forerun import latency
    from forerun.costmodel import LatencyCurve

    path = latency.curve_path(model, tmp_path)
    latency.save_curve(LatencyCurve((1,), (0.05,)), path, latency.curve_settings(model))
    assert latency.curve_for(model, tmp_path).sizes == latency.SIZES
    assert latency.load_curve(path).sizes == latency.SIZES  # and kept so
    full = latency.load_curve(path)
    odd_rows = full.with_batches(((2, LatencyCurve((1, 2), (0.02, 0.03))), (3, LatencyCurve((1, 2), (0.03, 0.04)))))
    latency.save_curve(odd_rows, path, latency.curve_settings(model))
    assert latency.curve_for(model, tmp_path) == full  # its own sizes, rows dropped
    batched = latency.curve_for(model, tmp_path, batched=True)
    assert [rows for rows, _ in batched.batched] == list(latency.BATCH_ROWS)
    decoder = forerun.Decoder(model, None, "prompt_lookup", latency_cache=tmp_path)
    assert decoder.budget.max_nodes > 1


def test_a_curve_measured_with_grouped_masked_attention_is_another_curve(monkeypatch):
    """Under transformers' TRANSFORMERS_SDPA_FORCE_GQA=1 a tree forward skips a copy of the cache per query head: its
    curve is another file; without the switch the settings (and the names of curves already measured) are as before.
    Eager attention has no such path."""
    from forerun import latency

    sdpa, eager = tiny_model("llama", "sdpa"), tiny_model("llama", "eager")
    before, eager_before = latency.curve_settings(sdpa), latency.curve_settings(eager)
    assert "sdpa_masked_gqa" not in before
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    grouped = latency.curve_settings(sdpa)
    assert grouped == before | {"sdpa_masked_gqa": True}
    assert latency.curve_key(grouped) != latency.curve_key(before)
    assert latency.curve_settings(eager) == eager_before


def test_batched_rows_are_priced_from_their_own_curves():
    rows2 = LatencyCurve((1, 4), (12.0, 30.0))
    rows4 = LatencyCurve((1, 4), (14.0, 50.0))
    curve = LatencyCurve((1, 4, 16), (10.0, 16.0, 40.0), ((4, rows4), (2, rows2)))
    assert [rows for rows, _ in curve.batched] == [2, 4]  # sorted
    assert curve.batch_cost(1, 4) == 16.0 and curve.batch_cost(2, 4) == 30.0 and curve.batch_cost(4, 1) == 14.0
    assert curve.batch_cost(3, 4) == 40.0  # halfway between 2 and 4 rows
    assert curve.batch_cost(8, 4) == 90.0  # beyond 4 rows: + (50 - 30) / 2 per row
    assert curve.batch_cost(2, 2) == 18.0  # along the 2-row curve
    assert LatencyCurve((1, 4, 16), (10.0, 16.0, 40.0)).batch_cost(4, 4) == 40.0  # none measured: 16 tokens
    assert LatencyCurve.from_dict(curve.as_dict()) == curve
    assert "batched" not in LatencyCurve((1,), (1.0,)).as_dict()  # files from before batches read the same
    for batched in [((1, rows2),), ((2, rows2), (2, rows4))]:
        with pytest.raises(ValueError, match="distinct row counts >= 2"):
            LatencyCurve((1,), (1.0,), batched)


def test_batches_measure_their_curves_once_beside_the_single_row_curve(model, tmp_path, monkeypatch):
    from forerun import latency

    decoder = forerun.Decoder(model, None, "prompt_lookup", latency_cache=tmp_path)
    assert decoder.budget.curve.batched == ()  # a single prompt never pays for the batched measurement
    budget = decoder.batch_budget()
    assert budget is decoder.budget and [rows for rows, _ in budget.curve.batched] == list(latency.BATCH_ROWS)
    assert all(c.sizes == (1, 2, 3, 4, 6, 8, 12, 16) for _, c in budget.curve.batched)

    def must_not_measure(*args, **kwargs):
        raise AssertionError("the stored curve was not used")

    monkeypatch.setattr(latency, "measure_curve", must_not_measure)
    monkeypatch.setattr(latency, "measure_batched", must_not_measure)
    again = forerun.Decoder(model, None, "prompt_lookup", latency_cache=tmp_path)
    assert again.batch_budget().curve == budget.curve  # read back from the one file
    given = forerun.Decoder(model, None, "prompt_lookup", latency=STEEP)
    assert given.batch_budget().curve is STEEP  # a curve given by the caller is used as it is


def test_a_row_tells_its_paired_switch_what_the_same_text_costs_without_the_head():
    """A step commits 4 tokens in 2.0 s (measured), 0.25 s of it the head's own. Without the head the budget would
    have fed a 2-node tree that holds the first of them: that step writes 2 tokens (the held one, then the target's
    own) in 2.0 - 0.25 s less the fed tree's price plus its own. The same 4 tokens take two such steps: the switch is
    told both sides for the same text."""
    from types import SimpleNamespace

    from forerun.costmodel import DraftSwitch, Selection
    from forerun.row import RowRun

    switch = DraftSwitch(paired=True)
    told = []
    switch.record_pair = lambda *args: told.append(args)
    prices = {1: 1.0, 2: 1.0, 5: 1.5}
    budget = SimpleNamespace(switch=switch, reproducible=False, priced_step=lambda fed, spent, rows: prices[fed])
    head = SimpleNamespace(costly=True, name="head")
    alone = TokenTree.rooted_at(1)
    alone.add(0, 7)  # holds the first committed token
    row = RowRun.__new__(RowRun)
    row.job = SimpleNamespace(drafters=[head])
    row.ctx = SimpleNamespace(tokens=[3, 1, 7, 8, 9, 4])
    row.budget, row.stats, row.rows, row.padded, row.padded_alone = budget, SimpleNamespace(forwards=3), 1, 0, 0
    row.costly_drafting, row.costly_seconds = True, 0.25
    row.alone = Selection(alone, [{}])
    fed = TokenTree.rooted_at(1)
    fed.add_chain(0, [7, 8, 9, 5])
    row.time_costly(Selection(fed, [{}]), 4, 2.0)
    kept, alone_seconds = 2, 2.0 - 0.25 - prices[5] + prices[2]  # 1 held, then the target's own token
    assert told == [(4, 2.0, 4, alone_seconds * 4 / kept)]


def test_a_row_of_a_batch_is_priced_at_its_share_of_the_forward():
    """Reproducible choices: a row among 3 prices its step at its share of the 3-row forward padded to the batch's
    node count (8 here, its own tree 4), its head's forwards whole; and the step without the head at its share of
    the forward the batch's choice without heads pads to (4 here, its own tree 2)."""
    from types import SimpleNamespace

    from forerun.costmodel import CostModel, DraftSwitch, Selection
    from forerun.row import RowRun

    three = LatencyCurve((1, 4, 8), (0.030, 0.045, 0.060))
    budget = CostModel(LatencyCurve((1, 8), (0.010, 0.030), ((3, three),)), 16, reproducible=True)
    budget.switch = DraftSwitch(paired=True)
    told = []
    budget.switch.record_pair = lambda *args: told.append(args)
    head = SimpleNamespace(costly=True, name="head", spent=lambda: 0.002)
    row = RowRun.__new__(RowRun)
    row.job, row.ctx = SimpleNamespace(drafters=[head]), SimpleNamespace(tokens=[3, 1, 7, 9])
    row.budget, row.stats, row.rows = budget, SimpleNamespace(forwards=3), 3
    row.costly_drafting, row.costly_seconds, row.padded, row.padded_alone = True, 0.0, 8, 4
    alone = TokenTree.rooted_at(1)
    alone.add(0, 7)  # holds the first committed token
    row.alone = Selection(alone, [{}])
    fed = TokenTree.rooted_at(1)
    fed.add_chain(0, [7, 9, 5])
    row.time_costly(Selection(fed, [{}]), 2, 1.0)
    seconds, alone_seconds = 0.060 / 3 + 0.002, 0.045 / 3  # one held, then the target's own: 2 tokens, no more
    ((tokens, spent, same, without),) = told
    assert (tokens, same) == (2, 2) and spent == pytest.approx(seconds) and without == pytest.approx(alone_seconds)


def test_a_measurement_shows_its_progress_unless_transformers_bars_are_off(capsys):
    from transformers.utils import logging as hf_logging

    from forerun import latency

    model, was_on = tiny_model("llama"), hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        latency.measure_curve(model, sizes=(1, 2), context=8, repeats=1)
        assert "forerun: timing forwards of 1-2 tokens" in capsys.readouterr().err
        hf_logging.disable_progress_bar()
        latency.measure_curve(model, sizes=(1, 2), context=8, repeats=1)
        assert "forerun:" not in capsys.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()


def test_a_shared_count_stays_within_its_cap():
    """Every row's candidates pay on a flat curve; a cap of n nodes (the root one of them) leaves n - 1."""
    from forerun.costmodel import best_shared_count

    flat = LatencyCurve((1, 64), (1.0, 1.0))
    chances = [[0.9] * 10] * 4
    assert best_shared_count(chances, flat) == 10
    assert [best_shared_count(chances, flat, cap) for cap in (0, 1, 2, 5, 64)] == [0, 0, 1, 4, 10]


def test_a_probe_drafting_wins_resets_the_pause_to_its_first_length():
    """Drafting loses (pauses of 32, then 64 plain steps), wins its third probe, then loses again: the pause after
    that is 32 steps again, not the 128 a third loss in a row earns."""
    import itertools

    from forerun.costmodel.switch import PAUSE_STEPS, DraftSwitch

    switch, modes = DraftSwitch(), ""
    for step in range(300):
        drafting = switch.drafting()
        drafted_rate = 1.5 if 120 <= step < 126 else 1.2  # steps 120-125: the third probe
        switch.record(drafting, drafted_rate if drafting else 1.3)
        modes += "d" if drafting else "p"
    pauses = [len(list(run)) for mode, run in itertools.groupby(modes) if mode == "p"]
    assert pauses[:4] == [6, PAUSE_STEPS, 2 * PAUSE_STEPS, PAUSE_STEPS], modes


def test_a_reproducible_batch_pauses_on_what_it_fed_and_starts_over_when_it_loses_half_its_rows():
    """Reproducible rows: steps that feed no candidate pause proposals, whatever the step took (drafting measured
    100x faster); a probe that feeds one, half the rows gone, or a cache grown manyfold (`rebase`) start the
    back-off over.
    Steered rows (the negative control) keep proposing while drafting measures faster."""
    from forerun.costmodel import BatchPolicy, CostModel
    from forerun.costmodel.switch import IDLE_PAUSE_STEPS, IDLE_STEPS, PROBE_STEPS

    def budgets(rows: int, reproducible: bool = True):
        return [CostModel(STEEP, 16, times=None, reproducible=reproducible) for _ in range(rows)]

    def step(policy, rows, fed: bool, reproducible: bool = True) -> bool:
        drafting = policy.drafting(budgets(rows, reproducible))
        seconds = 0.01 if drafting else 1.0  # proposing steps look 100x faster
        policy.record(budgets(rows, reproducible), drafting, [[0, 1]] * rows, seconds, 4 if fed and drafting else 1)
        return drafting

    policy = BatchPolicy()
    assert [step(policy, 4, fed=False) for _ in range(IDLE_STEPS + IDLE_PAUSE_STEPS + 1)] == (
        [True] * IDLE_STEPS + [False] * IDLE_PAUSE_STEPS + [True]
    )  # the probe fed nothing: the next pause is twice as long
    assert policy.idle.paused == 2 * IDLE_PAUSE_STEPS
    assert not step(policy, 3, fed=False)  # a row left mid-pause: a server's rows come and go, the pause holds
    assert step(policy, 2, fed=False)  # half the rows left: drafting may pay again, the back-off starts over
    assert (policy.idle.idle, policy.idle.paused, policy.idle.pause) == (1, 0, IDLE_PAUSE_STEPS)
    policy = BatchPolicy()
    for _ in range(IDLE_STEPS):
        step(policy, 4, fed=False)
    assert not policy.drafting(budgets(4))
    policy.rebase(1000)  # the cache grew manyfold: measured again
    assert policy.drafting(budgets(4))
    steered = BatchPolicy()
    assert sum(step(steered, 4, fed=False, reproducible=False) for _ in range(40)) == 40 - PROBE_STEPS  # plain once
