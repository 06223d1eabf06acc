"""What a batch's rows share: one cache and the forward that feeds every row at once (`forerun.batch.Batch` steps
on one of these, whatever the device).

- `DynamicRows`: one growing `DynamicCache` whose slots need not line up (`forerun.rowcache.RowCache`); a joining
  row's prompt is read into a cache of its own and spliced in; the prefix cache serves both. The CPU's.
- `StaticRows` (`forerun.base.static_rows`): a `StaticBase` with a place per row, each at its own prefix length,
  one graph per (rows, bucket) on a GPU. The GPU's.

Both give each row the logits its single run would see (fp32: the same tokens, the tests check it).

Example (what `Batch` does with either):
    >>> rows = DynamicRows(model)                                              # doctest: +SKIP
    >>> own, cached = rows.open(job.prefixes, tokens, max_len=600)             # doctest: +SKIP
    >>> first = rows.feed(own, tree, prefix_len=len(tokens) - 1, lead=tokens[:-1])   # the prefill  # doctest: +SKIP
    >>> index = rows.admit(own, len(tokens) - 1, [0, 1], job.prefixes, tokens)       # it joins  # doctest: +SKIP
    >>> out = rows.forward([prefix_len], [tree], nodes=len(tree))               # doctest: +SKIP
    >>> out.row(0, len(tree)).shape                                            # doctest: +SKIP
    torch.Size([5, 49152])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from forerun.base.chain import before_guesses, chain_of, croppable, state_layers
from forerun.base.dynamic import TreeLogits, device_argmax, forward_tree
from forerun.base.lone_chain import LoneChain
from forerun.head import LogitsHead
from forerun.kvcache import keep_accepted
from forerun.prefixcache import Prefixes
from forerun.rowcache import RowCache
from forerun.rowstates import cut_states, has_states
from forerun.tree import TokenTree, as_attention_mask, is_chain

Leaving = tuple[int, Prefixes | None, list[int], int]
"""A row that leaves: its index among the rows, and where its text (tokens, `length` of them cached) is kept."""


@dataclass(frozen=True)
class RowsLogits:
    """A batch forward's outputs: `logits` [forward rows, nodes, vocab] in which row b is `logits[at[b]]` (a static
    base's place order: gathered into row order they were a copy of rows x nodes x vocab floats a step, 200 MB
    for 16 rows of 64 nodes in fp32; read before the next forward, which may rewrite them), every node's argmax
    [forward rows, nodes] on the device in the same order (None: the verifier takes them; the step copies them
    to the host with its draws, `forerun.host_copy`) and the `features` layers' outputs [rows, nodes, F] in row
    order (None: hooks read them)."""

    logits: torch.Tensor
    at: Sequence[int]
    argmax: torch.Tensor | None
    features: torch.Tensor | None

    def row(self, b: int, nodes: int) -> torch.Tensor:
        """Row b's logits [nodes, vocab]."""
        return self.logits[self.at[b], :nodes]


