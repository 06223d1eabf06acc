"""A hybrid batch's lone row verifying chains: what `forerun.base.rows.DynamicRows` keeps so that a model with
recurrent states drafts in a batch of one row as it does alone on a `forerun.base.chain.ChainBase`.

Rows of a hybrid whose states cannot be recorded through a step feed one token each a step beside others
(`forerun.rowstates`): a rejected guess cannot be taken out of a row's state, and padding a shorter row would
advance its state too (recorded states are cut back row by row instead: `DynamicRows.chains_together`). A row
alone in its batch (a
server's only request, the last row of `generate([...])`) pads for no one: it feeds its root and a chain of
guesses, its states copied first. Where the target rejects part of the chain, the states are put back, the step's
keys cut, and the accepted tokens wait (`pending`) to be fed again in front of the next step's. Before another row
joins, they are fed alone (`DynamicRows.flush`); the rows then step one token each. States that are convolution
windows only (LFM2), or recurrent states the model writes after each guess where asked (`records`,
`forerun.base.chain.records_states`), are recorded through the step and cut back to the last accepted token
instead, as the keys are: nothing waits.

    lone row:      cache [p0 .. p{L-1}]   fed  r g1 g2 g3               states copied first
    g2 rejected:   states put back, keys cut to L; pending r g1; the target's t is the next root
    next step:     fed  r g1 t h1 h2   at positions L, L+1, ...
    a row joins:   fed  r g1 t' alone (flush), then every row one token a step

Example:
    >>> from transformers import DynamicCache
    >>> chain = LoneChain()
    >>> tree = TokenTree.rooted_at(5)
    >>> tree.add_chain(0, [6, 7])                                              # the guesses' nodes
    [1, 2]
    >>> start, fed = chain.begin(DynamicCache(), prefix_len=11, tree=tree)
    >>> start, fed.tokens, chain.lead
    (11, [5, 6, 7], 0)
    >>> chain.commit(DynamicCache(), slots=11, path_len=2), chain.pending   # 6 accepted, 7 rejected
    (0, [5, 6])
    >>> start, fed = chain.begin(DynamicCache(), prefix_len=13, tree=TokenTree.rooted_at(9))
    >>> start, fed.tokens, chain.lead                                         # fed again first
    (11, [5, 6, 9], 2)
"""

from __future__ import annotations

from transformers import DynamicCache

from forerun.base.chain import StateCopy, before_guesses, chain_of, cut_back, put_back
from forerun.tree import TokenTree, is_chain


class LoneChain:
    """The lone row's chain step: what it feeds (`begin`) and what stays after verification (`commit`)."""

    def __init__(self, records: bool = False) -> None:
        self.records = records
        """Whether the model writes each guess's recurrent state, asked to (`forerun.base.chain.records_states`)."""
        self.pending: list[int] = []
        """Accepted tokens the cache has not read (a partly accepted chain's head): fed before the next step's."""
        self.start = 0
        """Tokens the row's cache holds: where `pending` goes."""
        self.fed: list[int] = []
        """The step's tokens (pending, then the tree's), between `begin` and `commit`."""
        self.nodes = 0
        """How many of `fed` are the tree's (its tail)."""
        self.copies: StateCopy | None = None
        self.recorded = False
        """Whether the step's convolution windows are recorded (`croppable`), to be cut back at `commit`."""

    @property
    def lead(self) -> int:
        """Tokens fed again in front of this step's tree."""
        return len(self.fed) - self.nodes

    def begin(self, cache: DynamicCache, prefix_len: int, tree: TokenTree) -> tuple[int, TokenTree]:
        """The chain to feed for `tree` after `prefix_len` committed tokens: where it starts, and the pending tokens
        and the tree's as one line; the states are copied first where a guess may be rejected."""
        if not is_chain(tree):
            raise ValueError(f"a model with recurrent states verifies chains only; got a tree of {len(tree)} nodes")
        self.fed, self.nodes = [*self.pending, *tree.tokens], len(tree)
        self.start = prefix_len - len(self.pending)
        self.recorded, self.copies = before_guesses(cache, len(tree), self.records)
        return self.start, chain_of(self.fed)

    def commit(self, cache: DynamicCache, slots: int, path_len: int) -> int:
        """The tree's first `path_len` nodes were accepted: returns how many of the fed slots stay (all of them, or
        none where the chain was accepted in part: its states put back, `cache`'s keys cut to `slots`; or, its
        windows recorded, the accepted ones: the windows and keys cut back to them)."""
        kept = self.lead + path_len
        fed, copies, self.fed, self.copies = self.fed, self.copies, [], None
        if self.recorded:
            cut_back(cache, len(fed) - kept, slots + kept)
            self.recorded, self.pending, self.start = False, [], self.start + kept
            return kept
        if copies is None or kept == len(fed):
            self.pending, self.start = [], self.start + len(fed)
            return len(fed)
        put_back(cache, copies, slots)
        self.pending = fed[:kept]
        return 0
