import pytest
import torch

import forerun
from forerun.config import JacobiConfig
from forerun.drafters.base import DraftContext, StepOutcome
from forerun.drafters.jacobi import JacobiDrafter, NGramPool
from forerun.verify import Verdict


def outcome(tree, choices, copied=False):
    """A step in which the target's greedy choice at node i was choices[i], all nodes fed: as one-hot logits, or
    (`copied`) as the list a card's base copies to the host with the step, beside logits that must not be read."""
    if copied:
        return StepOutcome(tree, Verdict([], 0), torch.empty(0), [0], {i: i for i in range(len(tree))}, None, choices)
    logits = torch.nn.functional.one_hot(torch.tensor(choices), 100).float()
    return StepOutcome(tree, Verdict([], 0), logits, [0], {i: i for i in range(len(tree))})


def ctx(tokens, prompt_len=None):
    return DraftContext(list(tokens), prompt_len or len(tokens), 64, frozenset())


def test_window_probe_construction_w3_n3():
    """The module docstring's hand-worked example: exact nodes, parents, depths (positions - prefix)."""
    drafter = JacobiDrafter(JacobiConfig(window=3, ngram=3, max_candidates=1, pool_from_prompt=False))
    drafter.levels = [[4, 5, 6], [7, 8, 9]]
    drafter.pool.add([3, 11, 12])
    tree = drafter.propose(ctx([1, 2, 3]))
    assert tree.tokens == [3, 4, 5, 6, 7, 8, 9, 11, 12]
    assert tree.parents == [-1, 0, 1, 2, 1, 2, 3, 0, 7]
    assert tree.depths == [0, 1, 2, 3, 2, 3, 4, 1, 2]
    assert tree.roles == ["root"] + ["probe"] * 6 + ["candidate"] * 2


@pytest.mark.parametrize("copied", [False, True])
def test_warm_up_then_ngrams_enter_the_pool_and_the_window_moves(copied):
    """The window learns the target's choices at its probes; `copied`: read from the step's copied choices (no
    device round trip per probe), the same as from the logits."""
    config = JacobiConfig(window=2, ngram=3, max_candidates=2, pool_from_prompt=False, lazy_window=False, seed=1)
    drafter = JacobiDrafter(config)
    c = ctx([10, 20, 30])
    drafter.start(c)
    assert len(drafter.levels[0]) == 2 and set(drafter.levels[0]) <= {10, 20, 30}  # seeded from the prompt
    level0 = drafter.levels[0] = [10, 20]
    # step 1 (warm-up): choices at level-0 nodes become level 1
    tree = drafter.propose(c)
    choices = [0] * len(tree)
    choices[1], choices[2] = 41, 42
    drafter.observe(c, outcome(tree, choices, copied))
    assert drafter.levels == [level0, [41, 42]]
    assert len(drafter.pool) == 0
    # step 2: window full, choices at level-1 nodes (3, 4) complete the n-grams
    tree = drafter.propose(c)
    assert tree.parents[3:5] == [1, 2]
    choices = [0] * len(tree)
    choices[3], choices[4] = 51, 52
    drafter.observe(c, outcome(tree, choices, copied))
    assert drafter.pool.query(10, 5) == [(41, 51)]
    assert drafter.pool.query(20, 5) == [(42, 52)]
    assert drafter.levels == [[41, 42], [51, 52]]


def test_lazy_window_waits_for_candidates():
    """lazy_window: no pool n-gram for the root -> a root-only tree and the window does not move."""
    drafter = JacobiDrafter(JacobiConfig(window=1, ngram=3, max_candidates=2, pool_from_prompt=False, lazy_window=True))
    c = ctx([10, 20, 30])
    drafter.start(c)
    drafter.levels = [[10], [11]]
    tree = drafter.propose(c)
    assert tree.tokens == [30] and drafter.probe_nodes == []
    drafter.observe(c, outcome(tree, [0]))
    assert drafter.levels == [[10], [11]] and len(drafter.pool) == 0
    drafter.pool.add([30, 7, 8])  # now the root has a candidate: window (2 probes) + candidate chain
    tree = drafter.propose(c)
    assert tree.tokens == [30, 10, 11, 7, 8]
    assert tree.roles == ["root", "probe", "probe", "candidate", "candidate"]
    choices = [0, 0, 12, 0, 0]
    drafter.observe(c, outcome(tree, choices))
    assert drafter.levels == [[11], [12]] and drafter.pool.query(10, 5) == [(11, 12)]