class SharedRows(Protocol):
    """What `Batch` asks of the rows' shared cache. `own` is a joining row's handle (its own cache, or its place)."""

    features: tuple[int, ...]
    """Decoder layers whose outputs its forwards return; `Batch` hooks no others (`forerun.taps`)."""
    side_by_side: bool
    """Whether `feed_many` feeds its rows in the same forwards (else one by one: rows joining together are then
    begun and fed one after another, so that each finds the text the one before it stored)."""

    chains_together: bool
    """Whether a hybrid's rows feed chains of guesses side by side (each cut back to its own last kept token)."""

    @property
    def slots(self) -> int:
        """Slots every row's attention reads (what a batch's forward cost grows with)."""
        ...

    def open(self, prefixes: Prefixes | None, tokens: list[int], max_len: int) -> tuple[object, int]:
        """A joining row of at most `max_len` tokens: its handle, and how many of `tokens` are cached already."""
        ...

    def feed(self, own: object, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        """A joining row's forward: `lead` then `tree` after `prefix_len` tokens (the lead's included)."""
        ...

    def feed_many(self, fed: Sequence[tuple[object, TokenTree, int, Sequence[int]]]) -> list[TreeLogits]:
        """`feed` of several joining rows, each (own, tree, prefix_len, lead); in the same forwards where it can."""
        ...

    def admit(self, own: object, prefix_len: int, path: list[int], prefixes: Prefixes | None, tokens: list[int]) -> int:
        """Keep the row's accepted `path` after `prefix_len` and take it in; returns its index among the rows."""
        ...

    def abandon(self, own: object) -> None: ...

    def settle(self) -> None:
        """Before a forward: room left by rows that went is given back."""
        ...

    @property
    def waiting(self) -> int:
        """Accepted tokens of a lone row that its next forward feeds again before its tree (a hybrid's chain
        accepted in part: `forerun.base.lone_chain`); 0 elsewhere."""
        ...

    def forward(self, prefix_lens: Sequence[int], trees: Sequence[TokenTree], nodes: int) -> RowsLogits:
        """One forward of every row's tree, in row order (`RowsLogits`)."""
        ...

    def in_row_order(self, tapped: torch.Tensor | None) -> torch.Tensor | None:
        """The last forward's tapped features [rows, nodes, F] in row order."""
        ...

    def keep(self, prefix_lens: Sequence[int], kept: Sequence[list[int]], nodes: int) -> None:
        """Each row's accepted path (node indices, root first) after its `prefix_lens` committed tokens."""
        ...

    def compact(self) -> None: ...

    def remove(self, leaving: Sequence[Leaving]) -> None: ...

    def without_rows(self) -> SharedRows:
        """A fresh one for a batch started afresh (its rows failed), where the rows still joining keep theirs."""
        ...


class DynamicRows:
    """Rows on one growing `DynamicCache` (`RowCache`), each tree padded to the step's widest (module docstring)."""

    features: tuple[int, ...] = ()  # hooks read them: every forward here runs the model's modules
    side_by_side = False

    def __init__(self, model: torch.nn.Module, records: bool = False) -> None:
        self.model, self.records = model, records  # records: a hybrid's lone row cuts its chains' states back
        self.cache = RowCache(model.config)
        layers = self.cache.cache.layers  # none yet where the config lays none out: layers then come as they are fed
        states_alone = [has_states(layer) and not isinstance(layer, DynamicLayer) for layer in layers]
        self.attends = not (layers and all(states_alone))
        """Whether any layer attends (not a state-space model's, whose layers all hold states alone: Mamba's)."""
        self.attention = model.config._attn_implementation or "eager"
        self.head = LogitsHead(model)
        """The batch's forwards (its first prefill decides how the logits of a few positions are computed)."""
        self.chain = LoneChain(records)
        """A hybrid's lone row: its chains (`forerun.base.lone_chain`)."""
        self.recorded = False  # this step's states are recorded, to be cut back row by row at `keep`

    @property
    def slots(self) -> int:
        return self.cache.slots

    @property
    def chains_together(self) -> bool:
        """A hybrid whose states are convolution windows only (LFM2), or whose forward writes each fed token's
        recurrent state where asked (`records`): its rows feed chains side by side, padded at their ends, and each
        row's states are cut back to its own last kept token (`rowstates.cut_states`), its rejected keys left as
        holes. States put back from a copy would need a copy per row: those rows feed one token each."""
        return self.cache.states and (self.records or croppable(self.cache.cache))

    @property
    def waiting(self) -> int:
        return len(self.chain.pending)

    def open(self, prefixes: Prefixes | None, tokens: list[int], max_len: int) -> tuple[DynamicCache, int]:
        own = DynamicCache(config=self.model.config)
        if prefixes is None:
            return own, 0
        if self.cache.states:  # a hybrid's: a copy of a stored cache whose whole text heads the prompt (a turn)
            seeded, held = prefixes.whole_copy(tokens)
            return (own if seeded is None else seeded), held
        return own, prefixes.seed(own, tokens)

    def feed(self, own: DynamicCache, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        return TreeLogits(forward_tree(self.head, own, tree, prefix_len, lead, self.attention))

    def feed_many(self, fed: Sequence[tuple[DynamicCache, TokenTree, int, Sequence[int]]]) -> list[TreeLogits]:
        # one after another: each prompt has a cache of its own until it is admitted, and a CPU's forward costs its
        # arithmetic, which side by side saves nothing
        return [self.feed(*row) for row in fed]

    def admit(
        self, own: DynamicCache, prefix_len: int, path: list[int], prefixes: Prefixes | None, tokens: list[int]
    ) -> int:
        self.flush()
        keep_accepted(own, prefix_len, path)
        if prefixes is not None:
            prefixes.store(tokens, own, prefix_len + len(path))
        return self.cache.add(own, prefix_len + len(path))

    def abandon(self, own: DynamicCache) -> None:
        pass

    def settle(self) -> None:
        self.cache.settle()

    def forward(self, prefix_lens: Sequence[int], trees: Sequence[TokenTree], nodes: int) -> RowsLogits:
        keep = None
        if self.cache.states and len(trees) == 1 and (self.chain.pending or len(trees[0]) > 1):
            keep = len(trees[0])  # a hybrid's lone row: its tokens waiting, then its chain
            start, fed = self.chain.begin(self.cache.cache, prefix_lens[0], trees[0])
            prefix_lens, trees, nodes = [start], [fed], len(fed)
        elif self.chain.pending:
            raise RuntimeError("a lone row's waiting tokens must be fed before other rows join (`flush`)")
        elif self.cache.states and nodes > 1:  # rows' chains side by side: each row's states cut back at `keep`
            if not (self.chains_together and all(map(is_chain, trees))):
                raise RuntimeError("a hybrid's rows feed chains together only where their states are recorded")
            self.recorded, _ = before_guesses(self.cache.cache, nodes, self.records)  # recorded, nothing copied
        logits = self.run(prefix_lens, trees, nodes, keep)[:, -(keep or nodes) :]  # [rows, nodes, vocab]
        return RowsLogits(logits, range(len(trees)), device_argmax(logits), None)

    def run(self, prefix_lens: Sequence[int], trees: Sequence[TokenTree], nodes: int, keep: int | None) -> torch.Tensor:
        """The model's logits for the rows' trees (the last `keep` positions' at least; None: all)."""
        input_ids, position_ids, mask = self.pack(prefix_lens, trees, nodes)
        return self.head(
            keep,
            input_ids=input_ids,
            attention_mask=mask if self.attends else None,  # a state-space model reads a mask as padding
            position_ids=position_ids,
            cache=self.cache.cache,
            use_cache=True,
        )

    def flush(self) -> None:
        """Feed a lone row's waiting tokens alone (before another row joins: rows together feed one token each)."""
        pending = self.chain.pending
        if pending:
            self.run([self.chain.start], [chain_of(pending)], len(pending), 1)
            self.cache.keep_all(len(pending))
            self.chain.pending, self.chain.start = [], self.chain.start + len(pending)

    def in_row_order(self, tapped: torch.Tensor | None) -> torch.Tensor | None:
        return tapped if tapped is None else tapped[:, self.chain.lead :]  # the tree's: not the tokens fed again

    def keep(self, prefix_lens: Sequence[int], kept: Sequence[list[int]], nodes: int) -> None:
        if self.chain.fed:
            self.cache.keep_all(self.chain.commit(self.cache.cache, self.cache.slots, len(kept[0])))
            return
        cut, self.recorded = self.recorded, False
        if cut:  # padding fed after a shorter chain is dropped with its rejected guesses
            for layer in state_layers(self.cache.cache):
                cut_states(layer, [nodes - len(path) for path in kept])
        self.cache.keep(kept, nodes, windows_cut=cut)

    def compact(self) -> None:
        self.cache.compact()

    def remove(self, leaving: Sequence[Leaving]) -> None:
        places = self.cache.places()
        for index, prefixes, tokens, length in leaving:
            if prefixes is None:
                continue
            if not self.cache.states:  # what it read (prompt, answer) for its next turn
                prefixes.store(tokens, self.cache.row(places[index]), length)
            elif length <= len(tokens):  # a hybrid's whole cache, states included (not where a stop cut the text)
                held = length - self.waiting  # a lone row's: what its cache has read
                prefixes.keep_whole(tokens[:held], self.cache.row(places[index]))
        if len(leaving) == len(places):
            self.cache, self.chain = RowCache(self.model.config), LoneChain(self.records)
        else:  # their places are kept for rows that join before the next step (`RowCache.refill`)
            self.cache.vacate([places[index] for index, *_ in leaving])

    def without_rows(self) -> DynamicRows:
        return DynamicRows(self.model, self.records)  # a joining row's cache is its own until it is admitted

    def pack(
        self, prefix_lens: Sequence[int], trees: Sequence[TokenTree], nodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids and position_ids [rows, nodes]; the mask [rows, 1, nodes, slots + nodes].

        A row sees its visible slots, then its tree's ancestry; padding nodes (rows with smaller trees) repeat
        the root at its position and see the row's slots and themselves only: no row ever attends to them.
        """
        rows, slots = len(trees), self.cache.slots
        input_ids = torch.zeros(rows, nodes, dtype=torch.long)
        position_ids = torch.zeros(rows, nodes, dtype=torch.long)
        visible = torch.zeros(rows, nodes, slots + nodes, dtype=torch.bool)
        visible[:, :, :slots] = self.cache.visible[:, None, :]
        for b, (prefix_len, tree) in enumerate(zip(prefix_lens, trees, strict=True)):
            size = len(tree)
            input_ids[b, :size] = torch.tensor(tree.tokens)
            input_ids[b, size:] = tree.tokens[0]
            position_ids[b, :size] = torch.tensor(tree.depths) + prefix_len
            position_ids[b, size:] = prefix_len
            visible[b, :size, slots : slots + size] = tree.ancestors()
            visible[b, range(size, nodes), range(slots + size, slots + nodes)] = True
        mask = as_attention_mask(visible[:, None], self.attention, self.model.dtype)
        device = self.model.device
        return input_ids.to(device), position_ids.to(device), mask.to(device)
