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