def test_pool_fifo_keeps_the_newest_g():
    pool = NGramPool(capacity=2, policy="fifo")
    for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [2, 9, 9]):
        pool.add(gram)
    assert pool.query(1, 5) == [(6, 7), (4, 5)]
    assert pool.query(2, 5) == [(9, 9)]
    assert pool.query(3, 5) == []


def test_pool_frequency_keeps_the_most_seen():
    pool = NGramPool(capacity=2, policy="frequency")
    for gram in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7]):
        pool.add(gram)
    # (4, 5) and (6, 7) were seen once; (4, 5) is older and leaves
    assert pool.query(1, 5) == [(2, 3), (6, 7)]


def test_pool_from_prompt_seeds_ngrams():
    drafter = JacobiDrafter(JacobiConfig(window=2, ngram=3, max_candidates=3))
    drafter.start(ctx([1, 2, 3, 1, 2, 4]))
    assert drafter.pool.query(1, 5) == [(2, 4), (2, 3)]


@pytest.mark.parametrize(
    "knobs",
    [{"window": 0}, {"ngram": 1}, {"max_candidates": -1}, {"window": 2.5}, {"ngram": "3"}, {"pool_policy": "lru"}],
)
def test_bad_knobs_raise_value_error_naming_the_value(knobs):
    with pytest.raises(ValueError, match=next(iter(knobs))):
        JacobiConfig(**knobs)


def test_window_larger_than_budget_is_refused():
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match="max_tree_nodes=8"):
        forerun.Decoder(tiny_model("llama"), None, "jacobi", max_tree_nodes=8, window=4, ngram=4)


def test_defaults_follow_the_device_kind_and_knobs_win():
    from forerun.config import JacobiConfig
    from forerun.methods import device_defaults

    from tiny_models import tiny_model

    lade = {"window": 7, "ngram": 5, "max_candidates": 7, "pool_from_output": False, "lazy_window": False}
    assert device_defaults("jacobi", "cuda") == lade
    assert device_defaults("jacobi", "cpu") == {} and device_defaults("jacobi", "mps") == {}
    model = tiny_model("llama")
    steep = forerun.LatencyCurve((1, 16), (0.010, 0.025))  # a CPU's fp32 curve (a tiny model's own is flat)
    assert forerun.Decoder(model, None, "jacobi", latency=steep).config == JacobiConfig()  # this test runs on a CPU
    assert forerun.Decoder(model, None, "jacobi", window=5).config.window == 5


def test_the_window_waits_when_the_budget_feeds_none_of_its_probes():
    """A cost model may feed the root alone: the window must not move on choices it never got."""
    drafter = JacobiDrafter(
        JacobiConfig(window=1, ngram=3, max_candidates=2, pool_from_prompt=False, lazy_window=False)
    )
    c = ctx([10, 20, 30])
    drafter.start(c)
    drafter.levels = [[10], [11]]
    tree = drafter.propose(c)
    assert tree.roles == ["root", "probe", "probe"]
    fed_root_only = StepOutcome(tree, Verdict([], 0), torch.zeros(1, 100), [0], {0: 0})
    drafter.observe(c, fed_root_only)
    assert drafter.levels == [[10], [11]] and len(drafter.pool) == 0


def test_candidates_carry_count_scores():
    drafter = JacobiDrafter(JacobiConfig(window=1, ngram=3, max_candidates=2, pool_from_prompt=False))
    for gram in ([5, 1, 2], [5, 1, 2], [5, 1, 2], [5, 3, 4]):
        drafter.pool.add(gram)
    drafter.levels = [[9], [9]]
    tree = drafter.propose(ctx([5]))
    scores = {tuple(tree.tokens[i] for i in tree.path_to(n)[1:]): tree.scores[n] for n in range(len(tree))}
    assert scores[(3,)] == 1 / 5 and scores[(3, 4)] == 1 / 2  # seen once of 4: 1 / (4 + 1); then 1 / (1 + 1)
    assert scores[(1,)] == 3 / 5 and scores[(1, 2)] == 3 / 4
