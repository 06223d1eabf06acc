"""Prompts fed through a static base's buckets: one place's, or several places' in the same forwards.

A prefill feeds its prompt in chunks of the largest bucket (a chain is a tree), then the rest of it with the first
tree, so no eager forward of a shape seen once runs. Several rows joining at once (a batch's start, a server's
queue) are fed side by side: forward k feeds every place's k-th piece, a place whose prompt is done drops out. On a
card a forward of a small model costs launches rather than arithmetic, so sixteen 200-token prompts cost about
what one does (one by one they cost sixteen times that: the GPU benchmark's 16-row batch spent a third of its time
there).

    three places, largest bucket 4: place 0's lead is 9 tokens, place 1's 2, place 2's 5; each has a 1-node tree

        forward 1   place 0: lead[0:4]         place 1: lead + tree (final)   place 2: lead[0:4]
        forward 2   place 0: lead[4:8]                                        place 2: lead[4:5] + tree (final)
        forward 3   place 0: lead[8:9] + tree (final)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from forerun.base.dynamic import TreeLogits
from forerun.base.step_inputs import behind
from forerun.tree import TokenTree, attention_mask_4d

if TYPE_CHECKING:
    from forerun.base.static import StaticBase

Fed = Mapping[int, tuple[TokenTree, int, Sequence[int]]]
"""{place: (tree, prefix_len, lead)}: `lead` then `tree` after `prefix_len` committed tokens, the lead's included."""


def feed_places(base: StaticBase, items: Fed) -> dict[int, TreeLogits]:
    """Each place's `lead` then `tree` (`Fed`), all places in the same bucketed forwards; returns each place's
    tree logits [len(tree), vocab], argmaxes and features (the lead's first). A lone place at 0 takes the base's
    own row graphs, a lone place elsewhere its placed ones (row 0 at that place), several places the rows' graphs
    (row r is place r; places not fed write only into their scratch slots). A tree wider than every bucket goes
    through one eager forward (`eager_prefill`).

    Example (places 0 and 2 of a 4-place base join at once; 300- and 40-token prompts, a root each):
        >>> out = feed_places(base, {0: (root_a, 300, text_a[:300]), 2: (root_b, 40, text_b[:40])})  # doctest: +SKIP
        >>> out[2].logits.shape                                          # doctest: +SKIP
        torch.Size([1, 49152])
    """
    out = {p: eager_prefill(base, t, n, lead, p) for p, (t, n, lead) in items.items() if len(t) > base.largest}
    pending = {p: (n - len(lead), list(lead), t) for p, (t, n, lead) in items.items() if p not in out}
    read: dict[int, list[torch.Tensor]] = {p: [] for p in pending}
    alone = len(pending) == 1
    while pending:
        fed, final = {}, {}
        for place, (start, lead, tree) in list(pending.items()):
            if len(lead) + len(tree) > base.largest:  # the prompt's head: no logits wanted, nothing copied back
                chunk = lead[: base.largest]
                fed[place] = (behind(chunk[:-1], TokenTree.rooted_at(chunk[-1])), start)
                pending[place] = (start + len(chunk), lead[base.largest :], tree)
            else:
                fed[place], final[place] = (behind(lead, tree), start), len(lead)
                del pending[place]
        # a lone place at 0 is the base's own row (its graphs); elsewhere it is fed alone at its place
        placed = alone and next(iter(fed)) != 0
        logits, choices, features = base.run(fed, placed)
        for place, tree_start in final.items():
            row, n = 0 if alone else place, len(items[place][0])
            got = None
            if features is not None:
                got = torch.cat([*read.pop(place), features[row, : tree_start + n]])[None]
            stop = tree_start + n
            # their own copies, on the device: a later forward of the feed replays the graph that wrote them
            out[place] = TreeLogits(logits[row, tree_start:stop].clone(), choices[row, tree_start:stop].clone(), got)
        if features is not None:  # their own copies: the next replay rewrites the graph's
            for place in pending:
                read[place].append(features[0 if alone else place, : len(fed[place][0])].clone())
    return out


def eager_prefill(
    base: StaticBase, tree: TokenTree, prefix_len: int, lead: Sequence[int], place: int = 0
) -> TreeLogits:
    """An eager forward of `lead` then `tree` into `place`: a tree wider than every bucket, and the latency curve's
    context. Returns the tree's logits [len(tree), vocab], argmaxes [len(tree)] and features (the lead's first)."""
    n, start = len(tree), prefix_len - len(lead)
    ids = torch.tensor([[*lead, *tree.tokens]], device=base.device)
    depths = torch.tensor(tree.depths, device=base.device) + prefix_len
    positions = torch.cat([torch.arange(start, prefix_len, device=base.device), depths])[None]
    bools = attention_mask_4d(tree.ancestors(), prefix_len, "sdpa", base.model.dtype, len(lead))
    visible = torch.zeros((*bools.shape[:3], base.length), dtype=torch.bool)
    visible[..., : bools.shape[-1]] = bools
    current = torch.arange(start, start + ids.shape[1], device=base.device)[None]
    base.slots.point(torch.tensor([place], device=base.device), current, contiguous=place == 0)
    logits, features = base.call(ids, positions, visible.to(base.device))
    logits = logits[0, -n:]  # its own tensor: no graph rewrites it
    return TreeLogits(logits, logits.argmax(-1), features)
