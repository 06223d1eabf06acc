"""What the static base's steps cost, for the cost model: one row's step per bucket, and a batch's step per row
count and tokens per row. Host work and the step's one transfer are included: that is what a step costs.

Example:
    >>> curve = measure_curve(StaticBase(model))          # 1..64 nodes: each costs its bucket  # doctest: +SKIP
    >>> rows = measure_rows(StaticBase(model), (2, 4), (1, 2, 4))   # ((2, curve), (4, curve))  # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from forerun.base.prompt_feed import eager_prefill
from forerun.costmodel import LatencyCurve
from forerun.measured import fastest, synchronize
from forerun.tree import TokenTree

if TYPE_CHECKING:
    from forerun.base.static import StaticBase


def context_tokens(base: StaticBase, count: int) -> list[int]:
    vocab = base.model.get_input_embeddings().weight.shape[0]
    return torch.randint(0, vocab, (count,), generator=torch.Generator().manual_seed(0)).tolist()


def chain(tokens: list[int], size: int) -> TokenTree:
    tree = TokenTree.rooted_at(tokens[0])
    tree.add_chain(0, tokens[1:size])
    return tree


@torch.inference_mode()
def measure_curve(base: StaticBase, context: int = 256, repeats: int = 3) -> LatencyCurve:
    """Seconds per step at each bucket after `context` cached tokens (the fastest of `repeats` rounds after a
    warm-up round), as a curve over every size 1..largest: n nodes cost their bucket."""
    base.begin(context + 1)
    tokens = context_tokens(base, context + base.largest)
    eager_prefill(base, TokenTree.rooted_at(tokens[context]), context, tokens[:context])

    def seconds_of(size: int) -> float:
        synchronize(base.device)
        started = time.perf_counter()
        out = base.forward(chain(tokens[context:], size), context, ())
        out.argmax.tolist()  # the step's one copy to the host: a step ends when its tokens are there
        return time.perf_counter() - started

    what = f"timing steps of {len(base.buckets)} tree sizes (first rounds capture their graphs; once per device)"
    cost = fastest(base.buckets, seconds_of, repeats, what)
    sizes = tuple(range(1, base.largest + 1))
    return LatencyCurve(sizes, tuple(cost[base.bucket(n)] for n in sizes))


@torch.inference_mode()
def measure_rows(
    base: StaticBase, rows: Sequence[int], sizes: Sequence[int], context: int = 256, repeats: int = 2
) -> tuple[tuple[int, LatencyCurve], ...]:
    """Per row count r: seconds of a batch's step of r rows x n nodes (each row a chain after `context` cached
    tokens of its own) on `base`'s sibling of r places, as `forerun.latency.measure_batched` times the growing
    cache's."""
    sizes = sorted({int(n) for n in sizes} | {1})
    if max(sizes) > base.largest:
        raise ValueError(f"sizes up to {max(sizes)} exceed the largest bucket ({base.largest})")
    tokens = context_tokens(base, context + max(sizes))
    out = []
    for count in sorted(set(rows)):
        sibling = base.sibling(count)
        sibling.begin(context + 1)
        for place in range(count):
            sibling.forward(TokenTree.rooted_at(tokens[context]), context, tokens[:context], place=place)

        def seconds_of(n: int, sibling=sibling, count=count) -> float:
            fed = {place: (chain(tokens[context:], n), context) for place in range(count)}
            synchronize(base.device)
            started = time.perf_counter()
            sibling.forward_rows(fed)
            return time.perf_counter() - started

        cost = fastest(sizes, seconds_of, repeats, f"timing steps of {count} rows (once per device)")
        out.append((count, LatencyCurve(tuple(sizes), tuple(cost[n] for n in sizes))))
    return tuple(out)
