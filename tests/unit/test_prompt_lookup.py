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


def scanned(tokens: list[int], config: PromptLookupConfig, eos: frozenset[int]) -> list[tuple[int, list[int]]]:
    """Prompt lookup's continuations by a plain scan of the text: longest match first, most recent first,
    distinct, at most max_branches."""
    from forerun.drafters.base import cut_at_eos

    out, seen = [], set()
    for n in range(config.max_ngram, config.min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - 1, n - 1, -1):
            if n > len(tokens) or tokens[start - n : start] != suffix:
                continue
            draft = cut_at_eos(tokens[start : start + config.draft_len], eos)
            if tuple(draft) not in seen and len(out) < config.max_branches:
                seen.add(tuple(draft))
                out.append((n, draft))
    return out


def test_continuations_equal_a_scan_of_the_text_as_it_grows():
    """The index (each n-gram's latest position, earlier ones chained) finds what a scan of the whole text finds,
    in the same order, step after step on random texts."""
    import random

    rng = random.Random(4)
    for _ in range(100):
        config = PromptLookupConfig(max_ngram=rng.choice([1, 2, 3]), draft_len=rng.choice([1, 3, 8]),
                                    max_branches=rng.choice([1, 3, 8]))  # fmt: skip
        text = [rng.randrange(rng.choice([3, 12])) for _ in range(rng.randint(2, 60))]
        eos = frozenset({0}) if rng.random() < 0.3 else frozenset()
        prompt = rng.randint(1, len(text))
        drafter, c = PromptLookupDrafter(config), ctx(text[:prompt])
        drafter.start(c)
        for token in text[prompt:]:
            assert list(drafter.continuations(c.tokens, eos)) == scanned(c.tokens, config, eos)
            c.tokens.append(token)
            drafter.extend_index(c.tokens)
        assert list(drafter.continuations(c.tokens, eos)) == scanned(c.tokens, config, eos)


def test_a_long_prompt_indexed_gives_the_garbage_collector_nothing_to_keep():
    """A 4,000-token prompt's index held a list of positions per n-gram: ~10,000 objects the garbage collector
    tracked for the request's life (a batch of long prompts, tens of thousands, each set towards a full collection
    of the whole process). Positions chained through ints leave none once its keys' tuples are untracked."""
    import gc
    import random

    rng = random.Random(5)
    prompt = [rng.randrange(2000) for _ in range(4000)]
    drafter = PromptLookupDrafter(PromptLookupConfig(max_ngram=3))
    gc.collect()
    tracked = len(gc.get_objects())
    drafter.start(ctx(prompt))
    gc.collect()  # a collection untracks tuples of ints: the index's keys
    assert len(gc.get_objects()) - tracked < 50, len(gc.get_objects()) - tracked
