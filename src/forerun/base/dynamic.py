"""The base every device can run: a growing `DynamicCache`, each tree fed at its own size.

Its layers are `RoomyLayer`s: a step writes its entries into spare slots where transformers' `DynamicLayer`
concatenates (copies) the whole layer every forward, a cost that grows with the text (docs/benchmarks.md, long
prompts). The entries and what attention computes from them are the same.

Example:
    >>> base = DynamicBase(model)                                      # doctest: +SKIP
    >>> base.begin(max_len=512)                                        # doctest: +SKIP
    >>> out = base.forward(tree, prefix_len=11, lead=prompt[:11])      # the prefill  # doctest: +SKIP
    >>> out.logits.shape                                               # [len(tree), vocab]  # doctest: +SKIP
    >>> base.commit(11, [0, 2])                                        # keep the root and node 2  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from forerun.head import LogitsHead
from forerun.kvcache import UnsupportedCacheError, check_tree_cache, keep_accepted, roomy_cache
from forerun.prefixcache import Prefixes
from forerun.tree import TokenTree, pack


@dataclass(frozen=True)
class TreeLogits:
    """One tree forward's result."""

    logits: torch.Tensor
    """[len(tree), vocab], on the model's device: the raw scores at every node."""
    argmax: torch.Tensor | None = None
    """[len(tree)] int64 on the device: each node's argmax, where the base computes them there (an accelerator),
    left for the step to copy to the host with its draws in one transfer (`forerun.host_copy`); None: the verifier
    takes argmaxes itself, node by node along the walked path."""
    features: torch.Tensor | None = None
    """[1, lead + len(tree), F]: the outputs of the base's `features` layers at every position fed (the lead's
    first), where the base reads them itself; None: the step loop's hooks read them (`forerun.taps`)."""


class TreeBase(Protocol):
    """What the step loop asks of a base: a cache for one request, a tree forward, a commit of the accepted path."""

    features: tuple[int, ...]
    """Decoder layers whose outputs its forwards return (`TreeLogits.features`); the step loop hooks no others."""

    def begin(self, max_len: int) -> str | None:
        """Ready an empty cache for a request of at most `max_len` tokens (prompt, answer and one tree); returns
        None, or why trees cannot be verified on it (then the caller decodes plainly)."""
        ...

    def seed(self, prefixes: Prefixes | None, tokens: list[int]) -> int:
        """Take the KV of a head of `tokens` from `prefixes`; returns how many tokens that covered."""
        ...

    def forward(self, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        """Feed `lead` (prompt tokens not yet cached, at the prefill) and `tree` after `prefix_len` cached
        tokens (the lead's included)."""
        ...

    def commit(self, prefix_len: int, kept_nodes: list[int]) -> int | None:
        """Keep the cache's first `prefix_len` entries and tree nodes `kept_nodes` after them, in that order;
        returns how many of them wait to be fed again with the next step's (`forerun.base.chain`; None: 0)."""
        ...

    def store(self, prefixes: Prefixes | None, tokens: list[int], length: int) -> None:
        """Leave the KV of `tokens` (`length` of them cached) in `prefixes` for later prompts."""
        ...


class DynamicBase:
    """Today's CPU base: a `DynamicCache` that grows in place, trees at their own size, the measured logits
    layout."""

    features: tuple[int, ...] = ()  # hooks read them: every forward here runs the model's modules

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.head = LogitsHead(model)
        self.attention = getattr(model.config, "_attn_implementation", None) or "eager"
        self.cache = roomy_cache(model.config)

    def begin(self, max_len: int) -> str | None:
        self.cache = roomy_cache(self.model.config)
        try:
            check_tree_cache(self.cache, max_len, type(self.model).__name__)
        except UnsupportedCacheError as error:
            return str(error)
        return None

    def seed(self, prefixes: Prefixes | None, tokens: list[int]) -> int:
        return prefixes.seed(self.cache, tokens) if prefixes is not None else 0

    def forward(self, tree: TokenTree, prefix_len: int, lead: Sequence[int]) -> TreeLogits:
        logits = forward_tree(self.head, self.cache, tree, prefix_len, lead, self.attention)
        return TreeLogits(logits, device_argmax(logits))

    def commit(self, prefix_len: int, kept_nodes: list[int]) -> None:
        keep_accepted(self.cache, prefix_len, kept_nodes)

    def store(self, prefixes: Prefixes | None, tokens: list[int], length: int) -> None:
        if prefixes is not None:
            prefixes.store(tokens, self.cache, length)


def device_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Every node's argmax (of logits [..., vocab]) on an accelerator, for the step's one copy to the host (that
    beats a host sync per walked node); None on a CPU (the verifier takes the argmaxes it walks)."""
    return None if logits.device.type == "cpu" else logits.argmax(-1)


def forward_tree(
    head: LogitsHead,
    cache: DynamicCache,
    tree: TokenTree,
    prefix_len: int,
    lead: Sequence[int],
    attention: str,
) -> torch.Tensor:
    """One call of the unmodified model on `tree` (after the `lead` tokens, at the prefill) with `prefix_len`
    tokens cached in `cache`; returns the tree's logits [len(tree), vocab] (the lead's are not computed where the
    model takes `logits_to_keep`)."""
    model = head.model
    packed = pack(tree, prefix_len, attention, model.dtype, model.device, lead)
    return head(
        len(tree),
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        position_ids=packed.position_ids,
        cache=cache,
        use_cache=True,
    )[0, -len(tree) :]
