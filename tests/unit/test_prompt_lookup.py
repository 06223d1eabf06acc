from forerun.config import PromptLookupConfig
from forerun.drafters.base import DraftContext
from forerun.drafters.prompt_lookup import PromptLookupDrafter


def ctx(tokens, eos=frozenset()):
    return DraftContext(tokens=list(tokens), prompt_len=len(tokens), budget=32, eos_token_ids=eos)


def test_docstring_example_longest_match_most_recent_first():
    drafter = PromptLookupDrafter(PromptLookupConfig(max_ngram=2, min_ngram=1, draft_len=3, max_branches=2))
    c = ctx([1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    drafter.start(c)
    tree = drafter.propose(c)
    assert tree.tokens == [2, 5, 6, 1, 3, 4, 1]
    assert tree.parents == [-1, 0, 1, 2, 0, 4, 5]


def test_drafts_are_cut_at_eos():
    drafter = PromptLookupDrafter(PromptLookupConfig(max_ngram=1, draft_len=5, max_branches=1))
    c = ctx([7, 8, 9, 0, 4, 7], eos=frozenset({9}))
    drafter.start(c)
    assert drafter.propose(c).tokens == [7, 8, 9]


def test_index_grows_with_output_and_no_match_gives_root_only():
    drafter = PromptLookupDrafter(PromptLookupConfig(max_ngram=2, draft_len=2, max_branches=1))
    c = ctx([10, 11, 12])
    drafter.start(c)
    assert drafter.propose(c).tokens == [12]
    c.tokens += [13, 11, 12]
    drafter.observe(c, None)
    assert drafter.propose(c).tokens == [12, 13, 11]


def test_budget_limits_the_tree():
    drafter = PromptLookupDrafter(PromptLookupConfig(max_ngram=1, draft_len=10, max_branches=2))
    c = ctx([1, 2, 3, 4, 5, 6, 1, 9, 9, 9, 1])
    c.budget = 4
    drafter.start(c)
    assert len(drafter.propose(c)) == 4


def test_a_full_tree_asks_for_no_more_continuations():
    """Once a proposal holds its budget's nodes, later continuations could only be fused or dropped: the drafter
    stops looking (a batch row's share of a flat curve's cap is a chain or two of eight), and the tree is the one a
    budget-free proposal cut to that budget would give (the negative control: a larger budget reads them all)."""
    config = PromptLookupConfig(max_ngram=1, draft_len=4, max_branches=8)
    text = [1, 10, 11, 12, 13, 1, 20, 21, 22, 23, 1, 30, 31, 32, 33, 1, 40, 41, 42, 43, 1]

    class Counting(PromptLookupDrafter):
        read = 0

        def continuations(self, tokens, eos_token_ids):
            for found in super().continuations(tokens, eos_token_ids):
                self.read += 1
                yield found

    for budget, read in ((6, 2), (32, 4)):
        drafter, c = Counting(config), ctx(text)
        c.budget = budget
        drafter.start(c)
        tree = drafter.propose(c)
        assert drafter.read == read, budget
        assert tree.tokens == [1, 40, 41, 42, 43, 30, 31, 32, 33, 20, 21, 22, 23, 10, 11, 12, 13][:budget]
