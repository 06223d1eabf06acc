"""The cost model's edges: what counts as a drafted forward, a chain's length, a batch row's proposal cap."""

from __future__ import annotations

import pytest

from forerun.costmodel import CostModel, ForwardTimes, LatencyCurve, StaticBudget
from forerun.tree import TokenTree


def test_a_two_token_forward_is_a_drafted_one():
    """A root and one guess is a drafted forward: its slowness is the drafts' penalty, not the machine's."""
    times = ForwardTimes()
    for _ in range(100):
        times.record(1, 0.010, 0.010)
        times.record(2, 0.012, 0.024)
    assert times.penalty == pytest.approx(2.0, rel=0.01)


def test_a_chain_budget_feeds_max_nodes_tokens_root_included():
    line = TokenTree.rooted_at(1)
    line.add_chain(0, list(range(2, 12)), source="t", scores=0.9)
    assert StaticBudget(4, chain=True).choose(1, [line]).tree.tokens == [1, 2, 3, 4]
    assert StaticBudget(4).choose(1, [line]).tree.tokens == [1, 2, 3, 4]


def test_a_batch_rows_proposals_stop_at_max_nodes_where_every_size_costs_alike():
    rows = LatencyCurve((1, 2, 4, 8, 16), (0.012,) * 5)
    budget = CostModel(LatencyCurve((1, 16), (0.010, 0.010), ((2, rows),)), 8)
    assert budget.proposal_nodes(2) == 8 and budget.proposal_nodes(1) == 8
